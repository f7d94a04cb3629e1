"""gemma4_mtp_kernels: kernels for Gemma 4 multi-token-prediction drafters.

Four ops, each one function with backend="auto" | "torch" | "triton" | "cuda" (SPEC §3-§4):
fused_concat_down_proj, q_only_paged_attention, centroid_logits, tree_verify; and the fused glue of
a whole drafter step (issue 11): rms_norm_linear, rms_norm_gate_up, rms_norm_q_rope, dense_lm_head;
softmax_sample, a sampled draft token and its distribution (the decode loop's sampled draft chains).
"""
from ._checks import set_value_checks
from ._dispatch import BackendStatus, BackendUnavailableError, available_backends
from ._types import VerifyResult
from .ops.dense_lm_head import MAX_K as DENSE_LM_HEAD_MAX_K
from .ops import (centroid_logits, dense_lm_head, fused_concat_down_proj, implementation, q_only_paged_attention,
                  rms_norm_gate_up, rms_norm_linear, rms_norm_q_rope, softmax_sample, tree_verify)

__version__ = "0.1.0"

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
    "DENSE_LM_HEAD_MAX_K",
    "VerifyResult",
    "available_backends",
    "implementation",
    "BackendStatus",
    "BackendUnavailableError",
    "set_value_checks",
]
