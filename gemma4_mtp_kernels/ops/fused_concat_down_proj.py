"""Public `fused_concat_down_proj` (SPEC §4.1): validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve

OP = "fused_concat_down_proj"


def fused_concat_down_proj(token_ids, embed_table, hidden, weight, *, embed_scale, out=None, backend="auto"):
    """y[t] = weight @ concat(round(embed_table[token_ids[t]] * round(embed_scale)), hidden[t]).

    token_ids [T] int32/int64, embed_table [V, Hb], hidden [T, Hb], weight [Hd, 2*Hb]
    (pre_projection weight, embedding half first). Returns [T, Hd] in hidden.dtype. Both roundings
    are to the table dtype, as the Gemma scaled embedding does.
    """
    C.tensor(OP, "token_ids", token_ids, ndim=1, dtypes=C.INDEX_DTYPES)
    C.tensor(OP, "embed_table", embed_table, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "hidden", hidden, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "weight", weight, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.same_dtype(OP, "hidden", hidden, [("embed_table", embed_table), ("weight", weight)])
    C.same_device(OP, "hidden", hidden, [("token_ids", token_ids), ("embed_table", embed_table), ("weight", weight), ("out", out)])
    T, Hb = hidden.shape
    V = embed_table.shape[0]
    C.dim(OP, "token_ids", token_ids, 0, T, "T = hidden.shape[0]")
    C.dim(OP, "embed_table", embed_table, 1, Hb, "Hb = hidden.shape[1]")
    C.dim(OP, "weight", weight, 1, 2 * Hb, "2 * Hb, embedding half first")
    for name, t in (("embed_table", embed_table), ("hidden", hidden), ("weight", weight)):
        C.inner_contiguous(OP, name, t)
    C.contiguous(OP, "token_ids", token_ids)
    C.finite_float(OP, "embed_scale", embed_scale)
    Hd = weight.shape[0]
    if out is not None:
        C.out_tensor(OP, out, (T, Hd), hidden.dtype, hidden.device)
        C.no_overlap(OP, "out", out, [("token_ids", token_ids), ("embed_table", embed_table), ("hidden", hidden),
                                      ("weight", weight)])
    if C.values_checkable(token_ids):
        C.index_range(OP, "token_ids", token_ids, 0, V, "rows of embed_table")
    impl = resolve(OP, backend, hidden.device, hidden.dtype, {"T": T, "Hb": Hb, "Hd": Hd})
    return impl(token_ids, embed_table, hidden, weight, embed_scale=float(embed_scale), out=out)
