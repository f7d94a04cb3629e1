"""Public `rms_norm_linear`: validation, then dispatch. Also the checks of the decoder-layer prologue
that `rms_norm_gate_up` and `rms_norm_q_rope` share."""
from __future__ import annotations

from .. import _checks as C
from .._dispatch import resolve

OP = "rms_norm_linear"


def check_prologue(op, x, *, norm_weight, eps, residual, residual_norm_weight, layer_scalar, residual_out,
                   normed_out=None):
    """Validate the prologue arguments of `op` for x [T, H]; returns (T, H, eps as a float)."""
    C.tensor(op, "x", x, ndim=2, dtypes=C.FLOAT_DTYPES)
    T, H = x.shape
    vectors = [("norm_weight", norm_weight), ("residual_norm_weight", residual_norm_weight)]
    for name, t in vectors:
        if t is not None:
            C.tensor(op, name, t, ndim=1, dtypes=C.FLOAT_DTYPES)
            C.dim(op, name, t, 0, H, "H = x.shape[1]")
            C.contiguous(op, name, t)
    if residual is None:
        for name, t in (("residual_norm_weight", residual_norm_weight), ("layer_scalar", layer_scalar),
                        ("residual_out", residual_out)):
            if t is not None:
                C.fail_value(op, name, "None unless residual is given", C._describe(t))
    else:
        C.tensor(op, "residual", residual, ndim=2, dtypes=C.FLOAT_DTYPES)
        if tuple(residual.shape) != (T, H):
            C.fail_value(op, "residual", f"of shape {(T, H)} (x's shape)", f"shape {tuple(residual.shape)}")
        C.inner_contiguous(op, "residual", residual)
        if residual_norm_weight is None:
            C.fail_value(op, "residual_norm_weight", "a tensor [H] when residual is given (the norm of x added to it)",
                         "None")
        if layer_scalar is not None:
            C.tensor(op, "layer_scalar", layer_scalar, ndim=1, dtypes=C.FLOAT_DTYPES)
            C.dim(op, "layer_scalar", layer_scalar, 0, 1, "one scale")
    if normed_out is not None and norm_weight is None:
        C.fail_value(op, "normed_out", "None unless norm_weight is given", C._describe(normed_out))
    C.inner_contiguous(op, "x", x)
    C.same_dtype(op, "x", x, [(n, t) for n, t in (("residual", residual), ("layer_scalar", layer_scalar), *vectors)
                              if t is not None])
    C.same_device(op, "x", x, [("residual", residual), ("layer_scalar", layer_scalar), *vectors,
                               ("residual_out", residual_out), ("normed_out", normed_out)])
    eps = C.finite_float(op, "eps", eps)
    if eps < 0:
        C.fail_value(op, "eps", ">= 0", eps)
    inputs = [("x", x), ("residual", residual), *vectors, ("layer_scalar", layer_scalar)]
    for name, buf in (("residual_out", residual_out), ("normed_out", normed_out)):
        if buf is not None:
            C.out_tensor(op, buf, (T, H), x.dtype, x.device, name=name)
            C.no_overlap(op, name, buf, inputs)
    return T, H, eps


def shape_params(x, weight) -> dict:
    """The shape parameters a glue call (rms_norm_linear; rms_norm_gate_up's with its gate weight) passes
    to resolve(): `auto` follows verified.py's evidence for them (benchmarks.make_verified.SHAPES)."""
    return {"T": x.shape[0], "H": x.shape[1], "N": weight.shape[0]}


def rms_norm_linear(x, weight, *, norm_weight=None, eps=1e-6, residual=None, residual_norm_weight=None,
                    layer_scalar=None, out=None, residual_out=None, normed_out=None, backend="auto"):
    """y = n @ weight.T with the decoder-layer prologue in front (rounded as Hugging Face's Gemma 4).

    x [T, H]; weight [N, H]. Prologue: h = x, or with residual [T, H]
    h = residual + rms_norm(x, residual_norm_weight) (then * layer_scalar [1] when given), every
    operation rounded to x's dtype (a decoder layer's post-norm, residual add and layer scalar);
    n = rms_norm(h, norm_weight) (fp32 math, rounded), or h when norm_weight is None.
    Returns y [T, N] in x's dtype (fp32 accumulation); residual_out / normed_out [T, H], when given,
    receive h / n.
    """
    T, H, eps = check_prologue(OP, x, norm_weight=norm_weight, eps=eps, residual=residual,
                               residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar,
                               residual_out=residual_out, normed_out=normed_out)
    C.tensor(OP, "weight", weight, ndim=2, dtypes=C.FLOAT_DTYPES)
    C.same_dtype(OP, "x", x, [("weight", weight)])
    C.same_device(OP, "x", x, [("weight", weight), ("out", out)])
    C.dim(OP, "weight", weight, 1, H, "H = x.shape[1]")
    C.inner_contiguous(OP, "weight", weight)
    if out is not None:
        C.out_tensor(OP, out, (T, weight.shape[0]), x.dtype, x.device)
        C.no_overlap(OP, "out", out, [("x", x), ("weight", weight), ("residual", residual),
                                      ("residual_out", residual_out), ("normed_out", normed_out)])
    impl = resolve(OP, backend, x.device, x.dtype, shape_params(x, weight))
    return impl(x, weight, norm_weight=norm_weight, eps=eps, residual=residual,
                residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar, out=out,
                residual_out=residual_out, normed_out=normed_out)
