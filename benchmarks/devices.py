"""Datasheet peaks of the GPUs the project targets, and the peaks a results file measured.

Datasheet numbers are vendor peaks (dense bf16 tensor-core FLOP/s, HBM bandwidth): floors computed
from them are optimistic; a run measures the copy bandwidth of its device (timer.copy_bandwidth) and
floors "of the measured device" use that instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    l2_bytes: int
    sms: int
    source: str = "datasheet"

    def floor_s(self, nbytes: float, flops: float) -> float:
        """Roofline floor: the slower of moving the bytes and doing the FLOPs (no launch cost)."""
        return max(nbytes / self.hbm_bytes_per_s, flops / self.bf16_flops_per_s)


DATASHEET = {
    "H100-SXM": Device("H100-SXM", "NVIDIA H100 SXM 80GB", 3.35e12, 989e12, 50 * 2**20, 132),
    "H200": Device("H200", "NVIDIA H200 141GB", 4.8e12, 989e12, 50 * 2**20, 132),
    "A100-80GB": Device("A100-80GB", "NVIDIA A100 SXM 80GB", 2.039e12, 312e12, 40 * 2**20, 108),
}


def match(device_name: str) -> Device | None:
    """The datasheet entry for a torch.cuda.get_device_name() string, or None if unknown."""
    n = device_name.upper()
    if "H200" in n:
        return DATASHEET["H200"]
    if "H100" in n and "PCIE" not in n:
        return DATASHEET["H100-SXM"]
    if "A100" in n and "40GB" not in n:
        return DATASHEET["A100-80GB"]
    return None


def measured(results: dict | str) -> Device:
    """The device of a results file (dict or path) with its measured copy bandwidth as the memory
    peak (and its measured matmul FLOP/s when recorded, else the datasheet's)."""
    if isinstance(results, str):
        with open(results) as f:
            results = json.load(f)
    env = results["env"]
    peaks = results["device_peaks"]
    bw = peaks.get("copy_bytes_per_s")
    if not bw:
        raise ValueError(f"results file has no measured copy bandwidth (device_peaks = {peaks})")
    base = match(env.get("device", "")) or Device("unknown", env.get("device", "unknown"), bw, 1.0, 0, 0)
    flops = peaks.get("matmul_flops_per_s") or base.bf16_flops_per_s
    return replace(base, key=base.key + "-measured", hbm_bytes_per_s=float(bw), bf16_flops_per_s=float(flops),
                   source="measured")
