"""Launch configurations measured on a device, applied by the Triton launchers at the shapes measured.

The launchers' tiles, pipeline depths and split counts are heuristics (`launch_config` / `kernel_config` of
each module). `benchmarks/tune_launch_configs.py` times each heuristic against variants on a GPU and writes
the variants that beat it (`--tuned-out`); with GEMMA4_MTP_TRITON_CONFIGS naming such a file, a launcher
whose call matches one of its entries exactly (the op and the shape it looks up: tokens and weight for the
GEMVs, batch, heads, head dim, key range and element size for attention) passes the entry's keywords to its
config function, each replacing one choice of the heuristic as the sweep did. Any other call keeps the
heuristic. As vLLM's tuned MoE configurations, a file is for the device it was measured on (its `device`,
CUDA's device name): on another device it is ignored with a warning (a tile that fit an H200's shared
memory may not fit an A100's). Every entry's configuration compiled, ran and matched the reference in the
sweep that wrote it; the CPU tests' compile check (tests/test_triton_aot.py) covers the heuristics only.

File (schema 1): {"schema": 1, "device": "NVIDIA H200", "entries": [{"op": "rms_norm_linear",
"shape": {"T": 1, "N": 1024, "K": 16384}, "config": {"block_k": 128, "num_stages": 4}}, ...]}; other keys
(the sweep's times, its commit) are kept for the reader and ignored here.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import warnings

import torch

ENV = "GEMMA4_MTP_TRITON_CONFIGS"
# The file in force (read once; benchmarks/bench_drafter_step.py's `triton_tuned` patches it around a capture).
PATH = os.environ.get(ENV) or None

# op -> (module, config function) whose keyword-only parameters an entry may set
CONFIG_FUNCTIONS = {"rms_norm_linear": ("rms_norm_linear", "launch_config"),
                    "rms_norm_q_rope": ("rms_norm_q_rope", "launch_config"),
                    "rms_norm_gate_up": ("rms_norm_gate_up", "launch_config"),
                    "rms_norm_gate_up/mlp": ("rms_norm_gate_up", "mlp_config"),  # with down_weight, one launch
                    "fused_concat_down_proj": ("fused_concat_down_proj", "launch_config"),
                    "q_only_paged_attention": ("q_only_attention", "kernel_config")}


def keywords(op: str) -> frozenset[str]:
    """The keywords an entry of `op` may set: its config function's keyword-only parameters."""
    import importlib
    module, fn = CONFIG_FUNCTIONS[op]
    sig = inspect.signature(getattr(importlib.import_module(f"{__package__}.{module}"), fn))
    return frozenset(n for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY)


def _key(op: str, shape: dict) -> tuple:
    return op, tuple(sorted(shape.items()))


@functools.lru_cache(maxsize=8)
def load(path: str) -> tuple[str, dict]:
    """(device name, {(op, shape): keywords}) of a tuned file; ValueError naming the file and the entry
    for anything it cannot apply."""
    where = f"{ENV}={path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read a tuned-configuration file ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("device"), str) \
            or not isinstance(data.get("entries"), list):
        raise ValueError(f"{where}: not a tuned-configuration file (schema 1 with a device name and a list of "
                         "entries, as benchmarks/tune_launch_configs.py --tuned-out writes)")
    table = {}
    for i, e in enumerate(data["entries"]):
        op = e.get("op") if isinstance(e, dict) else None
        if op not in CONFIG_FUNCTIONS:
            raise ValueError(f"{where}: entries[{i}].op must be one of {sorted(CONFIG_FUNCTIONS)}, got {op!r}")
        shape, config = e.get("shape"), e.get("config")
        if not isinstance(shape, dict) or not shape or not all(type(v) is int for v in shape.values()):
            raise ValueError(f"{where}: entries[{i}].shape must map names to integers, got {shape!r}")
        if not isinstance(config, dict) or not config:
            raise ValueError(f"{where}: entries[{i}].config must be a non-empty object, got {config!r}")
        unknown = set(config) - keywords(op)
        if unknown:
            raise ValueError(f"{where}: entries[{i}].config sets {sorted(unknown)}, which {op}'s configuration "
                             f"does not take (it takes {sorted(keywords(op))})")
        if not all(type(v) is int and v > 0 for v in config.values()):
            raise ValueError(f"{where}: entries[{i}].config values must be positive integers, got {config!r}")
        # Triton's tiles and warp counts are powers of two (anything else fails in its compiler, far from here)
        odd = sorted(k for k, v in config.items() if (k.startswith("block_") or k == "num_warps") and v & (v - 1))
        if odd:
            raise ValueError(f"{where}: entries[{i}].config {odd} must be powers of two, got {config!r}")
        table[_key(op, shape)] = dict(config)
    return data["device"], table


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=None)
def _applies(path: str, device: str, index: int) -> bool:
    """Whether the file measured on `device` applies to CUDA device `index` (warned once if not)."""
    here = _device_name(index)
    if here != device:
        warnings.warn(f"{ENV}={path} was measured on {device}, not on this {here} (cuda:{index}): ignored, "
                      "the launchers' own configurations run", stacklevel=3)
    return here == device


def overrides(op: str, device: torch.device, **shape: int) -> dict:
    """Keywords for `op`'s config function at `shape` on `device` from the file in force (PATH): {} without
    one, on another device than the file's, or at a shape it has no entry for. Meta tensors (launches
    recorded for a device, record.recording) and the interpreter take the file's entries as they stand."""
    if PATH is None:
        return {}
    name, table = load(PATH)
    if device.type == "cuda" and not _applies(PATH, name, device.index if device.index is not None
                                              else torch.cuda.current_device()):
        return {}
    return table.get(_key(op, shape), {})
