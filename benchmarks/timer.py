"""GPU timing: CUDA graph replay (or CUDA events when a callable cannot be captured), warm-up,
cold L2 by rotating input sets, median of many runs; the device's copy bandwidth and launch floor.

Cold L2: the caller passes several input sets whose total size exceeds the L2 cache (n_sets());
one replay runs the op once on every set in turn, so each call finds its operands evicted by the
calls on the other sets. The time per call is replay time / number of sets.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Timing:
    median_s: float
    min_s: float
    runs: int
    method: str  # "graph" | "events"

    def to_dict(self) -> dict:
        return {"time_s": self.median_s, "min_s": self.min_s, "runs": self.runs, "method": self.method}


def n_sets(bytes_per_set: float, l2_bytes: int, *, cap: int = 64) -> int:
    """Input sets to rotate so that their total is at least 3x the L2 (2 when one set already is)."""
    if bytes_per_set <= 0:
        return 1
    return int(min(cap, max(2, -(-3 * l2_bytes // int(bytes_per_set)))))


def _events_time(calls: Sequence[Callable[[], object]], runs: int) -> list[float]:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(runs):
        start.record()
        for c in calls:
            c()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return out


def time_calls(calls: Sequence[Callable[[], object]], *, warmup: int = 5, runs: int = 30,
               graph: bool = True) -> Timing:
    """Median time of one call; `calls` are the same op bound to different input sets (cold L2).

    graph=True captures the sequence in a CUDA graph (launch overhead as an engine running graphs
    sees it); a callable that syncs with the host or allocates unpredictably cannot be captured and
    is timed with events around eager calls instead (method says which)."""
    if not torch.cuda.is_available():
        return _wallclock(calls, warmup, runs)
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()
    if graph:
        try:
            g = capture_graph(calls)
            g.replay()
            torch.cuda.synchronize()
            times = _events_time([g.replay], runs)
            times = [t / len(calls) for t in times]
            return Timing(statistics.median(times), min(times), runs, "graph")
        except Exception:  # noqa: BLE001 - any capture failure means: time it eagerly
            torch.cuda.synchronize()
    times = _events_time(calls, runs)
    return Timing(statistics.median(times), min(times), runs, "events")


def capture_graph(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """The calls captured in one CUDA graph, after a run of them off the default stream (as
    torch.cuda.graph asks: it captures on a stream of its own)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def _wallclock(calls, warmup: int, runs: int) -> Timing:
    """Host wall clock, for CPU tensors only (the harness's own tests); never a GPU number."""
    for _ in range(warmup):
        for c in calls:
            c()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - t0) / len(calls))
    return Timing(statistics.median(times), min(times), runs, "cpu-wallclock")


def copy_bandwidth(nbytes: int = 1 << 30, runs: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), the memory roof the
    benchmarks report their ratios against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_calls([lambda: dst.copy_(src)], warmup=3, runs=runs, graph=False)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / t.median_s


def matmul_flops(n: int = 8192, runs: int = 10) -> float:
    """Dense bf16 GEMM throughput in FLOP/s (the compute roof measured the same way)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = time_calls([lambda: a @ b], warmup=3, runs=runs, graph=False)
    return 2.0 * n**3 / t.median_s


def launch_floor() -> float:
    """Time of one trivial kernel replayed in a CUDA graph: the least any op can take."""
    x = torch.zeros(1, device="cuda")
    return time_calls([lambda: x.add_(1)] * 16, runs=30).median_s
