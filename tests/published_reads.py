"""Under the Triton interpreter, every load with cache_modifier=".cg" is recorded with the bytes it
returned, and when the launch ends each location must still hold those bytes.

The kernels use .cg loads exactly for data other programs of the same launch write, and read it only
after the election or grid barrier that completes it: split-k partials, attention splits, top-k
candidates, tree_verify's granule statistics. The interpreter runs a launch's programs one after another.
So a program that reads the others' data without having been elected (every program merging, a wrong
arrival count) reads the data of programs still to come, and those programs rewrite it afterwards. Its
result may still be overwritten by the rightful merger's, so the outputs alone would not show the bug.
This check does: it fails the launch with PublishedReadError.

The CUDA emulation checks the same rule (tests/cuda_emulator/emu.h, check_published_reads). The hooks
wrap two methods of Triton's interpreter, the builder's masked load and the grid executor's end of
launch. install() says whether this Triton has them; conftest.py installs them for the whole session.
"""
from __future__ import annotations

import numpy as np


class PublishedReadError(AssertionError):
    pass


_reads: list | None = None  # (addresses, bytes per element, the bytes read) of the running launch


def _check(kernel: str) -> None:
    from triton._C.libtriton import interpreter as native

    for addrs, width, got in _reads:
        now = native.load(addrs, np.ones(addrs.shape, dtype=bool), np.zeros(addrs.shape, dtype=got.dtype), got.dtype)
        changed = now.view(np.uint8).reshape(-1, width) != got.view(np.uint8).reshape(-1, width)
        if changed.any():
            i = int(np.flatnonzero(changed.any(axis=1))[0])
            raise PublishedReadError(
                f"{kernel}: a program read {width} bytes at {int(addrs[i]):#x} that a later program of the "
                f"launch rewrote (a read of other programs' data before the election or barrier that "
                f"completes it); {int(changed.any(axis=1).sum())} such elements")


def install() -> bool:
    """Hooks the interpreter; False (nothing hooked) when this Triton lacks what the hooks wrap."""
    try:
        from triton._C.libtriton import ir
        from triton.runtime import interpreter as interp
        builder, executor, cg = interp.interpreter_builder, interp.GridExecutor, ir.CACHE_MODIFIER.CG
        load, call, restore = builder.create_masked_load, executor.__call__, executor._restore_args_dev
    except (ImportError, AttributeError):
        return False
    if getattr(executor, "_published_reads", False):
        return True

    def recording_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        ret = load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)
        if _reads is not None and cache_modifier == cg:
            live = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)  # a mask may come as int32
            values = np.ascontiguousarray(ret.data[live])
            _reads.append((np.ascontiguousarray(ptrs.data[live]), values.dtype.itemsize, values))
        return ret

    def launch(self, *args, **kwargs):
        global _reads
        outer, _reads = _reads, []
        try:
            return call(self, *args, **kwargs)
        finally:
            _reads = outer

    def end_of_launch(self, *args, **kwargs):
        _check(getattr(self.fn, "__name__", "a Triton kernel"))
        return restore(self, *args, **kwargs)

    builder.create_masked_load = recording_load
    executor.__call__, executor._restore_args_dev = launch, end_of_launch
    executor._published_reads = True
    return True
