"""Zeroed int32 counters that one-launch Triton kernels synchronise their programs with (a grid-wide
barrier, "last program done" elections; the CUDA ops keep theirs in csrc/torch_bindings.cpp). Every
launch leaves its counters zero again, so no per-call memset is needed and the launch replays in a
CUDA graph. Cached buffers, grown on demand, outgrown ones kept alive (captured graphs hold their
addresses):
- eager launches use one buffer per (device, stream, owner): launches on different streams may
  overlap in time (an engine running two micro-batches on two streams), launches on one stream follow
  each other, so no launch shares counters with one still running (torch keys its cuBLAS workspaces
  by stream for the same reason);
- captured launches use one buffer per (device, owner) for all graphs (a graph replays on whatever
  stream it is given, not the one it was captured on), which every eager call also makes ready, so
  that the warm-up call before a capture leaves the capture nothing to allocate. Replays of two
  graphs that overlap in time would share it: not supported. A capture that still finds it too small
  gets a graph-private buffer whose zeroing is captured too (a memset node per replay).
"""
from __future__ import annotations

import torch

MIN_COUNTERS = 1024
_GRAPHS = -1  # the stream key of the captured launches' buffers (stream handles are never negative)
_CACHE: dict[tuple[torch.device, int, str], torch.Tensor] = {}
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
        return 0  # CPU (the interpreter) and meta tensors (launch recording): one stream
    return torch._C._cuda_getCurrentRawStream(device.index)


def _ready(key: tuple, n: int) -> torch.Tensor:
    buf = _CACHE.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if buf is not None:
        _OUTGROWN.append(buf)
    buf = _CACHE[key] = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=key[0])
    return buf


def zeroed_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """At least n zeroed int32 counters on `device` for the kernels of `owner` (which leave them zero):
    the current stream's, or the graphs' while the stream is being captured."""
    if device.type == "cuda" and device.index is None:  # torch.device("cuda") != torch.device("cuda", 0)
        device = torch.device("cuda", torch.cuda.current_device())  # a tensor's device names its index
    if device.type == "cuda" and _capturing():
        buf = _CACHE.get((device, _GRAPHS, owner))
        if buf is not None and buf.numel() >= n:
            return buf
        return torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)  # graph-private
    if device.type == "cuda":
        _ready((device, _GRAPHS, owner), n)  # for a capture of this call
    return _ready((device, _stream(device), owner), n)
