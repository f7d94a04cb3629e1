"""The CUDA fused glue kernels (rms_norm_linear, rms_norm_gate_up, rms_norm_q_rope) run on the CPU:
their own source (csrc/include/gemma4_mtp/rms_norm_linear.cuh, prepare and launcher included) compiled
with g++ against tests/cuda_emulator (threads as fibers, warp shuffles, mma.m16n8k16), under
AddressSanitizer, on the cases and the fp64 oracle of cases_fused_glue, like the Triton kernels.

Each call writes its tensors to a directory; tests/cuda_emulator/glue_main.cpp copies them into
allocations of exactly their extent (a read past a row or a tensor is an AddressSanitizer error),
poisons the outputs, the partials and the workspace with NaN, launches, checks that one launch
happened (programmatic dependent launch on sm_90), that every counter was left zero, and writes the
outputs back. Covered: both kernels (tensor cores for bf16 / fp16 with 16-byte rows; CUDA cores for
fp32 and strided rows), split and unsplit k, one to four m16 token tiles and several token tiles, the
prologues, the residual_out / normed_out shares of split 0's CTAs, head dims 64-512, tree levels
sharing a position, warps in step or racing ahead. Not covered: timing, memory ordering between
CTAs on real hardware, the PTX fragment layouts themselves (the emulation reads the PTX ISA as the
kernel does): the GPU suite (test_fused_glue_cuda.py) verifies those.
"""
from __future__ import annotations

import pytest
import torch

import emulated
from cases_fused_glue import DTYPES, PROLOGUES, check_glue
from helpers import DRAFTERS

OPS = {"rms_norm_linear": "linear", "rms_norm_gate_up": "gate_up", "rms_norm_q_rope": "q_rope"}


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "glue_main.cpp", "glue")


class Emulated:
    """A stand-in for the public op (check_glue's `call`): the same arguments, run by the emulator."""

    def __init__(self, binary, tmp_path, op, *, sms=8, major=9, schedule="rr", again_T=None):
        self.binary, self.dir, self.op = binary, tmp_path, op
        self.settings = f"sms={sms} major={major} schedule={schedule}" + (f" again_T={again_T}" if again_T else "")
        self.runs = []  # each launch's "OK" line; the whole MLP's check also runs gate_up alone after it

    def __call__(self, x, *args, eps, out=None, norm_weight=None, residual=None, residual_norm_weight=None,
                 layer_scalar=None, residual_out=None, normed_out=None, down_weight=None):
        d = self.dir
        for f in d.glob("*.bin"):
            f.unlink()
        T, H = x.shape
        if out is None:  # gate_up's m, which check_glue asks for beside the whole MLP
            out = torch.empty((T, args[0].shape[0]), dtype=x.dtype)
        tensors = dict(x=x, weight=args[0], norm_weight=norm_weight, residual=residual,
                       residual_norm_weight=residual_norm_weight, layer_scalar=layer_scalar, down_weight=down_weight)
        extra = ""
        if self.op == "rms_norm_gate_up":
            tensors["up_weight"] = args[1]
            if down_weight is not None:
                extra = f"down={down_weight.shape[0]}"
        if self.op == "rms_norm_q_rope":
            qnw, positions, inv_freq = args[1:]
            tensors.update(q_norm_weight=qnw, positions=positions, inv_freq=inv_freq)
            extra = (f"D={qnw.shape[0]} P={positions.shape[0]} "
                     f"pos64={int(positions.dtype == torch.int64)}")
        for name, t in tensors.items():
            if t is not None:
                emulated.write(d / f"{name}.bin", t)
        N = args[0].shape[0]
        flags = (f"res={int(residual is not None)} scale={int(layer_scalar is not None)} "
                 f"norm={int(norm_weight is not None)} rout={int(residual_out is not None)} "
                 f"nout={int(normed_out is not None)} xs={x.stride(0)} xo={x.storage_offset()} "
                 f"rs={residual.stride(0) if residual is not None else H}")
        cmd = (f"dir={d} op={OPS[self.op]} dtype={emulated.DTYPE_NAMES[x.dtype]} T={T} H={H} N={N} eps={eps!r} "
               f"{flags} {extra} {self.settings}")
        self.runs.append(emulated.run(self.binary, cmd))
        out.copy_(emulated.read(d / "out.bin", out.dtype, out.shape))
        for name, buf in (("residual_out", residual_out), ("normed_out", normed_out)):
            if buf is not None:
                buf.copy_(emulated.read(d / f"{name}.bin", buf.dtype, buf.shape))
        return out


