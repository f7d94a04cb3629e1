"""Which cases of the `cuda` backend have passed the GPU test suite on a real device.

`backend="auto"` prefers the compiled CUDA kernels only for a case listed here; everything else goes
to Triton. Add an entry only after `pytest -m gpu` passed for that op on that device (record the date,
the device and the results file under benchmarks/results/).

Each record: {"device": str, "date": "YYYY-MM-DD", "capability": (major, minor),
              "dtypes": set of torch dtypes, "head_dims": set of ints (attention only)}.
"""
from __future__ import annotations

import torch

# No CUDA kernel of this project has run on a GPU yet: every list is empty on purpose.
GPU_VERIFIED: dict[str, list[dict]] = {
    "fused_concat_down_proj": [],
    "q_only_paged_attention": [],
    "centroid_logits": [],
    "tree_verify": [],
}


def is_verified(op: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    records = GPU_VERIFIED.get(op, [])
    if not records:
        return False
    capability = tuple(torch.cuda.get_device_capability(device))
    for rec in records:
        if tuple(rec["capability"]) != capability or dtype not in rec["dtypes"]:
            continue
        if head_dim is not None and head_dim not in rec.get("head_dims", {head_dim}):
            continue
        return True
    return False
