"""The `triton` backend (SPEC §3): one module per op, each kernel beside its launcher."""
from triton import __version__ as TRITON_VERSION

from .centroid_logits import centroid_logits
from .fused_concat_down_proj import fused_concat_down_proj
from .q_only_attention import q_only_paged_attention
from .tree_verify import tree_verify

__all__ = ["TRITON_VERSION", "fused_concat_down_proj", "q_only_paged_attention", "centroid_logits", "tree_verify"]
