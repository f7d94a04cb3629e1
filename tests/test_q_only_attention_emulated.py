"""The CUDA q_only_paged_attention kernels run on the CPU: their own source (csrc/include/gemma4_mtp/
q_only_attention.cuh, launcher included) compiled with g++ against tests/cuda_emulator/, an emulation of
the CUDA features they use (threads as fibers, warp shuffles, ldmatrix, mma.m16n8k16, cp.async groups,
mbarriers and bulk copies), under AddressSanitizer, checked against a double-precision reference.

Both code paths: the sm_90 one (one cp.async.bulk per K/V row on the stage's mbarrier) and the sm_80
one (16-byte cp.async), with copies landing as late as the waits allow (a missing wait reads stale
shared memory) or at issue, warps in step or one racing ahead of the others; devices with the shared
memory of an H100 (5-6 stages), an A100 (3-4) and the least the kernel accepts (3). Outputs, lse and the workspace start as NaN; unused cache slots hold
NaN and unread block-table columns garbage ids, so a read of either shows up (an out-of-range id as an
AddressSanitizer error).

The splits' merge takes one of two paths, and each case asserts which (the driver reports it from the
launches it saw): the last CTA of a merge group merges inside the attention kernel when the group's
partials are at most 32 KiB (plan.h attention_merges_in_kernel; its counters must end zero), else the
merge kernel runs. With blocks run from the highest index down, the merging CTA is not the last by index.

This proves the indexing, the pipeline's waits and the split / merge logic; not the timing, not the
hardware's memory ordering between warps, and not the PTX fragment layouts themselves (the emulation
encodes the same reading of the PTX ISA as the kernel): the GPU suite (test_q_only_attention_cuda.py)
is what verifies the kernel.
"""
from __future__ import annotations

import pytest

import emulated
from helpers import DRAFTERS

H100 = "smem=232448 major=9"  # opt-in shared memory per block of an H100 / H200: 5-6 stages
A100 = "smem=166912 major=8"  # an A100: 3-4 stages, no programmatic dependent launch
TIGHT = "smem=122000 major=9"  # room for 3 stages only at 16 rows, any D (the least the kernel runs with)


@pytest.fixture(scope="module")
def binaries(request):
    """Emulator builds of the sm_90 (bulk copy) and sm_80 (cp.async) paths."""
    return {path: emulated.build(request, "attention_main.cpp", f"attention_{path}", (f"-DEMU_BULK={bulk}",))
            for path, bulk in (("sm90", 1), ("sm80", 0))}


def emulate(binaries, path: str, case: str) -> dict:
    return emulated.run(binaries[path], case)


