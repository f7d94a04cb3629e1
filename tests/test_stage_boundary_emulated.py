"""The chains that benchmarks/bench_stage_boundary.py times on a GPU (benchmarks/cuda/stage_boundary.cuh:
one kernel per stage, the same with programmatic dependent launch, one cooperative kernel with a grid
barrier between stages, with either arrival) compute what they claim, on the CPU under the CUDA emulation
(tests/cuda_emulator/stage_boundary_main.cpp), against the chain computed here with numpy. A chain
whose stages did not each wait for every program of the one before would sum a half-written vector,
so these runs also check that the launcher orders the stages and that the grid barrier holds the
programs of a cooperative launch (the emulation runs them at once), and the cluster barrier the programs
of one thread block cluster, with the vectors in global memory or in the programs' shared memory, read
through distributed shared memory (the emulation runs a cluster's programs at once, each at the same
offset of the others' shared memory). The stream kernel's sums are checked too, a layer's GEMVs, a whole
sliding layer and E2B's step run in one cluster (cluster_gemv.cuh) against float64, one GEMV on every program
from a ring of bulk copies (stream_gemv.cuh), and one query's attention over a paged context on every program,
merged in clusters (stream_attention.cuh). The benchmark itself checks each
graph's first replay on the GPU the same way; nvcc compiling it for every target is
tests/test_cuda_build.py's."""
from __future__ import annotations

import inspect
import os
import subprocess

import numpy as np
import pytest
import torch

import emulated
from benchmarks import bench_stage_boundary
from gemma4_mtp.config import FULL, SLIDING


@pytest.fixture(scope="module")
def binary(request):
    # the sm_90 build (kHasBulkCopy): stream_gemv.cuh has no other path
    return emulated.build(request, "stage_boundary_main.cpp", "stage_boundary", ("-DEMU_BULK=1",))


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


@pytest.mark.parametrize("mode", ["cluster", "cluster_shared", "cluster_push"])
@pytest.mark.parametrize("schedule", ["rr", "ahead", "behind"])
@pytest.mark.parametrize("programs,n,stages", [(2, 8, 1), (3, 100, 4), (8, 64, 5), (5, 12, 3), (16, 2048, 3),
                                               (16, 8, 2), (4, 64, 7)], ids=lambda v: str(v))
def test_cluster_chain(binary, tmp_path, mode, schedule, programs, n, stages):
    """One cluster of 2-16 programs (above 8 the launcher opts the kernel in to non-portable sizes, else
    the launch is refused); (5, 12), (16, 8): programs whose slice is empty still sum and meet. Run ahead
    or behind, a program that passed a stage without the cluster barrier would sum a vector (or, shared,
    read slices) the others have not written; the shared chain's first barrier orders its loads of the
    start before the others' reads, its last keeps each slice alive until the others have read it. The
    push chain: a stage that does not wait for its vector's bytes, waits on the wrong phase parity, or
    announces the wrong byte count, or pushes before the peers' mbarriers are initialised, fails (each
    mutation was run)."""
    start = (np.arange(n, dtype=np.uint64) * 2654435761 & 0xFFFFFFFF).astype(np.uint32)
    emulated.write(tmp_path / "start.bin", torch.from_numpy(start.view(np.int32)))
    out = emulated.run(binary, f"dir={tmp_path} mode={mode} programs={programs} n={n} stages={stages} sms=16 "
                               f"schedule={schedule}")
    assert int(out["launches"]) == 1
    got = emulated.read(tmp_path / "result.bin", torch.int32, (n,)).numpy().view(np.uint32)
    np.testing.assert_array_equal(got, chain(start, stages))


@pytest.mark.parametrize("mode", ["cluster", "cluster_shared", "cluster_push"])
@pytest.mark.parametrize("programs,major", [(17, 9), (4, 8)])
def test_cluster_refused(binary, tmp_path, mode, programs, major):
    """More than 16 programs, or a GPU before sm_90: the launch is refused (the benchmark skips those)."""
    emulated.write(tmp_path / "start.bin", torch.zeros(64, dtype=torch.int32))
    out = emulated.run(binary, f"dir={tmp_path} mode={mode} programs={programs} n=64 stages=2 sms=32 major={major}",
                       ok_prefix="REFUSED")
    assert int(out["launches"]) == 0


