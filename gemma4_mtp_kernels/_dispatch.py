"""Backend selection (SPEC §3).

Each backend is a module exposing the four op functions under their public names, taking the
public signature minus `backend=` and receiving arguments that the public op already validated:
    gemma4_mtp_kernels.reference   "torch"
    gemma4_mtp_kernels.triton      "triton"
    gemma4_mtp_kernels.cuda        "cuda"
"""
from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch

from . import cuda as _cuda_backend
from . import reference as _torch_backend
from . import verified

# Every backend module is imported here, once, so that resolving a call is plain attribute lookup:
# torch.compile traces the public ops through `resolve`, and dynamo refuses import machinery
# (importlib on torch 2.11). The cuda module loads its extension lazily; triton costs ~0.1 s.
try:
    from . import triton as _triton_backend
    _TRITON_IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the machine
    _triton_backend = None
    _TRITON_IMPORT_ERROR = f"{type(e).__name__}: {e}"

BACKENDS = ("torch", "triton", "cuda")
_MODULES = {"torch": _torch_backend, "triton": _triton_backend, "cuda": _cuda_backend}


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call (it never falls back silently)."""


class BackendStatus(NamedTuple):
    available: bool
    detail: str


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_status(device: torch.device | None = None) -> BackendStatus:
    if _triton_backend is None:
        return BackendStatus(False, f"triton is not importable ({_TRITON_IMPORT_ERROR})")
    version = _triton_backend.TRITON_VERSION
    if device is not None and device.type == "cpu":
        if _triton_interpret():
            return BackendStatus(True, f"triton {version}, interpreter on CPU tensors (TRITON_INTERPRET=1)")
        return BackendStatus(False, "CPU tensors need TRITON_INTERPRET=1 for the triton backend")
    if device is None and not torch.cuda.is_available():
        if _triton_interpret():
            return BackendStatus(True, f"triton {version}, interpreter on CPU tensors (TRITON_INTERPRET=1)")
        return BackendStatus(False, f"triton {version} installed but no CUDA device (set TRITON_INTERPRET=1 to run on CPU)")
    return BackendStatus(True, f"triton {version} on CUDA")


def _cuda_status(device: torch.device | None = None) -> BackendStatus:
    ok, reason = _cuda_backend.extension_status()
    if not ok:
        return BackendStatus(False, reason)
    if device is not None and device.type != "cuda":
        return BackendStatus(False, f"the cuda backend needs CUDA tensors, got tensors on {device}")
    if device is None and not torch.cuda.is_available():
        return BackendStatus(False, "extension built, but torch sees no CUDA device")
    return BackendStatus(True, reason)


def available_backends() -> dict[str, BackendStatus]:
    """What each backend can do on this machine, and why not where it cannot."""
    return {
        "torch": BackendStatus(True, f"PyTorch reference, torch {torch.__version__}, any device"),
        "triton": _triton_status(),
        "cuda": _cuda_status(),
    }


def _impl(backend: str, op: str) -> Callable:
    fn = getattr(_MODULES[backend], op, None)
    if fn is None:
        raise BackendUnavailableError(f"{op}: backend {backend!r} does not implement this op yet")
    return fn


_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# torch.compile takes the answer at trace time: the device of a traced call is fixed by its guards.
@torch.compiler.assume_constant_result
def device_class(index: int) -> str:
    """The class of CUDA device `index` that the evidence in verified.py is keyed by: its name."""
    return _device_name(index)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def evidence_backend(device: str, op: str, dtype: torch.dtype, shape: dict) -> str | None:
    """The backend verified.py names for this call, or None. Plain lookups and comparisons of shape
    integers (guards under torch.compile), nothing that reads a tensor."""
    for exact, (name, lo, hi), backend, _ in verified.EVIDENCE.get((device, op, _DTYPE_NAMES.get(dtype)), ()):
        if lo <= shape[name] <= hi and all(shape[k] == v for k, v in exact):
            return backend
    return None


def step_in_one_call(device: torch.device, dtype: torch.dtype, shape: dict, *, graphed: bool) -> bool:
    """backend="auto": whether a drafter step (`gemma4_mtp.Gemma4MTPDrafter.step`; shape: its Hb, Hd, Q, B) on
    `device` is one call into C++ rather than the ops one by one: verified.py names cuda for it (from the whole
    steps a GPU run timed: graph-replayed ones for a step of a captured round, `graphed`, eager ones for any
    other) and the cuda backend is usable there. Not a function of whether the stream is being captured: the
    eager warm-up before a capture takes the path the capture takes (a kernel's first launch inside a capture
    could fail)."""
    if device.type != "cuda":
        return False
    op = "drafter_step" if graphed else "drafter_step_eager"
    return (evidence_backend(device_class(device.index or 0), op, dtype, shape) == "cuda"
            and _cuda_status(device).available)


def resolve(op: str, backend: str, device: torch.device, dtype: torch.dtype, shape: dict | None = None) -> Callable:
    """The implementation of `op` that serves a call on `device` for `backend`. `shape`: the call's
    shape parameters (benchmarks.make_verified.SHAPES names them), which `auto` matches against the
    evidence of verified.py."""
    if backend == "auto":
        if device.type != "cuda":
            return _impl("torch", op)
        chosen = None if shape is None else evidence_backend(device_class(device.index or 0), op, dtype, shape)
        if chosen == "cuda" and _cuda_status(device).available:
            return _impl("cuda", op)
        if _triton_status(device).available:
            return _impl("triton", op)
        return _impl("torch", op)
    if backend == "torch":
        return _impl("torch", op)
    if backend == "triton":
        status = _triton_status(device)
    elif backend == "cuda":
        status = _cuda_status(device)
    else:
        raise ValueError(f"{op}: backend must be one of 'auto', 'torch', 'triton', 'cuda', got {backend!r}")
    if not status.available:
        raise BackendUnavailableError(f"{op}: backend {backend!r} is unavailable: {status.detail}")
    return _impl(backend, op)
