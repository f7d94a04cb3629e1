"""The `triton` backend (SPEC §3): one module per op, each kernel beside its launcher."""
from .fused_concat_down_proj import fused_concat_down_proj

__all__ = ["fused_concat_down_proj"]
