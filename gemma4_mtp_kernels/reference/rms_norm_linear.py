"""Reference `rms_norm_linear` and the decoder-layer prologue shared with `rms_norm_gate_up` and
`rms_norm_q_rope`, rounded where Hugging Face's Gemma 4 rounds (gemma4_mtp.layers)."""
import torch


def rms_norm(x, weight, eps):
    """`x_hat * weight` in fp32, back in x's dtype (Gemma 4: no `1 + weight` offset; weight None: no scale)."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def prologue(x, *, norm_weight, eps, residual, residual_norm_weight, layer_scalar):
    """(h, n): h = the residual stream (x itself, or residual + rms_norm(x) [* layer_scalar] with each
    operation rounded to x's dtype as a decoder layer does), n = rms_norm(h, norm_weight) (h when None)."""
    h = x
    if residual is not None:
        h = residual + rms_norm(x, residual_norm_weight, eps)
        if layer_scalar is not None:
            h = h * layer_scalar
    n = h if norm_weight is None else rms_norm(h, norm_weight, eps)
    return h, n


def fill(out, value):
    """value in `out` when given (the backend contract: out= buffers are written and returned)."""
    if out is None:
        return value
    out.copy_(value)
    return out


def rms_norm_linear(x, weight, *, norm_weight=None, eps=1e-6, residual=None, residual_norm_weight=None,
                    layer_scalar=None, out=None, residual_out=None, normed_out=None):
    h, n = prologue(x, norm_weight=norm_weight, eps=eps, residual=residual,
                    residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar)
    if residual_out is not None:
        residual_out.copy_(h)
    if normed_out is not None:
        normed_out.copy_(n)
    return fill(out, torch.nn.functional.linear(n, weight))
