"""The public ops: argument validation, then dispatch to a backend (SPEC §3-§4)."""
import torch

from .._dispatch import resolve
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


def implementation(op: str, backend: str, device: torch.device, dtype: torch.dtype, shape: dict | None = None):
    """The backend function a call of the public op `op` (by name) runs on `device` in `dtype` with
    `backend`: the op minus its checks and its `backend=` argument. For callers that repeat one call
    many times (a drafter step makes 13 fused glue calls): validate a call through the public op
    once, then call this with arguments of the same kinds, shapes, dtypes, devices and layouts. It
    checks nothing: bad arguments read out of bounds on a GPU. `shape`: the call's shape parameters
    for the ops whose `auto` choice follows verified.py's evidence (as each op passes them to
    `_dispatch.resolve`; for the glue ops their modules' `shape_params`)."""
    if op not in __all__:
        raise ValueError(f"implementation: op must be one of {tuple(__all__)}, got {op!r}")
    return resolve(op, backend, torch.device(device), dtype, shape)
