"""Reference `rms_norm_q_rope`: the prologue, q_proj, per-head q_norm and neox RoPE as Hugging Face
computes them (cos/sin in fp32, rounded to the dtype of q)."""
import torch
import torch.nn.functional as F

from .rms_norm_linear import fill, prologue, rms_norm


def rope(q, positions, inv_freq):
    """Rotate q [T, H, D] by positions [T] (pairs (j, j + D/2)), as gemma4_mtp.layers.apply_rope."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=q.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(q.dtype)[:, None, :]
    sin = emb.sin().to(q.dtype)[:, None, :]
    half = q.shape[-1] // 2
    rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    return q * cos + rotated * sin


def rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, *, norm_weight=None, eps=1e-6, residual=None,
                    residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    h, n = prologue(x, norm_weight=norm_weight, eps=eps, residual=residual,
                    residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar)
    if residual_out is not None:
        residual_out.copy_(h)
    T, D = x.shape[0], q_norm_weight.shape[0]
    q = rms_norm(F.linear(n, weight).view(T, -1, D), q_norm_weight, eps)
    pos = positions.repeat_interleave(T // positions.shape[0]) if positions.shape[0] else positions
    return fill(out, rope(q, pos, inv_freq))
