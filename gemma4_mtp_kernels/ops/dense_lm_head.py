"""Public `dense_lm_head`: validation, then dispatch."""
from __future__ import annotations

from .. import _checks as C
from .._dispatch import resolve

OP = "dense_lm_head"
OUTPUTS = ("topk", "dense")
MAX_K = 16  # tree branching; the Triton kernel unrolls one selection pass per rank


def shape_params(hidden, lm_head, *, output, k) -> dict:
    """The shape parameters a call passes to resolve(): `auto` follows verified.py's evidence for them
    (benchmarks.make_verified.SHAPES)."""
    return {"T": hidden.shape[0], "Hd": hidden.shape[1], "V": lm_head.shape[0], "k": k, "output": output}


def dense_lm_head(hidden, lm_head, *, output="topk", k=1, backend="auto"):
    """The dense LM head of the 26B / 31B drafters, read once in its own dtype.

    hidden [T, Hd]; lm_head [V, Hd]. Logits are fp32: hidden @ lm_head.T with fp32 accumulation of
    the (exact) products, no fp32 copy of the head. output="topk" -> (ids [T, k] int64, logits [T, k]
    fp32), best first, ties to the lower id (a NaN logit ranks above every number, as torch sorts);
    output="dense" -> logits [T, V] fp32 (for sampling). 1 <= k <= min(V, 16).
    """
    C.tensor(OP, "hidden", hidden, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "lm_head", lm_head, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.same_dtype(OP, "hidden", hidden, [("lm_head", lm_head)])
    C.same_device(OP, "hidden", hidden, [("lm_head", lm_head)])
    C.dim(OP, "lm_head", lm_head, 1, hidden.shape[1], "Hd = hidden.shape[1]")
    C.inner_contiguous(OP, "hidden", hidden)
    C.inner_contiguous(OP, "lm_head", lm_head)
    V = lm_head.shape[0]
    if V == 0:
        C.fail_value(OP, "lm_head", "at least one row", f"shape {tuple(lm_head.shape)}")
    if output not in OUTPUTS:
        C.fail_value(OP, "output", f"one of {OUTPUTS}", repr(output))
    C.positive_int(OP, "k", k)
    if output == "topk" and k > min(V, MAX_K):
        C.fail_value(OP, "k", f"<= min(V, {MAX_K}) = {min(V, MAX_K)}", k)
    impl = resolve(OP, backend, hidden.device, hidden.dtype, shape_params(hidden, lm_head, output=output, k=k))
    return impl(hidden, lm_head, output=output, k=k)