@pytest.mark.parametrize("programs,words,passes", [(1, 1, 1), (3, 100, 2), (16, 4100, 3)], ids=lambda v: str(v))
def test_stream_sums(binary, tmp_path, programs, words, passes):
    """stream_kernel: program p's sum (uint32, wrapping) of its slice's words, `passes` times; (16, 4100):
    a slice longer than one 8-deep round of 512 threads, with a partial round."""
    data = np.random.default_rng(words).integers(0, 2**32, size=programs * words * 4, dtype=np.uint64)
    emulated.write(tmp_path / "start.bin", torch.from_numpy(data.astype(np.uint32).view(np.int32)))
    emulated.run(binary, f"dir={tmp_path} mode=stream programs={programs} words={words} passes={passes}")
    got = emulated.read(tmp_path / "result.bin", torch.int32, (programs,)).numpy().view(np.uint32)
    want = (data.reshape(programs, -1).sum(axis=1) * passes) & 0xFFFFFFFF
    np.testing.assert_array_equal(got, want.astype(np.uint32))


def gemv_chain(stages, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """cluster_gemv's chain in float64: per stage (n, k, norm, glu) the GLU fold gelu(a) * b of a 2k input,
    the input's inverse RMS as scale, then scale * W x for the next stage's bf16 [n, k] weights in w; per
    attention stage (n, k, norm, 0, window) each of the n / k heads' query normed by its own RMS (norm),
    then softmax(q K^T) V over the next [window, k] keys and [window, k] values in w."""
    x, off = x.astype(np.float64), 0
    for n, k, norm, glu, *window in stages:
        if window:
            kv = w[off:off + 2 * window[0] * k].reshape(2, window[0], k).astype(np.float64)
            q = x.reshape(n // k, k)
            if norm:
                q = q / np.sqrt((q ** 2).mean(axis=1, keepdims=True) + 1e-6)
            s = q @ kv[0].T
            p = np.exp(s - s.max(axis=1, keepdims=True))
            x = ((p / p.sum(axis=1, keepdims=True)) @ kv[1]).reshape(-1)
            off += 2 * window[0] * k
            continue
        if glu:
            a = x[:k]
            x = 0.5 * a * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3))) * x[k:2 * k]
        scale = 1 / np.sqrt((x[:k] ** 2).mean() + 1e-6) if norm else 1.0
        x = scale * (w[off:off + n * k].reshape(n, k).astype(np.float64) @ x[:k])
        off += n * k
    return x


# E2B's layers as the benchmark runs them (its shapes from drafter_shapes): the full layer's GEMVs; a sliding
# layer, 4 query heads with their q_norm and attention over a 512-token window of one key-value head after q_proj
E2B_LAYER = bench_stage_boundary.layer_stages("E2B", FULL)
E2B_SLIDING_LAYER = bench_stage_boundary.layer_stages("E2B", SLIDING)


def weight_count(stage) -> int:
    n, k, _, _, *window = stage
    return 2 * window[0] * k if window else n * k


