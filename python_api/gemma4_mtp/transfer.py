"""Host-to-device copies that do not make the host wait for the device.

torch copies a CPU tensor to a CUDA device with cudaMemcpyAsync followed by cudaStreamSynchronize
unless `non_blocking=True` (the default `.to(device)`, `.copy_(cpu_tensor)`, and
`torch.tensor(data, device="cuda")` alike): the host waits until every kernel queued before the copy
has run. In the decode loop each such copy (a block table, the sequence lengths, a tree, a parents
row) drained the stream, so the host and the GPU never worked at the same time. These helpers stage
the data in pinned memory from torch's caching host allocator, which keeps a block until the copies
issued from it have run, and copy it non-blocking: the host goes on with the round while the GPU
works. Pinning copies a pageable tensor, so the caller may reuse its own tensor at once (an already
pinned one is used as it is and must not be written until the copy has run).

Other devices take the same calls with `non_blocking=True` and no pinning (on meta tensors, which
stand for CUDA tensors when launches are counted, that flag is what `benchmarks.launch_count` checks).
"""
from __future__ import annotations

import torch


def _staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory() if device.type == "cuda" else t


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`; a CPU tensor goes over without the host waiting for the device's queue."""
    device = torch.device(device)
    if t.device.type != "cpu" or device.type == "cpu":
        return t.to(device)
    return _staged(t, device).to(device, non_blocking=True)


def tensor_to(data, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype) on `device`, through `to_device`."""
    return to_device(torch.tensor(data, dtype=dtype), device)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU `src`, through the same staging as `to_device`."""
    if dst.device.type == "cpu":
        dst.copy_(src)
    else:
        dst.copy_(_staged(src, dst.device), non_blocking=True)