GEN = torch.Generator


def glue(binary, tmp_path, op, T, H, N, dtype, kind, *, emu=None, **kw):
    call = Emulated(binary, tmp_path, op, **(emu or {}))
    check_glue(op, "cuda (emulated)", "cpu", T, H, N, dtype, kind, gen=GEN().manual_seed(T + H + N), call=call, **kw)
    return call.runs[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_linear_prologues(binary, tmp_path, kind, dtype):
    got = glue(binary, tmp_path, "rms_norm_linear", 3, 200, 72, dtype, kind)
    assert got["path"] == ("scalar" if dtype == torch.float32 else "mma")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_gate_up_prologues(binary, tmp_path, kind, dtype):
    glue(binary, tmp_path, "rms_norm_gate_up", 3, 136, 40, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_q_rope_prologues(binary, tmp_path, kind, dtype):
    glue(binary, tmp_path, "rms_norm_q_rope", 4, 72, 128, dtype, kind, D=64, per_pos=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_split_k_and_direct_paths(binary, tmp_path, dtype):
    """Few tiles split k (fp32 partials, the last split sums them); many do not."""
    got = glue(binary, tmp_path, "rms_norm_linear", 1, 1024, 32, dtype, "layer", emu=dict(sms=8))
    assert int(got["splits"]) > 1
    got = glue(binary, tmp_path, "rms_norm_linear", 2, 1000, 40, dtype, "residual", emu=dict(sms=8))
    assert int(got["splits"]) > 1  # a ragged last k step
    got = glue(binary, tmp_path, "rms_norm_linear", 5, 128, 256, dtype, "norm", emu=dict(sms=2))
    assert got["splits"] == "1"
    got = glue(binary, tmp_path, "rms_norm_q_rope", 2, 512, 128, dtype, "layer", D=128, emu=dict(sms=8))
    assert int(got["splits"]) > 1  # split reduction, then the head's last tile


def test_stage_holds_at_most_its_steps(binary, tmp_path):
    """A k range longer than the stage holds (62 steps at one m16 tile) is split even on one SM."""
    got = glue(binary, tmp_path, "rms_norm_linear", 1, 2080, 8, torch.bfloat16, "none", emu=dict(sms=1))
    assert got["splits"] == "2" and int(got["steps"]) <= 62


@pytest.mark.parametrize("T,H", [(3, 1000), (8, 2080)])
def test_split_k_without_statistics_reads_its_k_range(binary, tmp_path, T, H):
    """No residual, no norm (o_proj, down_proj): each CTA stages its own k range of every token row, which
    starts past 0 for every split after the first (H 1000: a ragged last step; 2080: 62-step splits on one
    SM), 3 tokens (a group of warps per row, one group idle) or 8 (a warp per row)."""
    for dtype in (torch.bfloat16, torch.float32):  # the tensor-core path, then the CUDA-core one
        got = glue(binary, tmp_path, "rms_norm_linear", T, H, 32, dtype, "none", emu=dict(sms=1))
        assert int(got["splits"]) > 1


def test_eight_tokens_of_long_rows_in_several_passes(binary, tmp_path):
    """8 tokens of 1024-element rows with every statistic (the 31B's glue at B = 8): a pass takes as many
    rows as keep each in one batch of loads, so the prologue makes several passes of several rows (q_rope:
    4 of 2, one vector a thread; gate_up, linear: 2 of 4)."""
    glue(binary, tmp_path, "rms_norm_q_rope", 8, 1024, 256, torch.bfloat16, "layer", D=128, emu=dict(sms=8))
    glue(binary, tmp_path, "rms_norm_gate_up", 8, 1024, 64, torch.bfloat16, "layer", emu=dict(sms=8))
    glue(binary, tmp_path, "rms_norm_linear", 8, 1024, 64, torch.bfloat16, "layer", emu=dict(sms=8))


@pytest.mark.parametrize("T", [17, 40, 70])  # m16 tiles 2, 4 and two token tiles of 4
def test_token_tiles(binary, tmp_path, T):
    got = glue(binary, tmp_path, "rms_norm_linear", T, 96, 48, torch.bfloat16, "layer")
    assert got["m16"] == ("2" if T <= 32 else "4")
    glue(binary, tmp_path, "rms_norm_gate_up", T, 96, 40, torch.bfloat16, "layer")
    glue(binary, tmp_path, "rms_norm_q_rope", T, 64, 64, torch.bfloat16, "layer", D=64,
         per_pos=T // 5 if T % 5 == 0 else 1)
    glue(binary, tmp_path, "rms_norm_linear", T, 96, 48, torch.float32, "layer")


@pytest.mark.parametrize("D,proportional", [(64, False), (128, True), (256, False), (512, True)])
def test_head_dims(binary, tmp_path, D, proportional):
    glue(binary, tmp_path, "rms_norm_q_rope", 2, 64, 3 * D, torch.bfloat16, "norm", D=D, proportional=proportional)


def test_tree_levels_share_a_position(binary, tmp_path):
    glue(binary, tmp_path, "rms_norm_q_rope", 12, 64, 128, torch.bfloat16, "layer", D=64, per_pos=4)


def test_strided_rows_take_the_cuda_core_path(binary, tmp_path):
    """Rows that are not 16-byte aligned (stride H + 3) cannot be read in vectors: the CUDA-core kernel."""
    assert glue(binary, tmp_path, "rms_norm_linear", 5, 96, 40, torch.bfloat16, "layer", strided=True)["path"] == "scalar"
    glue(binary, tmp_path, "rms_norm_gate_up", 5, 96, 40, torch.bfloat16, "residual", strided=True)
    glue(binary, tmp_path, "rms_norm_q_rope", 5, 96, 64, torch.bfloat16, "layer", D=64, strided=True)
    got = glue(binary, tmp_path, "rms_norm_gate_up", 3, 128, 40, torch.bfloat16, "layer", shifted=True)
    assert got["path"] == "scalar"


def test_without_the_optional_outputs(binary, tmp_path):
    glue(binary, tmp_path, "rms_norm_linear", 3, 96, 40, torch.bfloat16, "layer", outs=False)
    glue(binary, tmp_path, "rms_norm_q_rope", 3, 96, 64, torch.bfloat16, "layer", D=64, outs=False)


@pytest.mark.parametrize("schedule", ["ahead", "behind"])
def test_warps_out_of_step(binary, tmp_path, schedule):
    """One warp running as far ahead (or behind) of the others as the barriers allow: shared memory
    (the stage, the reduction buffers, the statistics) reused before every warp has read it shows."""
    emu = dict(schedule=schedule, sms=4)
    glue(binary, tmp_path, "rms_norm_linear", 9, 320, 72, torch.bfloat16, "layer", emu=emu)
    glue(binary, tmp_path, "rms_norm_gate_up", 40, 96, 40, torch.bfloat16, "layer", emu=emu)
    glue(binary, tmp_path, "rms_norm_q_rope", 3, 256, 256, torch.bfloat16, "layer", D=128, emu=emu)
    glue(binary, tmp_path, "rms_norm_linear", 9, 320, 72, torch.float32, "layer", emu=emu)


def test_each_kernel_opts_in_to_its_shared_memory(binary, tmp_path):
    """Two kernels of one signature in one process, the second needing less than 64 KiB but more than
    48: each must opt in for itself (a record per kernel type would skip the second: launch error)."""
    got = glue(binary, tmp_path, "rms_norm_linear", 16, 4096, 8, torch.bfloat16, "layer",
               emu=dict(sms=1, again_T=17))
    assert got["m16"] == "1" and int(got["smem"]) == 64512  # then the T = 17 launch: 17 rows, 64192 bytes


def test_a100_launches_without_programmatic_dependent_launch(binary, tmp_path):
    glue(binary, tmp_path, "rms_norm_linear", 2, 256, 64, torch.bfloat16, "layer", emu=dict(major=8))


@pytest.mark.parametrize("name", ["E2B", "31B"])
def test_drafter_layer_shapes(binary, tmp_path, name):
    """One token through the projections of a real drafter layer (bf16), on an H200's 132 SMs: the
    grids and splits of the real launches. (31B's q_proj / gate-up rows are cut to 2 heads / 256
    rows: the emulator runs every thread of every CTA on one core.)"""
    d = DRAFTERS[name]
    Hd, Hq = d["Hd"], d["Hq"]
    emu = dict(sms=132)
    heads = Hq if name == "E2B" else 2
    glue(binary, tmp_path, "rms_norm_q_rope", 1, Hd, heads * d["D_full"], torch.bfloat16, "layer", D=d["D_full"],
         proportional=True, emu=emu)
    glue(binary, tmp_path, "rms_norm_q_rope", 1, Hd, heads * d["D_swa"], torch.bfloat16, "norm", D=d["D_swa"], emu=emu)
    glue(binary, tmp_path, "rms_norm_linear", 1, Hq * d["D_swa"], Hd, torch.bfloat16, "none", emu=emu)  # o_proj
    if name == "31B":  # the full layer's o_proj: 64 steps of 32 a split in a one-row stage (8 splits, one wave)
        got = glue(binary, tmp_path, "rms_norm_linear", 1, Hq * d["D_full"], Hd, torch.bfloat16, "none", emu=emu)
        assert (got["grid"], int(got["smem"])) == ("32x1x8", 2080 * 2)
    glue(binary, tmp_path, "rms_norm_gate_up", 1, Hd, d["inter"] if name == "E2B" else 256, torch.bfloat16,
         "residual", emu=emu)
    glue(binary, tmp_path, "rms_norm_linear", 1, d["inter"], Hd, torch.bfloat16, "none", emu=emu)  # down_proj
    glue(binary, tmp_path, "rms_norm_linear", 1, Hd, d["Hb"], torch.bfloat16, "layer", emu=emu)  # post_projection


def mlp(binary, tmp_path, T, H, I, N, dtype, kind, *, emu=None, **kw):
    """rms_norm_gate_up with a down_weight [N, I]: the whole MLP in one launch of the gate_up kernel (its
    tree over the tiles' down partials), whatever T (the one-launch rule is the callers': the binding and
    the one-call step)."""
    got = glue(binary, tmp_path, "rms_norm_gate_up", T, H, I, dtype, kind, down=N, emu=emu, **kw)
    G = 1
    tiles = -(-I // 16)
    while G * G < tiles:
        G *= 2
    assert int(got["groups"]) == -(-tiles // G)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_mlp_prologues(binary, tmp_path, kind, dtype):
    """3 tiles of m columns (the last 8 wide: element loads of down_weight) in 2 groups of 2 (the last of
    one tile)."""
    mlp(binary, tmp_path, 3, 136, 40, 72, dtype, kind)


def test_mlp_e2b_layer(binary, tmp_path):
    """E2B's MLP at one token on an H200's 132 SMs: 128 tiles in 8 groups of 16, 256 rows of down_proj."""
    got = mlp(binary, tmp_path, 1, 256, 2048, 256, torch.bfloat16, "residual", emu=dict(sms=132))
    assert got["path"] == "mma" and got["groups"] == "8" and got["splits"] == "1"


def test_mlp_down_rows_in_passes_and_unaligned_columns(binary, tmp_path):
    """300 rows of down_weight (two passes of 256 threads) of 36 columns (72-byte rows: every other row's
    16 columns start off a 16-byte boundary, and the last tile has 4), at 5 tokens; 30 rows: the tree's
    sums one float at a time (rows of the partials not 16-byte aligned), where multiples of 4 take float4."""
    mlp(binary, tmp_path, 5, 64, 36, 300, torch.bfloat16, "layer")
    mlp(binary, tmp_path, 5, 64, 36, 300, torch.float32, "layer")
    mlp(binary, tmp_path, 5, 64, 36, 30, torch.bfloat16, "layer")


@pytest.mark.parametrize("T", [40, 70])  # 4 m16 tiles, then two token tiles (a tree each)
def test_mlp_token_tiles(binary, tmp_path, T):
    mlp(binary, tmp_path, T, 64, 48, 40, torch.bfloat16, "layer")


def test_mlp_after_split_k(binary, tmp_path):
    """Few tiles on 8 SMs split gate_up's k: the tile's last split runs the down partial."""
    got = mlp(binary, tmp_path, 1, 1024, 32, 48, torch.bfloat16, "layer", emu=dict(sms=8))
    assert int(got["splits"]) > 1


def test_mlp_strided_rows_take_the_cuda_core_path(binary, tmp_path):
    assert mlp(binary, tmp_path, 3, 96, 40, 24, torch.bfloat16, "residual", strided=True)["path"] == "scalar"


@pytest.mark.parametrize("schedule", ["ahead", "behind"])
def test_mlp_warps_out_of_step(binary, tmp_path, schedule):
    mlp(binary, tmp_path, 2, 96, 80, 300, torch.bfloat16, "layer", emu=dict(schedule=schedule, sms=4))