def run_gemv_chain(binary, tmp_path, programs, stages, schedule):
    """The chain on the emulated cluster against gemv_chain, weights and keys ~ U(-1, 1) / 8 through bf16."""
    rng = np.random.default_rng(programs)
    w = torch.from_numpy(rng.uniform(-1, 1, sum(map(weight_count, stages))).astype(np.float32) / 8)
    w = w.to(torch.bfloat16)
    n0, k0, _, glu0, *window0 = stages[0]
    x = rng.standard_normal(n0 if window0 else k0 * (2 if glu0 else 1)).astype(np.float32)
    emulated.write(tmp_path / "x.bin", torch.from_numpy(x))
    emulated.write(tmp_path / "w.bin", w)
    chain_arg = ",".join(":".join(map(str, st)) for st in stages)
    emulated.run(binary, f"dir={tmp_path} mode=gemv programs={programs} chain={chain_arg} sms=16 schedule={schedule}")
    got = emulated.read(tmp_path / "result.bin", torch.float32, (stages[-1][0],)).numpy()
    want = gemv_chain(stages, w.float().numpy(), x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("programs,stages,schedule", [
    (4, [(64, 32, 1, 0), (32, 64, 0, 0), (128, 32, 1, 0), (32, 64, 0, 1)], "rr"),
    (4, [(64, 32, 1, 0), (32, 64, 0, 0), (128, 32, 1, 0), (32, 64, 0, 1)], "ahead"),
    (2, [(16, 8, 0, 0)], "behind"),
    (3, [(96, 264, 1, 0), (24, 96, 0, 0)], "rr"),
    (16, E2B_LAYER, "rr"),
    (8, E2B_LAYER, "ahead"),
], ids=lambda v: str(v) if not isinstance(v, list) else f"{len(v)}stages")
def test_gemv_chain(binary, tmp_path, programs, stages, schedule):
    """A layer's GEMVs in one cluster (cluster_gemv.cuh) against float64: the weight ring refilled across
    stages (E2B's layer at 8 programs: its gate_up rows take two groups of the ring), the outputs pushed
    into every program's copy of the next input, the norm and the GLU fold done by each program on its
    copy; (3, k = 264): a partial 256-column unit. Without the wait for a group's bytes the run fails
    (copies nobody waited for), without the barrier before the row sums it reads NaN-poisoned partials."""
    run_gemv_chain(binary, tmp_path, programs, stages, schedule)


@pytest.mark.parametrize("programs,stages,schedule", [
    (4, [(512, 64, 1, 0), (512, 256, 1, 0, 32), (64, 512, 0, 0)], "rr"),       # 2 heads, 8 keys a program
    (2, [(256, 32, 1, 0), (256, 256, 0, 0, 16), (32, 256, 0, 0)], "behind"),   # 1 head, no q_norm
    (4, [(1024, 64, 1, 0), (1024, 256, 1, 0, 64), (64, 1024, 0, 0)] * 2, "ahead"),  # 4 heads, twice
    (4, [(1024, 256, 1, 0, 128), (64, 1024, 0, 0)], "rr"),                   # attention first: the input
    (16, E2B_SLIDING_LAYER, "rr"),   # 32 keys a program: a chunk of keys, one of values
    (8, E2B_SLIDING_LAYER, "ahead"),  # 64: two of each
    (4, E2B_SLIDING_LAYER, "behind"),  # 128: the ring full of one program's keys and values
    (16, [(2048, 256, 1, 0), (2048, 256, 1, 0, 512), (256, 2048, 0, 0)], "ahead"),  # 8 heads
], ids=lambda v: str(v) if not isinstance(v, list) else f"{len(v)}stages")
def test_gemv_chain_attention(binary, tmp_path, programs, stages, schedule):
    """A sliding layer in one cluster (cluster_gemv.cuh's attention stage) against float64: each program's
    keys and values streamed through the weights' ring, its heads' scores and partial output over them,
    pushed to the programs owning the entries with each head's max and exp-sum, merged there and pushed to
    every program as a GEMV's rows; two attention stages in a chain (the partials' mbarrier phase)."""
    run_gemv_chain(binary, tmp_path, programs, stages, schedule)


def test_gemv_chain_e2b_step(binary, tmp_path):
    """E2B's step as the benchmark's "step" row runs it, 21 stages on 16 programs: the concat-down-projection
    (3072 inputs), three sliding layers and the full layer's GEMVs in the step's order, then the post-projection
    and centroid scores side by side (3584 rows): the ring and the partials' mbarriers carried across stages of
    every kind."""
    stages = bench_stage_boundary.step_stages("E2B")
    assert len(stages) == 21 and stages[0][:2] == (256, 3072) and stages[-1][:2] == (1536 + 2048, 256)
    run_gemv_chain(binary, tmp_path, 16, stages, "ahead")


@pytest.mark.parametrize("spec", ["64:32:0", "64:32:0:0:", "64:32:0:0:8:1", "64:32:x:0", "64:32:0:0,,32:64:0:0",
                                  ",".join(["8:8:0:0"] * 33)])
def test_gemv_chain_spec_refused(binary, tmp_path, spec):
    """cluster_gemv::append_stages, which reads the chains of the benchmark's command line: an entry that is not
    4 or 5 integers joined by ':', an empty entry, more than kMaxStages stages: the driver says so, nothing
    launches."""
    done = subprocess.run([str(binary), f"dir={tmp_path}", "mode=gemv", "programs=2", f"chain={spec}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.startswith("FAIL chain="), done.stdout + done.stderr


@pytest.mark.parametrize("programs,chain_arg", [
    (3, "64:32:0:0"), (4, "64:12:0:0"), (17, "68:8:0:0"), (2, "16:8:0:0,16:8:0:0,8:16:0:0"),
    (4, "4096:256:1:0:64"),   # 16 heads: more than a warp's transposed reduction takes
    (4, "1024:128:1:0:64"),   # attention over 128-entry heads
    (4, "1040:256:1:0:64"),   # a query that is not whole heads
    (4, "1024:256:1:0:66"),   # a window that does not split over the programs
    (2, "2048:256:1:0:512"),  # 256 keys a program: its keys and values do not fit the ring at once
])
def test_gemv_chain_refused(binary, tmp_path, programs, chain_arg):
    """Rows that do not split into 16-byte pushes over the programs, k not a multiple of 8, more than 16
    programs, a stage whose input is not the last one's output, attention stages the kernel does not take:
    the launcher refuses, nothing launches."""
    stages = [tuple(map(int, s.split(":"))) for s in chain_arg.split(",")]
    n0, k0, _, _, *window0 = stages[0]
    emulated.write(tmp_path / "x.bin", torch.zeros(n0 if window0 else k0, dtype=torch.float32))
    emulated.write(tmp_path / "w.bin", torch.zeros(sum(map(weight_count, stages)), dtype=torch.bfloat16))
    out = emulated.run(binary, f"dir={tmp_path} mode=gemv programs={programs} chain={chain_arg} sms=32",
                       ok_prefix="REFUSED")
    assert int(out["launches"]) == 0


@pytest.mark.parametrize("programs,n,k,norm,schedule", [
    (8, 64, 1024, 1, "rr"),      # a chunk a program
    (2, 64, 2048, 0, "ahead"),   # 8 chunks: the ring filled once
    (1, 32, 8192, 1, "rr"),      # 32 chunks: the ring refilled four times
    (2, 8, 16384, 1, "behind"),  # a chunk is half a row: two chunks' sums add into one row
    (4, 128, 256, 0, "rr"),      # 32-row chunks
    (8, 64, 256, 1, "ahead"),    # a block smaller than a chunk: one 8-row chunk of 4 KiB
    (4, 32, 512, 0, "behind"),   # one 8 KiB chunk, two units a row
    (128, 256, 1024, 0, "rr"),   # E2B's sliding o_proj on 128 programs: two rows a program, 4 KiB
    (128, 1024, 256, 1, "ahead"),  # E2B's sliding q_proj on 128 programs: 8 rows a program, 4 KiB
])
def test_wide_gemv(binary, tmp_path, programs, n, k, norm, schedule):
    """stream_gemv.cuh's GEMV (every program its rows, streamed through a ring of bulk copies) against
    float64. Without the wait for a chunk's bytes the run fails (copies nobody waited for), without the wait
    for x's it sums NaN-poisoned shared memory; without the
    barrier after a chunk's units, or the one before the totals are stored, a row adds units not yet
    summed; with one buffer of unit sums instead of two a racing warp overwrites them before they are
    added; without the totals zeroed they add to NaN poison."""
    rng = np.random.default_rng(n + k)
    w = torch.from_numpy(rng.uniform(-1, 1, (n, k)).astype(np.float32) / 8).to(torch.bfloat16)
    x = rng.standard_normal(k).astype(np.float32)
    emulated.write(tmp_path / "x.bin", torch.from_numpy(x))
    emulated.write(tmp_path / "w.bin", w)
    emulated.run(binary, f"dir={tmp_path} mode=wide programs={programs} n={n} k={k} norm={norm} sms=8 "
                         f"schedule={schedule}")
    got = emulated.read(tmp_path / "result.bin", torch.float32, (n,)).numpy()
    x64 = x.astype(np.float64)
    want = w.double().numpy() @ x64 / (np.sqrt((x64 ** 2).mean() + 1e-6) if norm else 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("programs,n,k,major", [
    (3, 64, 1024, 9),    # rows that do not split evenly
    (2, 64, 1000, 9),    # k not a multiple of 256
    (2, 24, 1024, 9),    # 12 rows of 1024: more than a chunk a program, not whole chunks
    (1, 8, 32768, 9),    # k above 16384
    (8, 64, 1024, 8),    # sm_80: no bulk copies
])
def test_wide_gemv_refused(binary, tmp_path, programs, n, k, major):
    """Shapes the kernel does not take, and devices without bulk copies: refused, nothing launches."""
    emulated.write(tmp_path / "x.bin", torch.zeros(k, dtype=torch.float32))
    emulated.write(tmp_path / "w.bin", torch.zeros(n * k, dtype=torch.bfloat16))
    out = emulated.run(binary, f"dir={tmp_path} mode=wide programs={programs} n={n} k={k} major={major}",
                       ok_prefix="REFUSED")
    assert int(out["launches"]) == 0


def test_stream_attention_has_the_layers_the_rows_price():
    """The attention rows' layers (bench_stage_boundary.attention_layers: E2B's full layer, 31B's full and sliding
    layers, from drafter_shapes) each have a kernel in stream_attention.cuh (a `Layer<heads, dim>` the binaries
    select by name), and its page is the cache's block size (the target's default)."""
    import re
    from pathlib import Path

    from gemma4_mtp.target import Gemma4Target

    header = (Path(bench_stage_boundary.__file__).parent / "cuda" / "stream_attention.cuh").read_text()
    kernels = {(int(h), int(d)) for h, d in re.findall(r"using \w+ = Layer<(\d+), (\d+)>;", header)}
    layers = bench_stage_boundary.attention_layers()
    assert [name for name, *_ in layers] == ["E2B full", "E2B full", "31B full", "31B sliding"]
    assert {(heads, dim) for _, heads, dim, _, _ in layers} <= kernels
    assert ("31B full", 8, 512, 4, 8192) in layers and ("31B sliding", 2, 256, 16, 1024) in layers
    const = {m[0]: int(m[1]) for m in re.findall(r"constexpr int (k\w+) = (\d+);", header)}
    assert const["kPage"] == inspect.signature(Gemma4Target.__init__).parameters["block_size"].default


def run_attention(binary, tmp_path, programs, ctx, schedule, launches=1, extra_pages=5, scale=1.0, heads=4, dim=512,
                  kv_heads=1, cluster_order="index", kernel="scalar"):
    """stream_attention.cuh on the emulated GPU against float64: `heads` query heads of `dim` on each of `kv_heads`
    key-value heads over `ctx` keys in pages of 16 ([pages, 16, kv_heads, dim], the heads' rows interleaved)
    scattered through a larger cache (the block table a permutation), on the CUDA cores or (kernel="mma") tensor
    cores."""
    rng = np.random.default_rng(programs + ctx + kv_heads)
    pages = ctx // 16 + extra_pages
    q = (rng.standard_normal((kv_heads, heads, dim)) * scale / np.sqrt(dim)).astype(np.float32)
    k = torch.from_numpy(rng.standard_normal((pages, 16, kv_heads, dim)).astype(np.float32)).to(torch.bfloat16)
    v = torch.from_numpy(rng.standard_normal((pages, 16, kv_heads, dim)).astype(np.float32)).to(torch.bfloat16)
    table = rng.permutation(pages)[:ctx // 16].astype(np.int32)
    for name, t in (("q", torch.from_numpy(q)), ("k", k), ("v", v), ("table", torch.from_numpy(table))):
        emulated.write(tmp_path / f"{name}.bin", t)
    emulated.run(binary, f"dir={tmp_path} mode=attention heads={heads} dim={dim} kv_heads={kv_heads} "
                         f"programs={programs} ctx={ctx} pages={pages} launches={launches} sms=16 schedule={schedule} "
                         f"cluster_order={cluster_order} kernel={kernel}")
    got = emulated.read(tmp_path / "result.bin", torch.float32, (kv_heads, heads, dim)).numpy()
    keys = k.double().numpy()[table].reshape(ctx, kv_heads, dim)
    values = v.double().numpy()[table].reshape(ctx, kv_heads, dim)
    s = np.einsum("ghd,tgd->ght", q.astype(np.float64), keys)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    want = np.einsum("ght,tgd->ghd", p / p.sum(axis=2, keepdims=True), values)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("kernel", ["scalar", "mma"])
@pytest.mark.parametrize("programs,ctx,schedule,launches", [
    (8, 128, "rr", 1),      # one cluster, a page a program: no cross-cluster merge
    (8, 640, "ahead", 1),   # five pages a program: the ring refilled
    (16, 1024, "behind", 2),  # two clusters, 4 pages a program (the ring full), launched twice
    (32, 512, "ahead", 3),  # four clusters, a page a program, launched three times: the counters reset
])
def test_stream_attention(binary, tmp_path, programs, ctx, schedule, launches, kernel):
    """The attention of one query (4 heads, one key-value head) over a paged context on every program, merged
    in clusters and then across them by the last program r to arrive (stream_attention.cuh), against float64.
    Without the wait for a page's keys or values, the running max's rescale of the accumulators, the owners'
    rescale to the common max, the cross-cluster rescale, or the counters' reset, it fails; the emulation
    checks that the merging program reads the workspace only after every cluster wrote it. The tensor-core kernel
    the same, to float64's 2e-5: its query and probabilities split into two bf16 parts each."""
    run_attention(binary, tmp_path, programs, ctx, schedule, launches, kernel=kernel)


@pytest.mark.parametrize("heads,dim,kv_heads,programs,ctx,schedule,launches", [
    (8, 512, 2, 16, 256, "rr", 1),      # 31B's full layer's heads, two key-value heads: a cluster each, 2 pages
    (8, 512, 2, 32, 1280, "ahead", 2),  # two clusters a head, 5 pages a program (the ring refilled), twice
    (8, 512, 4, 32, 128, "behind", 1),  # 31B's four key-value heads, a page a program
    (2, 256, 2, 16, 2048, "ahead", 2),  # 31B's sliding layer's heads: 16 pages a program (a 16-page ring refilled)
    (2, 256, 4, 64, 512, "behind", 3),  # four heads, two clusters each, launched three times
])
@pytest.mark.parametrize("cluster_order,kernel", [("index", "scalar"), ("evens_first", "scalar"),
                                                  ("evens_first", "mma")])
def test_stream_attention_grouped_heads(binary, tmp_path, heads, dim, kv_heads, programs, ctx, schedule, launches,
                                        cluster_order, kernel):
    """31B's layers: 8 query heads of 512 (two groups of warps, 4 keys a warp) or 2 of 256 (one value entry a thread)
    on each of several key-value heads, whose rows interleave in a page (a bulk copy a row): each head's programs
    merge their own clusters and counters. Reading another head's rows, queries, output, workspace or counters
    fails it (the counters once the heads' clusters arrive mixed: evens_first)."""
    run_attention(binary, tmp_path, programs, ctx, schedule, launches, heads=heads, dim=dim, kv_heads=kv_heads,
                  cluster_order=cluster_order, kernel=kernel)


def test_stream_attention_peaked_scores(binary, tmp_path):
    """Scores far apart (a query 40x larger): the pages' and clusters' maxima differ by hundreds, so a partial
    rescaled to the wrong max underflows or overflows."""
    for kernel in ("scalar", "mma"):
        run_attention(binary, tmp_path, 16, 1024, "rr", scale=40.0, kernel=kernel)
        run_attention(binary, tmp_path, 32, 512, "ahead", scale=40.0, heads=8, kv_heads=2, kernel=kernel)


@pytest.mark.parametrize("programs,ctx,kv_heads", [(4, 64, 1), (12, 192, 1), (8, 120, 1), (16, 128, 1), (8, 0, 1),
                                                   (16, 256, 3), (8, 128, 2), (24, 384, 2), (16, 256, 0)])
def test_stream_attention_refused(binary, tmp_path, programs, ctx, kv_heads):
    """Fewer programs than a cluster, programs that are not whole clusters, keys that are not whole pages a
    program, no keys; programs that do not split over the key-value heads, a head with fewer than a cluster's or
    not whole clusters, no key-value head: the launcher refuses, nothing launches."""
    pages, rows = max(ctx // 16, 1), max(kv_heads, 1)
    emulated.write(tmp_path / "q.bin", torch.zeros(rows * 4 * 512, dtype=torch.float32))
    for name in ("k", "v"):
        emulated.write(tmp_path / f"{name}.bin", torch.zeros(pages * 16 * rows * 512, dtype=torch.bfloat16))
    emulated.write(tmp_path / "table.bin", torch.zeros(max(ctx // 16, 0), dtype=torch.int32))
    out = emulated.run(binary, f"dir={tmp_path} mode=attention programs={programs} ctx={ctx} pages={pages} "
                               f"kv_heads={kv_heads} sms=16", ok_prefix="REFUSED")
    assert int(out["launches"]) == 0


def test_stream_attention_unknown_layer(binary, tmp_path):
    """A layer the header has no kernel for (8 heads of 256) fails by name, nothing launches."""
    emulated.write(tmp_path / "q.bin", torch.zeros(8 * 256, dtype=torch.float32))
    for name in ("k", "v"):
        emulated.write(tmp_path / f"{name}.bin", torch.zeros(16 * 256, dtype=torch.bfloat16))
    emulated.write(tmp_path / "table.bin", torch.zeros(1, dtype=torch.int32))
    env = dict(os.environ, ASAN_OPTIONS="detect_stack_use_after_return=0:detect_leaks=0")
    done = subprocess.run([str(binary), f"dir={tmp_path}", "mode=attention", "heads=8", "dim=256", "programs=8",
                           "ctx=16", "pages=1", "sms=16"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0 and "no layer of stream_attention.cuh has 8 heads of 256" in done.stdout


@pytest.mark.parametrize("mode,args,pointer", [
    ("gemv", "chain=64:32:0:0", "w"),
    ("wide", "n=64 k=256 norm=0", "w"),
    ("wide", "n=64 k=256 norm=0", "x"),
    ("attention", "ctx=128 pages=8", "q"),
    ("attention", "ctx=128 pages=8", "k"),
    ("attention", "ctx=128 pages=8", "v"),
])
def test_misaligned_pointers_refused(binary, tmp_path, mode, args, pointer):
    """A weight, key or value pointer that a bulk copy cannot take (or a query the vector loads cannot), 4 bytes
    off 16: the benchmark's launchers refuse it before anything launches, instead of a fault on the device (on the
    CPU the alignment check of the emulation would stop the run)."""
    sizes = {"gemv": {"x": (32, torch.float32), "w": (64 * 32, torch.bfloat16)},
             "wide": {"x": (256, torch.float32), "w": (64 * 256, torch.bfloat16)},
             "attention": {"q": (4 * 512, torch.float32), "k": (8 * 16 * 512, torch.bfloat16),
                           "v": (8 * 16 * 512, torch.bfloat16), "table": (8, torch.int32)}}[mode]
    for name, (count, dtype) in sizes.items():
        emulated.write(tmp_path / f"{name}.bin", torch.zeros(count, dtype=dtype))
    out = emulated.run(binary, f"dir={tmp_path} mode={mode} programs=8 {args} misalign={pointer} sms=16",
                       ok_prefix="REFUSED")
    assert int(out["launches"]) == 0