PATHS = [("sm90", H100), ("sm80", A100)]


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("layer", ["swa", "full"])
def test_drafter_shapes(binaries, path, device, name, layer):
    """Every drafter's sliding and full layer, a chain step (Q = 1) and a 4-branch tree level (Q = 4:
    32 rows per KV head at 31B, still one CTA), 16 SMs so that the short contexts take several splits."""
    d = DRAFTERS[name]
    Hkv, D = d[f"Hkv_{layer}"], d[f"D_{layer}"]
    window = f"window={d['window'] // 8}" if layer == "swa" else ""  # scaled down like the contexts
    for Q in (1, 4):
        emulate(binaries, path, f"dtype=bf16 D={D} Hq={d['Hq']} Hkv={Hkv} Q={Q} lens=300,37,0 {window} sms=16 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("D", [64, 128, 256, 512])
def test_head_dims_and_dtypes(binaries, path, device, dtype, D):
    emulate(binaries, path, f"dtype={dtype} D={D} Hq=8 Hkv=2 Q=3 lens=33,200,5 sms=8 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("layout", ["nhd", "hnd", "kvsplit", "padded"])
@pytest.mark.parametrize("D", [256, 512])
def test_cache_layouts(binaries, path, device, layout, D):
    """Engine layouts as strided views (vLLM's [nb, 2, ...], HND, rows padded by 16 bytes), block size 8."""
    emulate(binaries, path, f"dtype=bf16 D={D} Hq=4 Hkv=2 Q=1 lens=50,97,300 layout={layout} bs=8 sms=8 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("window", [1, 15, 16, 17, 64, 65, 512])
def test_windows(binaries, path, device, window):
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=2 lens=64,100,10,700 window={window} sms=8 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("bs", [1, 16, 17, 64])
def test_block_sizes_and_awkward_lengths(binaries, path, device, bs):
    lens = ",".join(str(n) for n in (0, 1, max(bs - 1, 0), bs, bs + 1, 3 * bs + 5))
    emulate(binaries, path, f"dtype=bf16 D=128 Hq=4 Hkv=2 Q=3 lens={lens} bs={bs} sms=8 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
def test_softcap_and_scale(binaries, path, device):
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=2 Q=2 lens=90,40,1200 softcap=2.0 scale=0.3 sms=8 {device}")
    emulate(binaries, path, f"dtype=f16 D=512 Hq=8 Hkv=1 Q=1 lens=300 softcap=30.0 scale=1.0 sms=8 {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
def test_many_splits_and_the_merge(binaries, path, device):
    """E2B's full layer at B = 1 on 64 SMs: ~64 splits merged; then the same request under a block table
    500 columns too wide (the plan's bound): most splits empty, their partials skipped."""
    got = emulate(binaries, path, f"dtype=bf16 D=512 Hq=4 Hkv=1 Q=1 lens=5000 sms=64 {device}")
    assert int(got["splits"]) >= 60 and got["launches"] == "2" and got["merge"] == "merge_kernel"
    got = emulate(binaries, path, f"dtype=bf16 D=512 Hq=4 Hkv=1 Q=1 lens=700 wide=500 sms=64 {device}")
    assert int(got["splits"]) >= 60 and got["merge"] == "merge_kernel"


# In-kernel merge cases: (arguments, splits, merge groups). The partials of a group are rows x splits x
# D x 4 bytes, at most 32 KiB.
IN_KERNEL = {
    # E2B sliding layer at B = 1: 4 rows x 8 splits x D 256 = 32 KiB, the bound itself
    "e2b_sliding": ("dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000 window=512 sms=132", 8, 1),
    # Hugging Face's sliding window (513 keys): 6 splits of three 32-key stages, not 9 of two and a merge launch
    "hf_window": ("dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000,513,300 window=513 sms=132", 6, 3),
    # 31B sliding-like: 2 rows per KV head, four KV heads (groups), two threads per float4 column
    "31b_sliding": ("dtype=bf16 D=256 Hq=8 Hkv=4 Q=1 lens=2000 window=512 sms=32", 8, 4),
    # Q = 2 tree level: a group's rows are two queries x two heads (not adjacent rows of out)
    "q2_grouped": ("dtype=bf16 D=128 Hq=4 Hkv=2 Q=2 lens=900,300 window=1024 sms=64", 8, 4),
    # Q = 4 x 4 heads per KV head: 16 rows x 8 splits x D 64 = 32 KiB, a float4 column per thread
    "q4_rows16": ("dtype=f16 D=64 Hq=8 Hkv=2 Q=4 lens=3000 window=2048 sms=16", 8, 2),
    # 32 rows (two m-tiles), 2 splits: more float4 columns than threads
    "rows32": ("dtype=bf16 D=128 Hq=32 Hkv=1 Q=1 lens=300 sms=2", 2, 1),
    # short and empty requests: their trailing splits (all of them for lens 0) are empty
    "empty_splits": ("dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000,10,0 window=512 sms=132", 8, 3),
    # an out-of-range block id in request 1: its rows NaN, the others exact
    "bad_block": ("dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000,700,40 window=512 bad_block=1 sms=132", 8, 3),
    "bad_len": ("dtype=f16 D=256 Hq=4 Hkv=1 Q=1 lens=300,2000 window=512 bad_len=0 sms=132", 8, 2),
    # fp32 (CUDA-core kernel, 128 threads): E2B-sliding-like with short and empty requests, and 8 rows
    "f32_sliding": ("dtype=f32 D=256 Hq=4 Hkv=1 Q=1 lens=2000,10,0 window=256 sms=8", 8, 3),
    "f32_rows8": ("dtype=f32 D=64 Hq=4 Hkv=1 Q=2 lens=700,5 window=512 sms=8", 11, 2),
}


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("schedule", ["rr", "ahead", "behind"])
@pytest.mark.parametrize("name", list(IN_KERNEL))
def test_in_kernel_merge(binaries, path, device, schedule, name):
    """Small merge groups: one launch, the group's last CTA merges (lse returned), counters left zero;
    warps in step, one warp ahead, and blocks from the highest index down."""
    case, splits, groups = IN_KERNEL[name]
    got = emulate(binaries, path, f"{case} schedule={schedule} {device}")
    assert (got["merge"], got["launches"]) == ("in_kernel", "1")
    assert int(got["splits"]) == splits and int(got["counters"]) == groups == int(got["grid"].split("x")[0])


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
def test_merge_path_at_the_bound(binaries, path, device):
    """32 KiB of partials merge in the kernel, 64 KiB (the same layer with twice the rows) in the merge
    kernel; a group past the bound because of its splits (E2B's full layer) too."""
    got = emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000 window=512 sms=132 {device}")
    assert (got["splits"], got["merge"]) == ("8", "in_kernel")
    got = emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=2 lens=2000 window=512 sms=132 {device}")
    assert (got["splits"], got["merge"], got["launches"]) == ("8", "merge_kernel", "2")
    got = emulate(binaries, path, f"dtype=bf16 D=512 Hq=4 Hkv=1 Q=1 lens=1000 sms=16 {device}")
    assert (got["splits"], got["merge"]) == ("16", "merge_kernel")


@pytest.mark.parametrize("path", ["sm90", "sm80"])
def test_in_kernel_merge_without_counters_is_refused(binaries, path):
    """A caller that passes no counters where the kernel would merge gets cudaErrorInvalidValue and no
    launch (as for a missing workspace)."""
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=2000 window=512 sms=132 counters=none "
                            f"expect=invalid {H100}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
def test_rows_beyond_one_tile(binaries, path, device):
    """72 rows of one KV head (Q 9 x group 8): three CTAs of 32 rows."""
    got = emulate(binaries, path, f"dtype=bf16 D=64 Hq=16 Hkv=2 Q=9 lens=45,300 sms=4 {device}")
    assert got["grid"].startswith("12x")


@pytest.mark.parametrize("path", ["sm90", "sm80"])
@pytest.mark.parametrize("device", [H100, A100, TIGHT], ids=["h100", "a100", "three_stages"])
@pytest.mark.parametrize("timing", ["copies=late schedule=rr", "copies=early schedule=ahead",
                                    "copies=late schedule=behind"], ids=["late", "early_warp_ahead", "warp_behind"])
def test_pipeline_depths_and_timing(binaries, path, device, timing):
    """Any stage count the shared memory allows; copies landing at issue (a stage refilled while it is
    read shows) or only at the wait (a read before the wait shows); warps in step, or one warp running
    as far ahead of the others as the barriers let it (shared memory rewritten before the others have
    read it shows)."""
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=8 Hkv=2 Q=1 lens=1000,333 {timing} sms=6 {device}")
    emulate(binaries, path, f"dtype=bf16 D=512 Hq=8 Hkv=1 Q=2 lens=501 {timing} sms=8 {device}")
    emulate(binaries, path, f"dtype=bf16 D=128 Hq=16 Hkv=1 Q=1 lens=700 {timing} sms=4 {device}")


@pytest.mark.parametrize("path", ["sm90", "sm80"])
def test_device_without_room_for_three_stages_is_refused(binaries, path):
    """32 rows at D 512 need ~132 KB for three stages: on a device that cannot opt in to that much the
    launcher returns an error (the op raises it) and launches nothing."""
    emulate(binaries, path, "dtype=bf16 D=512 Hq=32 Hkv=4 Q=4 lens=100 sms=8 smem=122000 major=9 expect=refused")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
@pytest.mark.parametrize("sms", [2, 32])
def test_bad_block_id_and_bad_seq_len_give_nan(binaries, path, device, sms):
    """Unchecked GPU calls: an out-of-range block id among the blocks a request reads, or a seq_len past
    the table, make that request's output and lse NaN and nothing out of bounds is read."""
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=40,700,500 bad_block=1 sms={sms} {device}")
    emulate(binaries, path, f"dtype=f16 D=128 Hq=4 Hkv=1 Q=1 lens=40,300 bad_len=1 sms={sms} {device}")


@pytest.mark.parametrize("path,device", PATHS, ids=["sm90", "sm80"])
def test_empty_requests_and_unaligned_out(binaries, path, device):
    emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=0,0 sms=8 {device}")
    # one split (direct stores), a few (the in-kernel merge's stores) and many (the merge kernel's)
    for sms, merge in ((2, "none"), (8, "in_kernel"), (64, "merge_kernel")):
        got = emulate(binaries, path, f"dtype=bf16 D=256 Hq=4 Hkv=1 Q=1 lens=37,900 out_offset=1 sms={sms} {device}")
        assert got["merge"] == merge
