"""Public `centroid_logits` (SPEC §4.3): validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve
from .dense_lm_head import MAX_K

OP = "centroid_logits"
OUTPUTS = ("argmax", "topk", "sparse", "dense")


def shape_params(hidden, centroids, token_ordering, lm_head, *, top_k, output, k) -> dict:
    """The shape parameters a call passes to resolve(): `auto` follows verified.py's evidence for them
    (benchmarks.make_verified.SHAPES)."""
    T, Hd = hidden.shape
    return {"T": T, "Hd": Hd, "C": centroids.shape[0], "V": token_ordering.shape[0], "top_k": top_k,
            "output": output, "k": k}


def centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k=32, output="argmax", fill_value=None, k=1,
                    backend="auto"):
    """Two-stage centroid LM head of the E2B/E4B drafters.

    hidden [T, Hd]; centroids [C, Hd]; token_ordering [V] (a permutation of [0, V), cluster c owns
    token_ordering[c*V/C:(c+1)*V/C]); lm_head [V, Hd]. Stage 1 keeps the top_k clusters by
    hidden @ centroids.T (ties to the lower cluster index), stage 2 scores their K = top_k * V/C tokens.
    output="argmax" -> (token [T] int64, logit [T] fp32), ties to the lowest vocabulary id;
    output="topk"   -> (ids [T, k] int64, logits [T, k] fp32), the k best candidates, best first, ties to
                       the lower id (a NaN logit above every number, as torch sorts); 1 <= k <= min(K, 16);
    output="sparse" -> (ids [T, K] int64, logits [T, K] fp32) in cluster order, then ordering order;
    output="dense"  -> [T, V] fp32, non-candidates = fill_value (default -inf).
    """
    C.tensor(OP, "hidden", hidden, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "centroids", centroids, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "token_ordering", token_ordering, ndim=1, dtypes=C.INDEX_DTYPES)
    C.tensor(OP, "lm_head", lm_head, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.same_dtype(OP, "hidden", hidden, [("centroids", centroids), ("lm_head", lm_head)])
    C.same_device(OP, "hidden", hidden, [("centroids", centroids), ("token_ordering", token_ordering), ("lm_head", lm_head)])
    T, Hd = hidden.shape
    Cn = centroids.shape[0]
    V = token_ordering.shape[0]
    C.dim(OP, "centroids", centroids, 1, Hd, "Hd = hidden.shape[1]")
    C.dim(OP, "lm_head", lm_head, 1, Hd, "Hd = hidden.shape[1]")
    C.dim(OP, "lm_head", lm_head, 0, V, "V = token_ordering.shape[0]")
    if V == 0:
        C.fail_value(OP, "token_ordering", "non-empty", "length 0")
    if Cn < 1 or V % Cn != 0:
        C.fail_value(OP, "token_ordering", f"of a length that is a multiple of the centroid count {Cn}", f"length {V}")
    for name, t in (("hidden", hidden), ("centroids", centroids), ("lm_head", lm_head)):
        C.inner_contiguous(OP, name, t)
    C.contiguous(OP, "token_ordering", token_ordering)
    C.positive_int(OP, "top_k", top_k)
    if top_k > Cn:
        C.fail_value(OP, "top_k", f"<= the number of centroids {Cn}", top_k)
    if output not in OUTPUTS:
        C.fail_value(OP, "output", f"one of {OUTPUTS}", repr(output))
    C.positive_int(OP, "k", k)
    if output == "topk" and k > min(top_k * (V // Cn), MAX_K):
        C.fail_value(OP, "k", f"<= min(K = top_k * V / C, {MAX_K}) = {min(top_k * (V // Cn), MAX_K)}", k)
    if k != 1 and output != "topk":
        C.fail_value(OP, "k", "1 unless output='topk'", k)
    if fill_value is not None:
        if output != "dense":
            C.fail_value(OP, "fill_value", "None unless output='dense'", fill_value)
        if isinstance(fill_value, bool) or not isinstance(fill_value, (int, float)):
            C.fail_type(OP, "fill_value", "a float", f"{type(fill_value).__name__} {fill_value!r}")
    if C.values_checkable(token_ordering):
        C.index_range(OP, "token_ordering", token_ordering, 0, V, "vocabulary ids")
        if V and int(torch.bincount(token_ordering.long(), minlength=V).max()) != 1:
            C.fail_value(OP, "token_ordering", f"a permutation of [0, {V})", "repeated ids")
    impl = resolve(OP, backend, hidden.device, hidden.dtype,
                   shape_params(hidden, centroids, token_ordering, lm_head, top_k=top_k, output=output, k=k))
    return impl(hidden, centroids, token_ordering, lm_head, top_k=top_k, output=output,
                fill_value=_dense_fill(output, fill_value), k=k)


def _dense_fill(output, fill_value):
    """The one place the default fill (-inf) is decided: backends receive a float for "dense"."""
    if output != "dense":
        return None
    return float("-inf") if fill_value is None else float(fill_value)
