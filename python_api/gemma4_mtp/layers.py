"""Building blocks shared by the target and the drafter (SPEC §1), numerically as Hugging Face does them.

Module and parameter names follow the Hugging Face checkpoints so that a state dict loads as is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# RMSNorm and RoPE as the library's references compute them (Hugging Face's rounding points): one
# implementation for the kernels' oracle and the decode loop's target.
from gemma4_mtp_kernels.reference.rms_norm_linear import rms_norm
from gemma4_mtp_kernels.reference.rms_norm_q_rope import rope as apply_rope  # noqa: F401  (the target's)

from .config import AttentionSpec, TextConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(spec: AttentionSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp32) for neox-style rotation of pairs (j, j + head_dim/2).

    "proportional" (full layers) rotates only the first `partial_rotary_factor * head_dim / 2` pairs,
    with exponents over the whole head dim; the other pairs get frequency 0 (identity)."""
    D = spec.head_dim
    if spec.rope_type == "default":
        return 1.0 / (spec.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    rotated = int(spec.partial_rotary_factor * D // 2)
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / D))
    inv = torch.cat([inv, torch.zeros(D // 2 - rotated, dtype=torch.float32)])
    return inv / spec.rope_factor


def to_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters and floating buffers in `dtype`; RoPE inverse frequencies stay fp32 (Hugging Face
    computes the angles in fp32) and integer buffers (token_ordering) keep their type."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    for name, b in module.named_buffers():
        if b.is_floating_point() and not name.endswith("inv_freq"):
            b.data = b.data.to(dtype)
    return module


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The weights of a Gemma 4 drafter decoder layer, named as in Hugging Face's checkpoints. The
    drafter runs them through the fused glue ops (`Gemma4MTPDrafter.step`); the target has its own
    layer (`target.TargetDecoderLayer`), with per-layer embeddings and MoE."""

    def __init__(self, config: TextConfig, self_attn: nn.Module):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = MLP(H, config.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
