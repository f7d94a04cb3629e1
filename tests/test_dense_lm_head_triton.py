"""Triton dense_lm_head against the fp64 oracle (ranks exact up to verified near ties) and the
reference, under the interpreter on CPU: many tiles per program (the running top-k merge), several
programs (the merge launch), token tiles, k up to 64, ties, NaN, the dense output."""
import importlib

import pytest
import torch

import gemma4_mtp_kernels as g
from cases_dense_lm_head import check_topk, make, ties_case
from gemma4_mtp_kernels.triton.dense_lm_head import launch_config
from gemma4_mtp_kernels.triton._common import num_sms

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 2, 5])
def test_topk(k, dtype):
    # V = 3000: 24 tiles of 128 rows over 8 programs on the interpreter's 4 "SMs", a ragged last tile
    cfg = launch_config(3, 3000, num_sms(torch.device("cpu")))
    assert cfg["tiles_per_prog"] > 1 and cfg["programs"] > 1
    hidden, lm_head = make(3, 40, 3000, dtype, torch.Generator().manual_seed(k))
    ids, vals = check_topk(hidden, lm_head, k, "triton", what=f"k={k} {dtype}")
    ref_ids, ref_vals = g.dense_lm_head(hidden, lm_head, k=k, backend="torch")
    assert torch.equal(ids, ref_ids)  # random scores: no near ties at this size
    torch.testing.assert_close(vals, ref_vals, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [17, 70])  # 70: two token tiles of 64 rows
def test_token_tiles(T):
    hidden, lm_head = make(T, 24, 700, torch.bfloat16, torch.Generator().manual_seed(T))
    check_topk(hidden, lm_head, 3, "triton", what=f"T={T}")


def test_k_16():
    hidden, lm_head = make(2, 16, 500, torch.bfloat16, torch.Generator().manual_seed(9))
    check_topk(hidden, lm_head, 16, "triton", what="k=16")


class _Poisoned:
    """torch as the launcher sees it, with torch.empty poisoned: floats NaN, integers their largest value,
    so an id never written is out of range and a published list slot no program wrote outranks every
    packed key (it would win the last program's merge)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max)


@pytest.mark.parametrize("k", [1, 3, 16])
def test_the_last_program_merges_many_tiles(monkeypatch, k):
    """The last program reads the programs' published lists in tiles of MERGE_ELEMENTS / BLOCK_T
    candidates: shrunk here so that 8 programs' lists take 8-32 tiles, with the best rows at the end of
    the head (in the last programs' lists, the last tiles read) and more near the start, so that the
    later tiles still admit candidates after earlier ones filled the list; outputs and lists poisoned."""
    head = importlib.import_module("gemma4_mtp_kernels.triton.dense_lm_head")  # the package exports the op
    monkeypatch.setattr(head, "MERGE_ELEMENTS", 64)  # 4 candidates of 16 token columns a tile
    monkeypatch.setattr(head, "torch", _Poisoned())
    gen = torch.Generator().manual_seed(k)
    hidden, lm_head = make(2, 32, 3000, torch.float32, gen)
    lm_head[-20:] *= 4  # the last programs hold the best rows of both tokens
    lm_head[:10] *= 3
    ids, _ = check_topk(hidden, lm_head, k, "triton", what=f"k={k} many merge tiles")
    ref_ids, _ = g.dense_lm_head(hidden, lm_head, k=k, backend="torch")
    assert torch.equal(ids, ref_ids)


def test_k_equals_v():
    hidden, lm_head = make(2, 16, 5, torch.float32, torch.Generator().manual_seed(10))
    ids, _ = check_topk(hidden, lm_head, 5, "triton", what="k=V")
    assert sorted(ids[0].tolist()) == list(range(5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_go_to_the_lower_id(dtype):
    hidden, lm_head, order = ties_case(dtype)
    ids, _ = g.dense_lm_head(hidden, lm_head, k=4, backend="triton")
    assert ids[0].tolist() == order


def test_nan_ranks_first_and_signed_zeros_tie():
    lm_head = torch.zeros(300, 4)
    lm_head[250] = float("nan")
    lm_head[2] = -1.0
    hidden = torch.tensor([[0.0, 0.0, 0.0, -0.0]])
    ids, vals = g.dense_lm_head(hidden, lm_head, k=3, backend="triton")
    assert ids[0].tolist() == [250, 0, 1] and torch.isnan(vals[0, 0]) and vals[0, 1:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_output(dtype):
    hidden, lm_head = make(3, 40, 1000, dtype, torch.Generator().manual_seed(4))
    out = g.dense_lm_head(hidden, lm_head, output="dense", backend="triton")
    torch.testing.assert_close(out, hidden.float() @ lm_head.float().T, rtol=1e-5, atol=1e-4)


def test_empty_batch():
    hidden, lm_head = make(0, 16, 100, torch.bfloat16, torch.Generator().manual_seed(0))
    ids, vals = g.dense_lm_head(hidden, lm_head, k=2, backend="triton")
    assert ids.shape == (0, 2) and vals.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_real_head_on_gpu(T, k):
    """The 26B / 31B head: 262144 x 1024 bf16."""
    hidden, lm_head = make(T, 1024, 262144, torch.bfloat16, torch.Generator().manual_seed(T * k))
    check_topk(hidden, lm_head, k, "triton", device="cuda", what=f"31B T={T} k={k}")
    out = g.dense_lm_head(hidden.cuda(), lm_head.cuda(), output="dense", backend="triton")
    torch.testing.assert_close(out.cpu(), hidden.float() @ lm_head.float().T, rtol=1e-4, atol=1e-3)
