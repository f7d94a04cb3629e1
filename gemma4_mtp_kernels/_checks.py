"""Argument checks shared by the public ops.

Every failure raises TypeError (wrong kind of object or dtype) or ValueError (wrong shape or value)
with a message of the form "<op>: <argument> <expected>, got <what was given>", so that a caller can
find the offending argument without reading our code.

Checks that need tensor *values* (index ranges, tree structure) cost a device->host copy on a GPU.
They always run for CPU tensors. For CUDA tensors they run only when value checks are enabled
(`GEMMA4_MTP_VALUE_CHECKS=1` or `set_value_checks(True)`) and never while a CUDA graph is being
captured or torch.compile is tracing; the kernels themselves guard every index so that unchecked bad
values give NaN / -1 outputs instead of out-of-bounds reads.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_value_checks_on_cuda = os.environ.get("GEMMA4_MTP_VALUE_CHECKS", "0") not in ("", "0", "false", "False")


def set_value_checks(enabled: bool) -> None:
    """Turn value-dependent checks on or off for CUDA tensors (they always run on CPU tensors)."""
    global _value_checks_on_cuda
    _value_checks_on_cuda = bool(enabled)


def values_checkable(t: torch.Tensor) -> bool:
    """Whether checks that read `t`'s values may run now without a hidden sync or a graph break."""
    if t.device.type == "cpu":
        return not torch.compiler.is_compiling()
    if not _value_checks_on_cuda or torch.compiler.is_compiling():
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def fail_type(op: str, name: str, expected: str, got) -> None:
    raise TypeError(f"{op}: {name} must be {expected}, got {_describe(got) if not isinstance(got, str) else got}")


def fail_value(op: str, name: str, expected: str, got) -> None:
    raise ValueError(f"{op}: {name} must be {expected}, got {got}")


def tensor(op: str, name: str, t, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail_type(op, name, "a torch.Tensor", t)
    if dtypes is not None and t.dtype not in dtypes:
        fail_type(op, name, f"of dtype {' or '.join(str(d) for d in dtypes)}", f"dtype {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        fail_value(op, name, f"a {ndim}-d tensor", f"shape {tuple(t.shape)} ({t.dim()}-d)")
    return t


def dim(op: str, name: str, t: torch.Tensor, axis: int, expected: int, what: str) -> None:
    if t.shape[axis] != expected:
        fail_value(op, name, f"of size {expected} in dim {axis} ({what})", f"shape {tuple(t.shape)}")


def same_dtype(op: str, ref_name: str, ref: torch.Tensor, others: Iterable[tuple[str, torch.Tensor]]) -> None:
    for name, t in others:
        if t.dtype != ref.dtype:
            fail_type(op, name, f"of the same dtype as {ref_name} ({ref.dtype})", f"dtype {t.dtype}")


def same_device(op: str, ref_name: str, ref: torch.Tensor, others: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    for name, t in others:
        if t is not None and t.device != ref.device:
            fail_value(op, name, f"on the same device as {ref_name} ({ref.device})", f"device {t.device}")


def inner_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail_value(op, name, "stride 1 in its last dimension", f"strides {t.stride()}")


def contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        fail_value(op, name, "contiguous", f"strides {t.stride()} for shape {tuple(t.shape)}")


def out_tensor(op: str, out, shape: Sequence[int], dtype: torch.dtype, device: torch.device, name: str = "out") -> None:
    tensor(op, name, out)
    if tuple(out.shape) != tuple(shape):
        fail_value(op, name, f"of shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    if out.dtype != dtype:
        fail_type(op, name, f"of dtype {dtype}", f"dtype {out.dtype}")
    if out.device != device:
        fail_value(op, name, f"on device {device}", f"device {out.device}")
    contiguous(op, name, out)


def no_overlap(op: str, name: str, out, others: Iterable[tuple[str, torch.Tensor | None]]) -> None:
    """`out` shares no memory with an input: the kernels' programs read inputs while others write out.
    Not checkable while torch.compile traces (no storage to compare); skipped there."""
    if out is None or out.numel() == 0 or torch.compiler.is_compiling():
        return
    lo, hi = _byte_span(out)
    for other, t in others:
        # torch._C._overlaps answers "same storage"; the spans decide whether the bytes meet
        if t is not None and t.numel() and torch._C._overlaps(out, t):
            t_lo, t_hi = _byte_span(t)
            if lo < t_hi and t_lo < hi:
                fail_value(op, name, f"a buffer that does not overlap {other}", f"a tensor sharing memory with {other}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of t's elements within its storage (t non-empty)."""
    first = t.storage_offset() * t.element_size()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) * t.element_size()
    return first, last + t.element_size()


def positive_int(op: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail_type(op, name, "an int", _describe(v))
    if v < 1:
        fail_value(op, name, ">= 1", v)
    return v


def finite_float(op: str, name: str, v, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        fail_type(op, name, "a float", _describe(v))
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        fail_value(op, name, "finite", v)
    if positive and v <= 0:
        fail_value(op, name, "> 0", v)
    return v


def index_range(op: str, name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Checks low <= t < high elementwise (t may be empty); only call when values_checkable(t)."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low or hi >= high:
        bad = t[(t < low) | (t >= high)][0].item()
        fail_value(op, name, f"in [{low}, {high}) ({what})", f"value {bad}")


def centroid_order(op: str, order, output: str) -> None:
    """The centroid head's forced phase-2 order, which both GPU backends take for comparisons (the public
    op does not): None (the plan's), "tokens", or for argmax and topk "clusters"."""
    if order not in (None, "tokens") and not (order == "clusters" and output in ("argmax", "topk")):
        fail_value(op, "order", "'tokens' or, for argmax and topk, 'clusters'", repr(order))
