"""Public `rms_norm_gate_up`: validation, then dispatch."""
from __future__ import annotations

from .. import _checks as C
from .._dispatch import resolve
from .rms_norm_linear import check_prologue
from .rms_norm_linear import shape_params as linear_shape

OP = "rms_norm_gate_up"


def shape_params(x, gate_weight, down_weight=None) -> dict:
    """The shape parameters a call passes to resolve(): rms_norm_linear's of the gate projection, and the
    rows of down_weight (0 without): `auto` follows verified.py's evidence for the whole MLP apart from
    gate/up alone (benchmarks.make_verified.SHAPES)."""
    return dict(linear_shape(x, gate_weight), down=0 if down_weight is None else down_weight.shape[0])


def rms_norm_gate_up(x, gate_weight, up_weight, *, down_weight=None, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None, backend="auto"):
    """m = gelu_tanh(n @ gate_weight.T) * (n @ up_weight.T): the input of Gemma's down_proj; with
    down_weight, m @ down_weight.T: the whole MLP.

    x [T, H]; gate_weight, up_weight [I, H]; down_weight [N, I] or None. The prologue (h, n) is
    `rms_norm_linear`'s. Both projections, the gelu (tanh approximation, fp32 math) and the product are
    each rounded to x's dtype, as Hugging Face's MLP does, and so is the down projection (fp32
    accumulation). Returns m [T, I], or [T, N] with down_weight; residual_out [T, H] receives h.
    Both backends run the MLP with down_weight as one launch at T <= 4 (decode steps and tree levels at
    small batch) when its weights are small (E2B / E4B: `gemma4_mtp_kernels.triton.rms_norm_gate_up`,
    csrc/include/gemma4_mtp/glue_logic.h), as two otherwise.
    """
    T, H, eps = check_prologue(OP, x, norm_weight=norm_weight, eps=eps, residual=residual,
                               residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar,
                               residual_out=residual_out)
    weights = [("gate_weight", gate_weight), ("up_weight", up_weight)]
    for name, w in weights:
        C.tensor(OP, name, w, ndim=2, dtypes=C.FLOAT_DTYPES)
        C.dim(OP, name, w, 1, H, "H = x.shape[1]")
        C.inner_contiguous(OP, name, w)
    I = gate_weight.shape[0]
    C.dim(OP, "up_weight", up_weight, 0, I, "I = gate_weight.shape[0]")
    if down_weight is not None:
        C.tensor(OP, "down_weight", down_weight, ndim=2, dtypes=C.FLOAT_DTYPES)
        C.dim(OP, "down_weight", down_weight, 1, I, "I = gate_weight.shape[0]")
        C.inner_contiguous(OP, "down_weight", down_weight)
        weights.append(("down_weight", down_weight))
    C.same_dtype(OP, "x", x, weights)
    C.same_device(OP, "x", x, [*weights, ("out", out)])
    if out is not None:
        C.out_tensor(OP, out, (T, I if down_weight is None else down_weight.shape[0]), x.dtype, x.device)
        C.no_overlap(OP, "out", out, [("x", x), *weights, ("residual", residual), ("residual_out", residual_out)])
    impl = resolve(OP, backend, x.device, x.dtype, shape_params(x, gate_weight, down_weight))
    return impl(x, gate_weight, up_weight, down_weight=down_weight, norm_weight=norm_weight, eps=eps,
                residual=residual, residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar, out=out,
                residual_out=residual_out)
