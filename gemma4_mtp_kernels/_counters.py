"""Zeroed int32 counters that one-launch Triton kernels synchronise their programs with (a grid-wide
barrier, "last program done" elections; the CUDA ops keep theirs in csrc/torch_bindings.cpp). Every
launch leaves its counters zero again, so no per-call memset is needed and the launch replays in a
CUDA graph. One cached buffer per (device, stream, owner), grown on demand: launches on different
streams may overlap in time (an engine running two micro-batches on two streams), launches on one
stream follow each other, so neither shares counters with a launch still running (torch keys its
cuBLAS workspaces by stream for the same reason). A call captured into a graph before the cache is big
enough gets a graph-private buffer (its zeroing memset is captured too, so each replay starts from
zero); outgrown buffers stay alive because captured graphs hold their addresses. Replays of graphs
captured on one stream (torch.cuda.graph's shared capture stream by default) use that stream's
buffers: replaying two of them at once, on two streams, is not supported."""
from __future__ import annotations

import torch

MIN_COUNTERS = 1024
_CACHE: dict[tuple[torch.device, str], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


# torch.compile evaluates this once at trace time (dynamo cannot put a bool-valued CUDA query in a graph).
@torch.compiler.assume_constant_result
def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


# torch.compile evaluates this once at trace time, like _capturing (a compiled call keeps the stream it
# was traced on as its key).
@torch.compiler.assume_constant_result
def _stream(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())


def zeroed_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """At least n zeroed int32 counters on `device` for the kernels of `owner` launched on the current
    stream (which leave them zero)."""
    key = (device, _stream(device), owner)
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
