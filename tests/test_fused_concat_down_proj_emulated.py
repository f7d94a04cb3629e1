"""The CUDA fused_concat_down_proj kernels run on the CPU: their own source (csrc/include/gemma4_mtp/
fused_concat_down_proj.cuh, prepare and launcher included) compiled with g++ against tests/cuda_emulator
(threads as fibers, warp shuffles, mma.m16n8k16), under AddressSanitizer, on the cases and the fp64
oracle of cases_fused_concat_down_proj, like the other backends.

tests/cuda_emulator/down_proj_main.cpp copies each call's tensors into allocations of exactly their
extent (a read past a row or a tensor is an AddressSanitizer error), poisons the output and the
partials with NaN, launches, checks that one launch happened (programmatic dependent launch on sm_90,
none on sm_80) and that every counter was left zero, and writes the output back. Covered: the
tensor-core kernel (bf16 / fp16, 16-byte rows) with one to four m16 token tiles, several token tiles,
split and unsplit k, ragged k; the CUDA-core kernel (fp32, strided or shifted rows); int32 / int64 ids;
an out-of-range id (its row NaN, nothing read); every drafter's shape on 132 SMs. Not covered: timing,
memory ordering between CTAs on real hardware (blocks run one after another, so a wrong last-CTA
election would go unseen), the PTX fragment layouts themselves: test_fused_concat_down_proj_cuda.py
verifies those on a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

import emulated
from cases_fused_concat_down_proj import check_backend, make_inputs
from helpers import DRAFTERS


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "down_proj_main.cpp", "down_proj")


class Emulated:
    """A stand-in for the public op (check_backend's `call`): the same arguments, run by the emulator.
    Row strides and the hidden states' offset into their storage travel as they are, so a strided or
    shifted view takes the CUDA-core kernel as it would on a GPU."""

    def __init__(self, binary, tmp_path, *, sms=8, major=9, schedule="rr"):
        self.binary, self.dir = binary, tmp_path
        self.settings = f"sms={sms} major={major} schedule={schedule}"
        self.last = {}

    def __call__(self, token_ids, embed_table, hidden, weight, *, embed_scale, out):
        d = self.dir
        for name, t in dict(token_ids=token_ids, embed_table=embed_table, hidden=hidden, weight=weight).items():
            emulated.write(d / f"{name}.bin", t)
        (T, Hb), (Hd, V) = hidden.shape, (weight.shape[0], embed_table.shape[0])
        cmd = (f"dir={d} dtype={emulated.DTYPE_NAMES[hidden.dtype]} T={T} Hb={Hb} Hd={Hd} V={V} "
               f"ids64={int(token_ids.dtype == torch.int64)} ts={embed_table.stride(0)} hs={hidden.stride(0)} "
               f"ho={hidden.storage_offset()} scale={embed_scale!r} {self.settings}")
        self.last = emulated.run(self.binary, cmd)
        out.copy_(emulated.read(d / "out.bin", out.dtype, out.shape))
        return out


def down_proj(binary, tmp_path, T, Hb, Hd, dtype, *, emu=None, **kw):
    call = Emulated(binary, tmp_path, **(emu or {}))
    check_backend("cuda (emulated)", "cpu", T, Hb, Hd, dtype, g=torch.Generator().manual_seed(T + Hb + Hd), call=call,
                  **kw)
    return call.last


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("T,Hb,Hd", [(1, 64, 16), (7, 200, 72), (17, 96, 40), (3, 37, 5), (2, 8, 8)])
def test_awkward_shapes(binary, tmp_path, T, Hb, Hd, dtype):
    got = down_proj(binary, tmp_path, T, Hb, Hd, dtype)
    aligned = dtype != torch.float32 and Hb % 8 == 0
    assert got["path"] == ("mma" if aligned else "scalar")


@pytest.mark.parametrize("T", [1, 16, 17, 33, 64, 65, 130])
def test_token_tiles(binary, tmp_path, T):
    """One to four m16 tiles per CTA, and several token tiles past 64 tokens (their rows must not mix)."""
    got = down_proj(binary, tmp_path, T, 64, 40, torch.bfloat16)
    assert got["m16"] == str(min(4, math.ceil(T / 16)))
    assert int(got["grid"].split("x")[1]) == math.ceil(T / (16 * int(got["m16"])))


def test_split_k_and_direct_paths(binary, tmp_path):
    """Few row tiles split k (fp32 partials, the tile's last CTA sums them in split order), a ragged
    last k step included; a wide weight on few SMs does not split."""
    got = down_proj(binary, tmp_path, 3, 520, 40, torch.bfloat16, emu=dict(sms=16))
    assert int(got["splits"]) > 1
    got = down_proj(binary, tmp_path, 2, 1000, 24, torch.float16, emu=dict(sms=16))  # 2000 = 62.5 k steps
    assert int(got["splits"]) > 1
    got = down_proj(binary, tmp_path, 5, 64, 256, torch.bfloat16, emu=dict(sms=2))
    assert got["splits"] == "1"


@pytest.mark.parametrize("schedule", ["ahead", "behind"])
def test_warps_out_of_step(binary, tmp_path, schedule):
    """One warp runs as far as it can before the others: the shared tile sums must wait for every warp."""
    down_proj(binary, tmp_path, 19, 520, 40, torch.bfloat16, emu=dict(sms=16, schedule=schedule))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_int_ids_and_strided_rows(binary, tmp_path, index_dtype):
    got = down_proj(binary, tmp_path, 5, 136, 48, torch.bfloat16, index_dtype=index_dtype, strided=True)
    assert got["path"] == "scalar"  # rows at strides 139 / 141 elements: no 16-byte loads
    got = down_proj(binary, tmp_path, 5, 136, 48, torch.bfloat16, index_dtype=index_dtype)
    assert got["path"] == "mma"


def test_a100_launches_without_programmatic_dependent_launch(binary, tmp_path):
    down_proj(binary, tmp_path, 3, 520, 40, torch.bfloat16, emu=dict(sms=16, major=8))
    down_proj(binary, tmp_path, 3, 60, 40, torch.float32, emu=dict(sms=16, major=8))


def test_out_of_range_token_gives_nan_row_not_a_read(binary, tmp_path):
    """The op refuses such ids on the host (values are checkable on CPU); the kernel's own guard is what
    stands when value checks are off on a GPU. Its row must be NaN, the others exact, no read outside
    the table (an AddressSanitizer error)."""
    for dtype, Hb in ((torch.bfloat16, 64), (torch.float32, 64)):
        token_ids, table, hidden, weight = make_inputs(3, Hb, 16, dtype, V=10, g=torch.Generator().manual_seed(1))
        token_ids[1] = 10 ** 6
        out = torch.full((3, 16), float("nan"), dtype=dtype)
        Emulated(binary, tmp_path, sms=16)(token_ids, table, hidden, weight, embed_scale=1.0, out=out)
        assert torch.isnan(out[1]).all()
        assert not torch.isnan(out[[0, 2]]).any()


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafter_shapes_on_132_sms(binary, tmp_path, name):
    """Every drafter's pre-projection at a chain step (T = 1) and a tree level (T = 4), on an H100's
    132 SMs: the split plan the GPU will run."""
    d = DRAFTERS[name]
    for T in (1, 4):
        got = down_proj(binary, tmp_path, T, d["Hb"], d["Hd"], torch.bfloat16, V=300, emu=dict(sms=132))
        assert got["path"] == "mma"
