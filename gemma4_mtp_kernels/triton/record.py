"""Record the Triton launches our launchers make, without a GPU and without running a kernel.

`recording(sms)` lets the launchers run on **meta tensors** as if on a CUDA device with `sms`
multiprocessors: each `kernel[grid](...)` goes through Triton's own JIT front end (argument binding,
the specialisation of pointers and integers it would apply on a GPU: None -> constexpr, divisibility
by 16, ...) and stops where Triton would compile, through its `jit_cache_hook`. What Triton hands the
hook (signature, constexprs, attributes) plus the launch options the launcher passed (warps, stages,
register cap) is exactly what a GPU would compile, so `gemma4_mtp_kernels.triton.aot` can compile each
recorded launch for sm_80 / sm_90 offline. There is no second description of the launch arguments to
drift from the launchers (the first GPU run failed on such a drift).

Needs the real `@triton.jit` kernels: not under TRITON_INTERPRET=1 (the interpreter never compiles).
Works with Triton 3.6 and 3.8 (the hook's keyword interface is the same in both).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from . import _common

# The device key the recording driver reports: never a real device index, so Triton's per-device
# binder caches of a later real launch in the same process are never the recording's.
_DEVICE = "gemma4-mtp-recorder"


class RecordedLaunch(NamedTuple):
    kernel: JITFunction
    signature: dict    # parameter name -> Triton type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict   # parameter path -> value (what the JIT specialised away)
    attrs: dict        # parameter path -> attributes (tt.divisibility ...)
    options: dict      # launch options the launcher passed: num_warps, num_stages, maxnreg, ...
    grid: tuple | None  # the launch grid when the launcher gave a tuple

    @property
    def key(self) -> tuple:
        """Identity of the compile: equal keys give the same binary."""
        return (self.kernel.__module__, self.kernel.__name__, tuple(sorted(self.signature.items())),
                tuple(sorted((str(k), repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted((str(k), repr(v)) for k, v in self.attrs.items())),
                tuple(sorted(self.options.items())))


class _RecordingDriver:
    """Stands in for Triton's CUDA driver while recording: a device, a stream and a CUDA target for
    the binder (the argument specialisation is the same for every CUDA architecture)."""

    def get_current_device(self):
        return _DEVICE

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        raise RuntimeError(f"a Triton launch asked the driver for {name!r} while recording launches")


@contextlib.contextmanager
def recording(sms: int, arch: int = 90) -> Iterator[list[RecordedLaunch]]:
    """Within the block, Triton launches on meta tensors are recorded (in launch order) instead of
    compiled and run; the launchers size their grids and pick their features for a GPU with `sms`
    multiprocessors of SM architecture `arch` (80: A100, 90: H100/H200)."""
    if triton.knobs.runtime.interpret:
        raise RuntimeError("recording needs the real @triton.jit kernels: unset TRITON_INTERPRET")
    launches: list[RecordedLaunch] = []
    pending: list[tuple[dict, object]] = []
    kernels: set[JITFunction] = set()
    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = {p.name for p in self.params}
        options = {k: v for k, v in kwargs.items() if k not in params and v is not None}
        pending.append((options, grid))
        kernels.add(self)
        try:
            return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            pending.pop()

    def hook(*, fn, compile, **_):
        options, grid = pending[-1]
        launches.append(RecordedLaunch(fn.jit_function, dict(compile["signature"]), dict(compile["constants"]),
                                       dict(compile["configs"][0]), options,
                                       tuple(grid) if isinstance(grid, (tuple, list)) else None))
        return True  # Triton skips the compile and the launch

    previous = (driver._active, triton.knobs.runtime.jit_cache_hook, _common.recording_sms, _common.recording_arch)
    driver.set_active(_RecordingDriver())
    triton.knobs.runtime.jit_cache_hook = hook
    JITFunction.run = run
    _common.recording_sms, _common.recording_arch = sms, arch
    try:
        yield launches
    finally:
        JITFunction.run = original_run
        driver._active, triton.knobs.runtime.jit_cache_hook, _common.recording_sms, _common.recording_arch = previous
        for kernel in kernels:  # drop the binder built for the recording target
            kernel.device_caches.pop(_DEVICE, None)
