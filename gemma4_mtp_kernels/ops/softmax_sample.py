"""Public `softmax_sample`: validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve

OP = "softmax_sample"


def softmax_sample(logits, temperature, uniforms, *, probs_out=None, backend="auto"):
    """Draw a token per row from q = softmax(logits / temperature), by the inverse CDF at a uniform: a
    drafted token of a sampling request (the decode loop's sampled draft chains), and q itself, which
    the verification takes as its draft probabilities.

    logits [B, V] (fp32 / bf16 / fp16; the drafter heads' dense output, -inf outside a centroid head's
    candidates); temperature [B] fp32 (> 0); uniforms [B] fp64 in [0, 1) (any strides: a column of a
    [B, depth] tensor). Returns (tokens [B] int64, probs [B, V] fp32): tokens[b] is the first id whose
    cumulative probability (fp64 sums of the fp32 q) exceeds uniforms[b], or, where rounding leaves the
    total at or below it, the last id with q > 0. probs_out [B, V] fp32 (rows may be strided, e.g. a
    depth of a [B, N, V] buffer) receives q instead of a new tensor. Every row of logits / temperature
    has a finite maximum (checked on CPU, and on CUDA with value checks; unchecked, such a row gives
    NaN probabilities and token -1).
    """
    C.tensor(OP, "logits", logits, ndim=2, dtypes=C.FLOAT_DTYPES)
    B, V = logits.shape
    if V < 1:
        C.fail_value(OP, "logits", "a non-empty vocabulary (shape[1] >= 1)", f"shape {tuple(logits.shape)}")
    C.inner_contiguous(OP, "logits", logits)
    C.tensor(OP, "temperature", temperature, ndim=1, dtypes=(torch.float32,))
    C.dim(OP, "temperature", temperature, 0, B, "B = logits.shape[0]")
    C.tensor(OP, "uniforms", uniforms, ndim=1, dtypes=(torch.float64,))
    C.dim(OP, "uniforms", uniforms, 0, B, "B = logits.shape[0]")
    C.same_device(OP, "logits", logits, [("temperature", temperature), ("uniforms", uniforms),
                                         ("probs_out", probs_out)])
    if probs_out is not None:
        C.tensor(OP, "probs_out", probs_out, ndim=2, dtypes=(torch.float32,))
        if tuple(probs_out.shape) != (B, V):
            C.fail_value(OP, "probs_out", f"of shape (B, V) = {(B, V)}", f"shape {tuple(probs_out.shape)}")
        C.inner_contiguous(OP, "probs_out", probs_out)
        C.no_overlap(OP, "probs_out", probs_out, [("logits", logits), ("temperature", temperature),
                                                  ("uniforms", uniforms)])
    if C.values_checkable(temperature) and B:
        if not bool((torch.isfinite(temperature) & (temperature > 0)).all()):
            C.fail_value(OP, "temperature", "finite and > 0 in every row", temperature.tolist())
    if C.values_checkable(uniforms) and B:
        if not bool(((uniforms >= 0) & (uniforms < 1)).all()):
            C.fail_value(OP, "uniforms", "in [0, 1)", uniforms.tolist())
    if C.values_checkable(logits) and B:
        top = (logits.float() / temperature[:, None]).amax(dim=1)
        if not bool(torch.isfinite(top).all()):
            b = int((~torch.isfinite(top)).nonzero()[0])
            C.fail_value(OP, "logits", "rows whose logits / temperature has a finite maximum",
                         f"{float(top[b])} in row {b}")
    impl = resolve(OP, backend, logits.device, logits.dtype, {"B": B, "V": V})
    return impl(logits, temperature, uniforms, probs_out=probs_out)
