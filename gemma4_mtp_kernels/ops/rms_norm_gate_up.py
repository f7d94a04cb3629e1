"""Public `rms_norm_gate_up`: validation, then dispatch."""
from __future__ import annotations

from .. import _checks as C
from .._dispatch import resolve
from .rms_norm_linear import check_prologue, shape_params

OP = "rms_norm_gate_up"


def rms_norm_gate_up(x, gate_weight, up_weight, *, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None, backend="auto"):
    """m = gelu_tanh(n @ gate_weight.T) * (n @ up_weight.T): the input of Gemma's down_proj.

    x [T, H]; gate_weight, up_weight [I, H]. The prologue (h, n) is `rms_norm_linear`'s. Both
    projections, the gelu (tanh approximation, fp32 math) and the product are each rounded to x's
    dtype, as Hugging Face's MLP does. Returns m [T, I]; residual_out [T, H] receives h.
    """
    T, H, eps = check_prologue(OP, x, norm_weight=norm_weight, eps=eps, residual=residual,
                               residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar,
                               residual_out=residual_out)
    for name, w in (("gate_weight", gate_weight), ("up_weight", up_weight)):
        C.tensor(OP, name, w, ndim=2, dtypes=C.FLOAT_DTYPES)
        C.dim(OP, name, w, 1, H, "H = x.shape[1]")
        C.inner_contiguous(OP, name, w)
    C.dim(OP, "up_weight", up_weight, 0, gate_weight.shape[0], "I = gate_weight.shape[0]")
    C.same_dtype(OP, "x", x, [("gate_weight", gate_weight), ("up_weight", up_weight)])
    C.same_device(OP, "x", x, [("gate_weight", gate_weight), ("up_weight", up_weight), ("out", out)])
    if out is not None:
        C.out_tensor(OP, out, (T, gate_weight.shape[0]), x.dtype, x.device)
        C.no_overlap(OP, "out", out, [("x", x), ("gate_weight", gate_weight), ("up_weight", up_weight),
                                      ("residual", residual), ("residual_out", residual_out)])
    impl = resolve(OP, backend, x.device, x.dtype, shape_params(x, gate_weight))
    return impl(x, gate_weight, up_weight, norm_weight=norm_weight, eps=eps, residual=residual,
                residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar, out=out,
                residual_out=residual_out)
