"""The CUDA dense_lm_head kernels run on the CPU: their own source (csrc/include/gemma4_mtp/dense_lm_head.cuh,
launcher included) compiled with g++ against tests/cuda_emulator (threads as fibers, warp shuffles),
under AddressSanitizer, against the fp64 oracle of cases_dense_lm_head, like the other backends.

tests/cuda_emulator/dense_head_main.cpp copies the hidden states and the head into allocations of
exactly their extent (a read past a row or a tensor is an AddressSanitizer error), poisons the outputs
(NaN, -1) and the workspace (all-ones keys, which outrank every real key, so a list the rows kernel
never published shows up as a wrong id), launches, checks the launches (the rows kernel, then the merge
for top-k; programmatic dependent launch on sm_90 only) and writes the outputs back. Covered: the
tensor-core kernel (16-bit types, 16-byte rows; one or two passes of 32 tokens for k <= 4, of 16 above)
and the CUDA-core one (fp32, unaligned or strided rows; passes of 8 tokens), bf16 / fp16 / fp32, k 1-16
(lists of 1-16 keys), the 31B head's width on an H100's CTAs and on a few CTAs of many row blocks, ties
to the lower id, NaN ranking first, signed zeros, the dense output. Not covered: timing, the GPU's memory
ordering: test_dense_lm_head_cuda.py verifies those on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import emulated
from cases_dense_lm_head import check_topk, exact_scores, make, ties_case


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "dense_head_main.cpp", "dense_head")


class Emulated:
    """dense_lm_head(hidden, lm_head, k) (top-k) or .dense(hidden, lm_head) run by the emulator; row
    strides and the hidden states' offset travel as they are."""

    def __init__(self, binary, tmp_path, *, sms=8, major=9, schedule="rr"):
        self.binary, self.dir, self.settings = binary, tmp_path, f"sms={sms} major={major} schedule={schedule}"

    def _run(self, hidden, lm_head, k, dense):
        d = self.dir
        emulated.write(d / "hidden.bin", hidden)
        emulated.write(d / "lm_head.bin", lm_head)
        (T, Hd), V = hidden.shape, lm_head.shape[0]
        emulated.run(self.binary, f"dir={d} dtype={emulated.DTYPE_NAMES[hidden.dtype]} T={T} Hd={Hd} V={V} k={k} "
                                  f"dense={int(dense)} hs={hidden.stride(0)} ws={lm_head.stride(0)} "
                                  f"ho={hidden.storage_offset()} {self.settings}")

    def _read(self, name, dtype, shape):
        return emulated.read(self.dir / f"{name}.bin", dtype, shape)

    def __call__(self, hidden, lm_head, k):
        self._run(hidden, lm_head, k, dense=False)
        T = hidden.shape[0]
        return self._read("ids", torch.int64, (T, k)), self._read("logits", torch.float32, (T, k))

    def dense(self, hidden, lm_head):
        self._run(hidden, lm_head, 1, dense=True)
        return self._read("dense", torch.float32, (hidden.shape[0], lm_head.shape[0]))


# (T, k): the tensor-core kernel takes 32 tokens a pass for k <= 4, 16 above: 40 and 19 make two passes
@pytest.mark.parametrize("T,k,schedule", [(1, 1, "rr"), (3, 2, "rr"), (8, 5, "rr"), (9, 16, "rr"), (19, 4, "rr"),
                                          (40, 4, "rr"), (19, 16, "rr"), (9, 16, "behind")])
@pytest.mark.parametrize("sms", [132, 4])
def test_top_k_at_the_31b_width(binary, tmp_path, T, k, schedule, sms):
    """The 26B / 31B head's width (1024) over 3000 rows: on an H100's 132 SMs (188 CTAs of 16 rows: half a
    warp's 32-row block in warp 0), on 4 SMs (8 CTAs of 375 rows: 11-12 blocks over the 8 warps, the last
    one cut); lists of 1 to 16 keys; behind: warps and blocks from the highest index down."""
    hidden, lm_head = make(T, 1024, 3000, torch.bfloat16, torch.Generator().manual_seed(T * 31 + k))
    check_topk(hidden, lm_head, k, "cuda (emulated)", what=f"T={T} k={k}",
               call=Emulated(binary, tmp_path, sms=sms, schedule=schedule))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dtypes_and_unaligned_rows(binary, tmp_path, dtype):
    call = Emulated(binary, tmp_path)
    hidden, lm_head = make(4, 100, 3000, dtype, torch.Generator().manual_seed(1))  # 100: no 16-byte vectors
    check_topk(hidden, lm_head, 3, "cuda (emulated)", what=f"{dtype} Hd=100", call=call)
    hidden, lm_head = make(4, 256, 3000, dtype, torch.Generator().manual_seed(2))
    check_topk(hidden, lm_head, 3, "cuda (emulated)", what=f"{dtype} Hd=256", call=call)


def test_strided_and_shifted_rows(binary, tmp_path):
    """Row strides the op accepts (views into wider storage) and hidden states one element into their
    storage: the element-wise loads, never a read past a row."""
    hidden, lm_head = make(3, 64, 2000, torch.bfloat16, torch.Generator().manual_seed(3))
    wide_head = torch.cat([lm_head, lm_head[:, :8]], dim=1)[:, :64]
    shifted = torch.cat([hidden.new_zeros(1), hidden.reshape(-1)])[1:].view(3, 64)
    check_topk(shifted, wide_head, 4, "cuda (emulated)", what="strided", call=Emulated(binary, tmp_path))


def test_ties_nan_and_signed_zeros(binary, tmp_path):
    call = Emulated(binary, tmp_path)
    hidden, lm_head, order = ties_case(torch.bfloat16)
    ids, _ = call(hidden, lm_head, 4)
    assert ids[0].tolist() == order
    lm_head = torch.zeros(3000, 8)
    lm_head[2500] = float("nan")
    lm_head[2] = -1.0
    hidden = torch.tensor([[0.0] * 7 + [-0.0]])
    ids, vals = call(hidden, lm_head, 3)
    assert ids[0].tolist() == [2500, 0, 1] and torch.isnan(vals[0, 0]) and vals[0, 1:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("T", [1, 9])
def test_dense_output(binary, tmp_path, T):
    hidden, lm_head = make(T, 256, 3000, torch.bfloat16, torch.Generator().manual_seed(T))
    got = Emulated(binary, tmp_path, sms=16).dense(hidden, lm_head)
    exact, bound = exact_scores(hidden, lm_head)
    assert not torch.isnan(got).any()
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_a100_launches_without_programmatic_dependent_launch(binary, tmp_path):
    hidden, lm_head = make(2, 128, 1000, torch.bfloat16, torch.Generator().manual_seed(4))
    check_topk(hidden, lm_head, 2, "cuda (emulated)", what="sm80", call=Emulated(binary, tmp_path, major=8))
