"""Reference `rms_norm_gate_up`: the prologue, then Gemma's gated MLP input gelu_tanh(gate(n)) * up(n), and with
down_weight its down projection (the whole MLP)."""
import torch.nn.functional as F

from .rms_norm_linear import fill, prologue


def rms_norm_gate_up(x, gate_weight, up_weight, *, down_weight=None, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    h, n = prologue(x, norm_weight=norm_weight, eps=eps, residual=residual,
                    residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar)
    if residual_out is not None:
        residual_out.copy_(h)
    m = F.gelu(F.linear(n, gate_weight), approximate="tanh") * F.linear(n, up_weight)
    return fill(out, m if down_weight is None else F.linear(m, down_weight))
