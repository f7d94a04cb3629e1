"""The chains that benchmarks/bench_stage_boundary.py times on a GPU (benchmarks/cuda/stage_boundary.cuh:
one kernel per stage, the same with programmatic dependent launch, one cooperative kernel with a grid
barrier between stages, with either arrival) compute what they claim, on the CPU under the CUDA emulation
(tests/cuda_emulator/stage_boundary_main.cpp), against the chain computed here with numpy. A chain
whose stages did not each wait for every program of the one before would sum a half-written vector,
so these runs also check that the launcher orders the stages and that the grid barrier holds the
programs of a cooperative launch (the emulation runs them at once). The benchmark itself checks each
graph's first replay on the GPU the same way; nvcc compiling it for every target is
tests/test_cuda_build.py's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import emulated


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "stage_boundary_main.cpp", "stage_boundary")


def chain(start: np.ndarray, stages: int) -> np.ndarray:
    """Stage s: every element of the vector gains the vector's sum + 1 (uint32, wrapping)."""
    v = start.astype(np.uint64)
    for _ in range(stages):
        v = (v + (int(v.sum()) & 0xFFFFFFFF) + 1) & 0xFFFFFFFF
    return v.astype(np.uint32)


@pytest.mark.parametrize("mode,schedule", [("launch", "rr"), ("launch", "behind"), ("pdl", "rr"), ("barrier", "rr"),
                                           ("barrier", "ahead"), ("barrier", "behind"), ("barrier_fence", "ahead")],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("programs,n,stages", [(1, 4, 1), (3, 100, 4), (8, 64, 5), (8, 12, 3), (5, 2048, 2)],
                         ids=lambda v: str(v))
def test_chain(binary, tmp_path, mode, schedule, programs, n, stages):
    """(8, 12): programs that own no element still sum and meet at the barrier. With the programs of the
    cooperative launch each running as far as it can before the next (schedule ahead or behind: from the
    lowest or the highest index), a missing barrier makes the first program sum a vector the others
    have not written yet."""
    start = (np.arange(n, dtype=np.uint64) * 2654435761 & 0xFFFFFFFF).astype(np.uint32)
    emulated.write(tmp_path / "start.bin", torch.from_numpy(start.view(np.int32)))
    out = emulated.run(binary, f"dir={tmp_path} mode={mode} programs={programs} n={n} stages={stages} sms=8 "
                               f"schedule={schedule}")
    assert int(out["launches"]) == (1 if mode.startswith("barrier") else stages)
    got = emulated.read(tmp_path / "result.bin", torch.int32, (n,)).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, chain(start, stages))


@pytest.mark.parametrize("mode", ["barrier", "barrier_fence"])
@pytest.mark.parametrize("stages", [2, 3, 6])
@pytest.mark.parametrize("counter", [0, -2**31])
def test_grid_barrier_needs_no_reset(binary, tmp_path, counter, stages, mode):
    """The barrier's counter is never reset: a launch starts wherever the last left it, either top bit,
    low 31 bits zero, and leaves them zero (the driver checks it). Each barrier flips the top bit once."""
    start = np.arange(64, dtype=np.uint32)
    emulated.write(tmp_path / "start.bin", torch.from_numpy(start.view(np.int32)))
    out = emulated.run(binary, f"dir={tmp_path} mode={mode} programs=7 n=64 stages={stages} sms=8 counter={counter}")
    got = emulated.read(tmp_path / "result.bin", torch.int32, (64,)).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, chain(start, stages))
    flips = stages - 1
    assert int(out["counter"]) == (counter if flips % 2 == 0 else counter ^ -2**31)
