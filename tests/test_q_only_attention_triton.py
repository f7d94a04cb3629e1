"""Triton q_only_paged_attention against the reference (SPEC §4.2, §6), under the interpreter on CPU."""
import pytest
import torch

from gemma4_mtp_kernels import q_only_paged_attention
from gemma4_mtp_kernels.triton import q_only_attention as tq
from helpers import CACHE_LAYOUTS, DRAFTERS, assert_tolerance, paged_kv, poisoned


def run_case(seq_lens, Qn, Hq, Hkv, D, *, dtype=torch.bfloat16, block_size=16, layout="nhd", window=None,
             softcap=None, scale=1.0, splits=None, device="cpu"):
    k, v, table, lens = paged_kv(seq_lens, block_size, Hkv, D, dtype=dtype, layout=layout, window=window,
                                 device=device)
    B = len(seq_lens)
    q = torch.randn(B, Qn, Hq, D).to(dtype).to(device)
    out = poisoned((B, Qn, Hq, D), dtype, device)
    kw = dict(scale=scale, window=window, softcap=softcap)
    if splits is None:
        got, lse = q_only_paged_attention(q, k, v, table, lens, out=out, return_lse=True, backend="triton", **kw)
        assert got is out
    else:
        got, lse = tq.q_only_paged_attention(q, k, v, table, lens, out=out, return_lse=True, splits=splits, **kw)
    # fp32 reference as the (near) exact result: its error is ~1e-6, far below the bf16 budget
    exact, exact_lse = q_only_paged_attention(q.float(), k.float(), v.float(), table, lens, return_lse=True,
                                              backend="torch", **kw)
    ref = q_only_paged_attention(q, k, v, table, lens, backend="torch", **kw)
    what = f"lens={seq_lens} Q={Qn} Hq={Hq} Hkv={Hkv} D={D} {dtype} {layout} window={window} softcap={softcap}"
    atol = 2e-5 if dtype == torch.float32 else 1e-5
    assert_tolerance(got, exact, ref, atol=atol, what=what)
    # lse is fp32 in every backend: only summation order separates it from the fp32 reference
    empty = torch.isinf(exact_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all()), what
    assert_tolerance(lse[~empty], exact_lse[~empty], exact_lse[~empty], atol=1e-4, what=what + " lse")
    return got, lse


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("layer", ["swa", "full"])
def test_drafter_shapes(name, layer):
    d = DRAFTERS[name]
    Hkv, D = d[f"Hkv_{layer}"], d[f"D_{layer}"]
    # sliding layers: a window shorter than the context (scaled down: the interpreter is slow)
    window = 48 if layer == "swa" else None
    run_case([70, 129], 2, d["Hq"], Hkv, D, window=window)


@pytest.mark.parametrize("D,dtype", [(64, torch.float16), (128, torch.float32), (64, torch.bfloat16)])
def test_small_head_dims(D, dtype):
    run_case([33, 200, 5], 3, 8, 2, D, dtype=dtype)


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_cache_layouts(layout):
    run_case([50, 97], 1, 4, 2, 256, layout=layout, block_size=8)


@pytest.mark.parametrize("window", [1, 17, 64, 65, 1000])
def test_windows(window):
    # contexts shorter, equal and longer than the window; windows starting mid-block
    run_case([64, 100, 10], 2, 4, 1, 128, window=window)


def test_awkward_lengths():
    bs = 16
    run_case([0, 1, bs - 1, bs, bs + 1], 3, 4, 2, 64, block_size=bs)


def test_softcap_and_scale():
    run_case([90, 40], 2, 4, 2, 256, softcap=2.0, scale=0.3)


@pytest.mark.parametrize("splits", [None, 3])
def test_large_q_times_group_spans_row_tiles(splits):
    run_case([45, 160], 9, 16, 2, 64, splits=splits)  # 9 * 8 = 72 rows > 64: two row tiles


