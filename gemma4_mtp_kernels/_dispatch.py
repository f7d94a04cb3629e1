"""Backend selection (SPEC §3).

Each backend is a module exposing the four op functions under their public names, taking the
public signature minus `backend=` and receiving arguments that the public op already validated:
    gemma4_mtp_kernels.reference   "torch"
    gemma4_mtp_kernels.triton      "triton"
    gemma4_mtp_kernels.cuda        "cuda"
"""
from __future__ import annotations

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


def resolve(op: str, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> Callable:
    """The implementation of `op` that serves a call on `device` for `backend`."""
    if backend == "auto":
        if device.type != "cuda":
            return _impl("torch", op)
        if _cuda_status(device).available and verified.is_verified(op, device, dtype, head_dim):
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
