"""Zeroed int32 counters that one-launch Triton kernels synchronise their programs with (a grid-wide
barrier, "last program done" elections; the CUDA ops keep theirs in csrc/torch_bindings.cpp). Every
launch leaves its counters zero again, so no per-call memset is needed and the launch replays in a
CUDA graph. One cached buffer per (device, owner), grown on demand;
a call captured into a graph before the cache is big enough gets a graph-private buffer (its zeroing
memset is captured too, so each replay starts from zero); outgrown buffers stay alive because captured
graphs hold their addresses. Launches of one owner that overlap in time on one device (concurrent
streams or graph replays) would share the counters: they are not supported."""
from __future__ import annotations

import torch

MIN_COUNTERS = 1024
_CACHE: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


# torch.compile evaluates this once at trace time (dynamo cannot put a bool-valued CUDA query in a graph).
@torch.compiler.assume_constant_result
def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def zeroed_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """At least n zeroed int32 counters on `device` for the kernels of `owner` (which leave them zero)."""
    key = (device, owner)
    buf = _CACHE.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    if device.type == "cuda" and _capturing():
        return fresh
    if buf is not None:
        _OUTGROWN.append(buf)
    _CACHE[key] = fresh
    return fresh