class _NaNWorkspaces:
    """torch as the attention launcher sees it, with torch.empty filled with NaN: the split partials and
    lse are poisoned before the kernel writes them. The merges read every split's partial (an empty
    split's too: 0, lse -inf, weight 0), so one the main kernel left unwritten would make NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_split_and_merge_paths(splits, monkeypatch):
    """splits=1 writes out/lse from the main kernel; >1 goes through the fp32 merge (3 and 7: in the
    kernel). 7 splits of a short request leave empty splits (lse -inf, partial 0) for the merge to
    weigh 0."""
    monkeypatch.setattr(tq, "torch", _NaNWorkspaces())
    run_case([150, 30, 0], 2, 8, 2, 256, splits=splits, window=120)


@pytest.mark.parametrize("tiles", ["launcher's", "small"])
def test_merge_over_more_splits_than_one_merge_tile(tiles, monkeypatch):
    """The merge kernel walks the splits TILE_S at a time after finding the largest lse LSE_TILE at a
    time (its tiles do not follow the split count): request 0 fills 47 of 70 splits (192-key chunks),
    request 1 fills 4, request 2 none; the workspaces are NaN before. 70 splits take the launcher's
    many-split tile in one step; with tiles of 16 splits (and 16 lse) five steps of each loop, the
    last one partly empty, and 4 columns a program."""
    splits = 70
    assert tq.MERGE_TILE_S < splits <= tq.MERGE_MANY_TILE_S
    if tiles == "small":
        monkeypatch.setattr(tq, "MERGE_MANY_TILE_S", 16)
        monkeypatch.setattr(tq, "MERGE_MANY_BLOCK_D", 4)
        monkeypatch.setattr(tq, "MERGE_LSE_TILE", 16)
    monkeypatch.setattr(tq, "torch", _NaNWorkspaces())
    run_case([9000, 700, 0], 1, 4, 1, 64, splits=splits)
    run_case([9000, 700, 0], 1, 4, 1, 64, splits=20)  # the few-split tile: one step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block_size", [1, 5, 37])
def test_key_ranges_over_several_table_segments(block_size, device):
    """A program loads the block-table entries of its key range one segment at a time (segment_keys: as many
    whole tiles as TABLE_PAGES pages hold wherever they start): ranges of one, several and a part of a
    segment per split, segments starting at every offset into a page, a window's range starting mid-page."""
    seg = tq.segment_keys(block_size, tq.kernel_config(256, 4)["BLOCK_N"])
    assert (tq.table_pages(32) - 1) * block_size < seg + 32  # a segment is as long as the pages allow
    run_case([3 * seg + 45, seg, seg - 7, 1], 1, 4, 1, 256, block_size=block_size, splits=1, device=device)
    run_case([3 * seg + 45, 2 * seg + 1], 1, 4, 1, 256, block_size=block_size, splits=3, device=device)
    run_case([2 * seg + 11, 40], 1, 4, 1, 256, block_size=block_size, splits=1, window=seg + 3, device=device)


@pytest.mark.parametrize("splits", [None, 1])
def test_fp32_head_dim_512_tiles(splits):
    """fp32 takes its own tiles (16 keys, fewer stages): with the bf16 ones a D 512 fp32 launch needs
    ~200 KB of shared memory and cannot launch on an A100 (tests/test_triton_aot.py checks the fit)."""
    assert tq.kernel_config(512, 64, 4)["BLOCK_N"] == 16
    # 64 rows: two row tiles. scale 1/sqrt(D) keeps fp32 summation-order noise under the fixed atol
    run_case([40, 17], 8, 8, 1, 512, dtype=torch.float32, splits=splits, scale=512**-0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["31B", "E2B"])
