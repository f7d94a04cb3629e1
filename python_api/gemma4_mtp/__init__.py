"""gemma4_mtp: the reference speculative decode loop for Gemma 4 targets and their MTP drafters.

    from gemma4_mtp import load_target, load_drafter, speculative_generate
    target = load_target("path/to/gemma-4-text")          # Gemma4ForCausalLM checkpoint directory
    drafter = load_drafter("path/to/gemma-4-assistant")   # Gemma4AssistantForCausalLM directory
    ids, stats = speculative_generate(target, drafter, prompt_ids, max_new_tokens=64, num_draft_tokens=4)

The drafter runs through the gemma4_mtp_kernels ops (backend= on load_drafter); the target is plain
PyTorch over a paged K/V cache.
"""
from .config import DrafterConfig, TextConfig, UnsupportedModelError
from .drafter import DraftContext, Gemma4MTPDrafter
from .kv_cache import BlockAllocator, OutOfBlocksError, PagedKVCache
from .loading import load_drafter, load_target
from .speculative import SpeculativeOutput, SpeculativeStats, speculative_generate
from .target import Gemma4Target, TargetOutput

__all__ = [
    "Gemma4Target",
    "Gemma4MTPDrafter",
    "DraftContext",
    "TargetOutput",
    "TextConfig",
    "DrafterConfig",
    "UnsupportedModelError",
    "PagedKVCache",
    "BlockAllocator",
    "OutOfBlocksError",
    "load_target",
    "load_drafter",
    "speculative_generate",
    "SpeculativeOutput",
    "SpeculativeStats",
]
