"""gemma4_mtp_kernels: kernels for Gemma 4 multi-token-prediction drafters.

Four ops, each one function with backend="auto" | "torch" | "triton" | "cuda" (SPEC §3-§4):
fused_concat_down_proj, q_only_paged_attention, centroid_logits, tree_verify.
"""
from ._checks import set_value_checks
from ._dispatch import BackendStatus, BackendUnavailableError, available_backends
from ._types import VerifyResult
from .ops import centroid_logits, fused_concat_down_proj, q_only_paged_attention, tree_verify

__version__ = "0.1.0"

__all__ = [
    "fused_concat_down_proj",
    "q_only_paged_attention",
    "centroid_logits",
    "tree_verify",
    "VerifyResult",
    "available_backends",
    "BackendStatus",
    "BackendUnavailableError",
    "set_value_checks",
]