def test_fp32_full_layer_launches_on_gpu(name):
    d = DRAFTERS[name]
    run_case([3001, 40], 8, d["Hq"], d["Hkv_full"], d["D_full"], dtype=torch.float32, scale=512**-0.5,
             device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("layer", ["swa", "full"])
@pytest.mark.parametrize("layout", ["nhd", "kv_split"])
def test_drafter_shapes_long_context_on_gpu(name, layer, layout):
    d = DRAFTERS[name]
    window = d["window"] if layer == "swa" else None
    run_case([8192, 3001], 1, d["Hq"], d[f"Hkv_{layer}"], d[f"D_{layer}"], window=window, layout=layout,
             device="cuda")
    run_case([700, 1, 0], 4, d["Hq"], d[f"Hkv_{layer}"], d[f"D_{layer}"], window=window, layout=layout,
             softcap=50.0, device="cuda")


def test_over_wide_block_table():
    """Engines size block tables for the longest request; the extra columns hold garbage and the
    split heuristic's bound is far above the real lengths: every split cuts the real range."""
    k, v, table, lens = paged_kv([200, 75], 16, 2, 128, dtype=torch.bfloat16)
    wide = torch.cat([table, torch.randint(-(10**6), 10**6, (2, 200), dtype=torch.int32)], dim=1)
    q = torch.randn(2, 2, 4, 128).to(torch.bfloat16)
    out = poisoned(q.shape, q.dtype)
    got, lse = q_only_paged_attention(q, k, v, wide, lens, out=out, return_lse=True, backend="triton")
    exact, exact_lse = q_only_paged_attention(q.float(), k.float(), v.float(), table, lens, return_lse=True,
                                              backend="torch")
    ref = q_only_paged_attention(q, k, v, table, lens, backend="torch")
    assert_tolerance(got, exact, ref, what="wide table")
    assert_tolerance(lse, exact_lse, exact_lse, atol=1e-4, what="wide table lse")


def test_heuristic_splits_long_context_at_small_batch():
    cfg = tq.kernel_config(512, 4)
    assert tq.num_splits(1, 1, 1, 8192, cfg["BLOCK_N"], 132) >= 128  # E2B full, B = 1, 8K: ~1 wave
    assert tq.num_splits(64, 8, 1, 256, cfg["BLOCK_N"], 132) == 1


@pytest.mark.parametrize("B,Hkv,rows,D,ctx,splits", [
    (1, 1, 4, 512, 8192, 128),   # E2B full: 128 programs (the keys allow 2 tiles each at most)
    (1, 4, 8, 512, 8192, 33),    # 31B full B = 1: 132 programs, not 264 (two waves at one per SM)
    (8, 4, 8, 512, 8192, 4),     # 31B full B = 8: 128 programs, not 288
    (32, 4, 8, 512, 8192, 1),    # 31B full B = 32: no split, no merge
    (1, 4, 32, 512, 8192, 33),   # 31B full Q = 4: 32 rows, one row tile
    (1, 16, 2, 256, 1024, 16),   # 31B sliding (window 1024): 4 warps, two programs per SM
])
def test_split_count_keeps_one_wave(B, Hkv, rows, D, ctx, splits):
    """The grid of the drafters' benchmarked cases on an H200 (132 SMs) stays within one wave of
    resident programs: 8 warps of them per SM (their registers fill an SM's register file)."""
    cfg = tq.kernel_config(D, rows)
    per_sm = tq.programs_per_sm(cfg)
    row_tiles = -(-rows // cfg["BLOCK_M"])
    got = tq.num_splits(B, Hkv, row_tiles, ctx, cfg["BLOCK_N"], 132, per_sm)
    assert got == splits
    assert B * Hkv * row_tiles * got <= 132 * per_sm or got == 1


@pytest.mark.parametrize("name,layer,B,ctx,in_kernel", [
    ("E2B", "swa", 1, 8192, True),     # 8 splits x 4 rows of 256: 32 KiB of partials, merged by the last program
    ("E2B", "swa", 8, 8192, True),
    ("31B", "swa", 1, 8192, True),     # 8 splits x 2 rows
    ("E2B", "full", 1, 8192, False),   # 128 splits x 4 rows of 512: 1 MiB, the merge kernel spreads it
    ("31B", "full", 1, 8192, False),
    ("E2B", "full", 32, 32768, True),  # 4 splits x 4 rows of 512
])
def test_which_drafter_layers_merge_in_the_attention_kernel(name, layer, B, ctx, in_kernel):
    """At the real shapes on an H200 (132 SMs) the sliding layers' splits are merged inside the
    attention kernel (one launch less per sliding layer of a drafter step), the long full layers'
    at small batch by the merge kernel."""
    d = DRAFTERS[name]
    D, Hkv, rows = d[f"D_{layer}"], d[f"Hkv_{layer}"], d["Hq"] // d[f"Hkv_{layer}"]
    cfg = tq.kernel_config(D, rows)
    max_len = min(ctx, d["window"]) if layer == "swa" else ctx
    splits = tq.num_splits(B, Hkv, 1, max_len, cfg["BLOCK_N"], 132, tq.programs_per_sm(cfg))
    assert splits > 1
    assert tq.merges_in_kernel(rows, splits, D) == in_kernel


@pytest.mark.parametrize("window,splits", [(512, 8), (513, 6), (700, 8), (769, 13)])
def test_a_split_count_just_past_the_in_kernel_merge_is_cut_to_it(window, splits):
    """E2B's sliding layer at B = 1 (4 rows of D 256: the in-kernel merge takes 8 splits): Hugging Face's
    513-key window would make 9 splits of two 32-key tiles, the last holding one key, and a merge launch;
    it takes 6 splits of three tiles instead (at most one tile more a split, 700 keys too), as the CUDA
    backend's plan does (csrc/tests/test_plan.cpp, the same windows); 769 keys would need two more."""
    cfg = tq.kernel_config(256, 4)
    n = tq.num_splits(1, 1, 1, window, cfg["BLOCK_N"], 132, tq.programs_per_sm(cfg), cfg["MIN_TILES"])
    got = tq.fit_in_kernel_merge(n, window, cfg["BLOCK_N"], 4, 256)
    assert got == splits
    assert tq.merges_in_kernel(4, got, 256) == (window <= 700)


def test_hugging_face_window_merges_in_the_attention_kernel(monkeypatch):
    """The launcher at 132 SMs with a 513-key window: one launch (the merge kernel is never reached),
    its 6 splits' results right for a long, an exactly-window-long and a short request."""
    monkeypatch.setattr(tq, "num_sms", lambda device: 132)

    class NoMergeLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the merge kernel was launched")
    monkeypatch.setattr(tq, "_merge_kernel", NoMergeLaunch())
    run_case([600, 513, 40], 1, 4, 1, 256, window=513)


def _counters_zero(device="cpu"):
    from gemma4_mtp_kernels._counters import zeroed_counters
    return not bool(zeroed_counters(torch.device(device), 1, tq.COUNTER_OWNER).any())


@pytest.mark.parametrize("lens,Qn,Hq,Hkv,D,splits,window", [
    ([600, 37, 0], 1, 4, 1, 256, 8, 512),   # E2B sliding at B = 3: 32 pairs, empty splits, an empty request
    ([300, 90], 2, 4, 1, 256, 4, None),     # a tree level (Q = 2): 8 rows x 4 splits
    ([200, 130], 1, 8, 4, 512, 8, None),    # D 512: 2 rows x 8 splits, 4 KV heads (4 groups per request)
    ([500, 64, 1], 3, 6, 3, 64, 9, None),   # D 64: 6 rows (a tile of 8) x 9 splits > 64 pairs -> the merge kernel
    ([500, 64, 1], 3, 6, 3, 64, 8, None),   # 8 x 8 pairs: merged in the kernel
])
def test_merge_in_the_attention_kernel(lens, Qn, Hq, Hkv, D, splits, window):
    """The last program of a row tile to finish merges its tile's splits (small groups) or the merge
    kernel does (large ones): the same results either way, and the in-kernel merge leaves its
    counters zero (so the next launch, or a graph replay, starts from zero)."""
    rows = Qn * Hq // Hkv
    fused = tq.merges_in_kernel(rows, splits, D)
    padded = 1 << (rows - 1).bit_length()
    assert fused == (padded * splits <= min(64, 8192 // D))
    run_case(lens, Qn, Hq, Hkv, D, splits=splits, window=window)
    run_case(lens, Qn, Hq, Hkv, D, splits=splits, window=window)  # counters reused from the first call
    if fused:
        assert _counters_zero()


@pytest.mark.gpu
def test_in_kernel_merges_on_two_streams_at_once():
    """Two streams running E2B-sliding-shaped calls (merged in the attention kernel) at the same time:
    each stream's launches count on their own counters, so every result is right."""
    dev = torch.device("cuda")
    k, v, table, lens = paged_kv([600, 300, 37], 16, 1, 256, dtype=torch.bfloat16, window=512, device=dev)
    qs = [torch.randn(3, 1, 4, 256, device=dev).to(torch.bfloat16) for _ in range(2)]
    cfg = tq.kernel_config(256, 4)
    assert tq.merges_in_kernel(4, tq.num_splits(3, 1, 1, 512, cfg["BLOCK_N"], tq.num_sms(dev),
                                                 tq.programs_per_sm(cfg)), 256)
    refs = [q_only_paged_attention(q, k, v, table, lens, window=512, backend="torch") for q in qs]
    streams = [torch.cuda.Stream() for _ in qs]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(200):  # interleaved launches: the two streams' grids overlap on the device
        for i, (q, s) in enumerate(zip(qs, streams)):
            with torch.cuda.stream(s):
                outs[i].append(q_only_paged_attention(q, k, v, table, lens, window=512, backend="triton"))
    torch.cuda.synchronize()
    for ref, got in zip(refs, outs):
        for o in got:
            torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for s in streams:
        with torch.cuda.stream(s):
            assert _counters_zero("cuda")


@pytest.mark.parametrize("D", [256, 512])
def test_merge_of_many_splits(D):
    """40 splits: the merge reads the partials in two [32, 128-column] steps, D 512 in four column
    blocks (lse written once); most splits of the short requests are empty and skipped."""
    run_case([1300, 20, 0], 1, 4, 1, D, splits=40)


def test_without_lse_and_without_out():
    k, v, table, lens = paged_kv([37, 80], 16, 2, 128, dtype=torch.bfloat16)
    q = torch.randn(2, 1, 4, 128).to(torch.bfloat16)
    got = q_only_paged_attention(q, k, v, table, lens, backend="triton")
    exact = q_only_paged_attention(q.float(), k.float(), v.float(), table, lens, backend="torch")
    ref = q_only_paged_attention(q, k, v, table, lens, backend="torch")
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert_tolerance(got, exact, ref, what="no lse")


@pytest.mark.parametrize("splits", [1, 3, 40])
def test_unchecked_bad_block_id_gives_nan_not_a_read(splits):
    """On the GPU ids are not validated; an id outside [0, num_blocks) must not be dereferenced.
    Called on the backend directly, as an unchecked CUDA call would reach it. 3 splits merge in the
    attention kernel, 40 in the merge kernel: both poison the row."""
    assert tq.merges_in_kernel(2, 3, 64) and not tq.merges_in_kernel(2, 40, 64)
    k, v, table, lens = paged_kv([40, 40], 16, 1, 64, dtype=torch.float32)
    table[1, 1] = 10**6
    q = torch.randn(2, 1, 2, 64)
    out, lse = tq.q_only_paged_attention(q, k, v, table, lens, splits=splits, return_lse=True)
    assert not torch.isnan(out[0]).any()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()


def test_unchecked_seq_len_past_the_table_gives_nan():
    k, v, table, lens = paged_kv([40, 20], 16, 1, 64, dtype=torch.float32)
    lens[1] = table.shape[1] * 16 + 50
    q = torch.randn(2, 1, 2, 64)
    out = tq.q_only_paged_attention(q, k, v, table, lens, splits=2)
    assert not torch.isnan(out[0]).any()
    assert torch.isnan(out[1]).all()
