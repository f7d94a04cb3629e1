"""Reference dense_lm_head against the fp64 oracle; ties, NaN and signed zeros; validation."""
import pytest
import torch

import gemma4_mtp_kernels as g
from cases_dense_lm_head import check_topk, make, ties_case

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_against_fp64(k, dtype):
    hidden, lm_head = make(3, 48, 300, dtype, torch.Generator().manual_seed(k))
    check_topk(hidden, lm_head, k, "torch", what=f"k={k} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_is_the_fp32_product(dtype):
    hidden, lm_head = make(2, 32, 100, dtype, torch.Generator().manual_seed(3))
    out = g.dense_lm_head(hidden, lm_head, output="dense", backend="torch")
    assert out.dtype == torch.float32 and torch.equal(out, hidden.float() @ lm_head.float().T)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_go_to_the_lower_id(dtype):
    hidden, lm_head, order = ties_case(dtype)
    ids, _ = g.dense_lm_head(hidden, lm_head, k=4, backend="torch")
    assert ids[0].tolist() == order


def test_nan_ranks_first_and_signed_zeros_tie():
    lm_head = torch.zeros(6, 4)
    lm_head[4] = float("nan")
    lm_head[2] = -1.0  # logit -0.0 against the others' +0.0 (hidden is -0.0 in one column)
    hidden = torch.tensor([[0.0, 0.0, 0.0, -0.0]])
    ids, vals = g.dense_lm_head(hidden, lm_head, k=3, backend="torch")
    assert ids[0].tolist() == [4, 0, 1] and torch.isnan(vals[0, 0])


@pytest.mark.parametrize("call,error,match", [
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 9)), ValueError, "lm_head must be of size 8 in dim 1"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8, dtype=torch.bfloat16)), TypeError, "same dtype"),
    (dict(hidden=torch.randn(2, 8, dtype=torch.float64), lm_head=torch.randn(10, 8)), TypeError,
     "hidden must be of dtype"),
    (dict(hidden=torch.randn(8), lm_head=torch.randn(10, 8)), ValueError, "hidden must be a 2-d tensor"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(0, 8)), ValueError, "lm_head must be at least one row"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8), k=11), ValueError, "k must be <= min"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(100, 8), k=17), ValueError, "k must be <= min"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8), k=0), ValueError, "k must be >= 1"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8), k=True), TypeError, "k must be an int"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8), output="sparse"), ValueError, "output must be one of"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(8, 10).T), ValueError, "lm_head must be stride 1"),
    (dict(hidden=torch.randn(2, 8), lm_head=torch.randn(10, 8, device="meta")), ValueError, "same device"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        g.dense_lm_head(**call, backend="torch")
