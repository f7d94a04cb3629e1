"""PyTorch reference implementations: the spec in code (SPEC §3 `torch` backend).

Any device, fp32/bf16/fp16 inputs, fp32 accumulation. Inputs are assumed validated by the public ops.
"""
from .centroid_logits import centroid_logits
from .fused_concat_down_proj import fused_concat_down_proj
from .q_only_attention import q_only_paged_attention
from .tree_verify import tree_verify
from .rms_norm_linear import rms_norm_linear
from .rms_norm_gate_up import rms_norm_gate_up
from .rms_norm_q_rope import rms_norm_q_rope
from .dense_lm_head import dense_lm_head
from .softmax_sample import softmax_sample

__all__ = [
    "fused_concat_down_proj",
    "q_only_paged_attention",
    "centroid_logits",
    "tree_verify",
    "rms_norm_linear",
    "rms_norm_gate_up",
    "rms_norm_q_rope",
    "dense_lm_head",
    "softmax_sample",
]
