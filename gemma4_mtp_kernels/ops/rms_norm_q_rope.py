"""Public `rms_norm_q_rope`: validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve
from .rms_norm_linear import check_prologue
from .rms_norm_linear import shape_params as _linear_shape

OP = "rms_norm_q_rope"
HEAD_DIMS = (64, 128, 256, 512)


def check_positions(positions, T: int, device: torch.device) -> None:
    """positions [P] (int32/int64, contiguous, on `device`) with P dividing T: the one argument of a
    drafter step's queries that comes from outside the drafter (`Gemma4MTPDrafter.step` checks it on
    every step, also when it calls the unchecked implementation)."""
    C.tensor(OP, "positions", positions, ndim=1, dtypes=C.INDEX_DTYPES)
    if positions.device != device:
        C.fail_value(OP, "positions", f"on the same device as x ({device})", f"device {positions.device}")
    P = positions.shape[0]
    if (P == 0 and T > 0) or (P > 0 and T % P):
        C.fail_value(OP, "positions", f"of a length dividing T = {T} (one position per request)", f"length {P}")
    C.contiguous(OP, "positions", positions)


def shape_params(x, weight, q_norm_weight) -> dict:
    """The shape parameters this op passes to resolve() (rms_norm_linear's and the head dim)."""
    return {**_linear_shape(x, weight), "D": q_norm_weight.shape[0]}


def rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, *, norm_weight=None, eps=1e-6, residual=None,
                    residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None, backend="auto"):
    """A drafter layer's queries: q = rope(rms_norm(n @ weight.T per head, q_norm_weight), positions).

    x [T, H]; weight [Hq * D, H] (q_proj); q_norm_weight [D]; positions [P] int32/int64 with T a
    multiple of P: rows t of x take position positions[t // (T / P)] (the Q = T / P queries of a
    request, e.g. tree branches, share it); inv_freq [D / 2] fp32 (neox pairs (j, j + D/2); 0 = no
    rotation). The prologue (h, n) is `rms_norm_linear`'s. q_proj output, q_norm and RoPE are rounded
    as Hugging Face rounds them (cos/sin computed in fp32, rounded to x's dtype). Returns q [T, Hq, D];
    residual_out [T, H] receives h. The attention scale stays 1.0: q_norm scales q.
    """
    T, H, eps = check_prologue(OP, x, norm_weight=norm_weight, eps=eps, residual=residual,
                               residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar,
                               residual_out=residual_out)
    C.tensor(OP, "weight", weight, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.tensor(OP, "q_norm_weight", q_norm_weight, ndim=1, dtypes=C.FLOAT_DTYPES)
    check_positions(positions, T, x.device)
    C.tensor(OP, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,))
    C.same_dtype(OP, "x", x, [("weight", weight), ("q_norm_weight", q_norm_weight)])
    C.same_device(OP, "x", x, [("weight", weight), ("q_norm_weight", q_norm_weight), ("inv_freq", inv_freq),
                               ("out", out)])
    D = q_norm_weight.shape[0]
    if D not in HEAD_DIMS:
        C.fail_value(OP, "q_norm_weight", f"of a head dim in {HEAD_DIMS}", f"length {D}")
    C.dim(OP, "weight", weight, 1, H, "H = x.shape[1]")
    N = weight.shape[0]
    if N == 0 or N % D:
        C.fail_value(OP, "weight", f"a positive multiple of the head dim {D} rows (Hq * D)",
                     f"shape {tuple(weight.shape)}")
    C.dim(OP, "inv_freq", inv_freq, 0, D // 2, "D / 2 = q_norm_weight.shape[0] / 2")
    C.inner_contiguous(OP, "weight", weight)
    for name, t in (("q_norm_weight", q_norm_weight), ("inv_freq", inv_freq)):
        C.contiguous(OP, name, t)
    Hq = N // D
    if out is not None:
        C.out_tensor(OP, out, (T, Hq, D), x.dtype, x.device)
        C.no_overlap(OP, "out", out, [("x", x), ("weight", weight), ("residual", residual),
                                      ("residual_out", residual_out), ("positions", positions)])
    impl = resolve(OP, backend, x.device, x.dtype, shape_params(x, weight, q_norm_weight))
    return impl(x, weight, q_norm_weight, positions, inv_freq, norm_weight=norm_weight, eps=eps, residual=residual,
                residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar, out=out,
                residual_out=residual_out)
