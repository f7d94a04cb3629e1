"""Reference centroid_logits (SPEC §4.3) against an independent fp64 computation."""
import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import reference
from cases_centroid_logits import (ARGMAX_TIES_TOPK, DTYPES, TIED_TOP_K, argmax_ties_case,
                                   check_all_outputs as check_outputs, check_zero_tokens, cluster_ties_case, make)
from helpers import DRAFTERS

E2B = DRAFTERS["E2B"]


def check_all_outputs(args, top_k, what):
    ids, logits, dense = check_outputs(args, top_k, what, backend="torch")
    assert torch.equal(dense.gather(1, ids), logits)  # the reference's dense row is its sparse logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_real_e2b_shape(dtype):
    """The full E2B/E4B head: Hd 256, 2048 centroids of 128 tokens, top 32."""
    args = make(3, E2B["Hd"], E2B["centroids"], E2B["vocab"], dtype)
    check_all_outputs(args, E2B["top_k"], f"E2B {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 5])
def test_real_centroid_count_small_vocab(T, dtype):
    args = make(T, E2B["Hd"], E2B["centroids"], E2B["centroids"] * 4, dtype)
    check_all_outputs(args, E2B["top_k"], f"T={T} {dtype}")


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_small_heads(top_k, index_dtype):
    hidden, centroids, ordering, lm_head = make(7, 16, 8, 40, torch.float32)
    check_all_outputs((hidden, centroids, ordering.to(index_dtype), lm_head), top_k, f"top_k={top_k}")


def test_zero_tokens():
    check_zero_tokens("torch", "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_centroid_ties_go_to_lower_cluster(dtype):
    M = 2
    args, ordering = cluster_ties_case(dtype, M)
    for top_k, want in TIED_TOP_K:
        ids, _ = reference.centroid_logits(*args, top_k=top_k, output="sparse")
        assert torch.equal(ids[0], torch.cat([ordering[c * M:(c + 1) * M] for c in want])), top_k
        dense = g.centroid_logits(*args, top_k=top_k, output="dense", backend="torch")
        assert torch.equal(torch.isfinite(dense[0]).nonzero().flatten().sort().values, ids[0].sort().values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_ties_go_to_lowest_vocab_id(dtype):
    args = argmax_ties_case(dtype)
    ids, _ = g.centroid_logits(*args, top_k=2, output="sparse", backend="torch")
    assert ids[0].tolist().index(3) > ids[0].tolist().index(17)
    assert 19 not in ids[0].tolist()
    token, best = g.centroid_logits(*args, top_k=2, backend="torch")
    assert token.tolist() == [3] and best.tolist() == [6.0]
    ids, logits = g.centroid_logits(*args, top_k=2, output="topk", k=4, backend="torch")
    assert (ids[0].tolist(), logits[0].tolist()) == ARGMAX_TIES_TOPK


def test_fill_value_zero_and_huge():
    args = make(2, 8, 4, 16, torch.float32)
    for fill in (0.0, -3.4e38, 5):
        dense = g.centroid_logits(*args, top_k=1, output="dense", fill_value=fill, backend="torch")
        ids, logits = g.centroid_logits(*args, top_k=1, output="sparse", backend="torch")
        mask = torch.ones_like(dense, dtype=torch.bool).scatter_(1, ids, False)
        assert (dense[mask] == fill).all() and torch.equal(dense.gather(1, ids), logits)


def test_strided_inputs():
    hidden, centroids, ordering, lm_head = make(4, 32, 8, 32, torch.bfloat16)
    wide = lambda t: torch.cat([t, torch.full_like(t, float("nan"))], dim=1)[:, : t.shape[1]]  # noqa: E731
    args = (wide(hidden), wide(centroids), ordering, wide(lm_head))
    assert not args[0].is_contiguous()
    check_all_outputs(args, 3, "strided")


@pytest.mark.parametrize("output,order", [("sparse", "clusters"), ("dense", "clusters"), ("argmax", "rows")])
def test_gpu_implementations_refuse_an_order_they_cannot_take(output, order):
    """The CUDA and Triton implementations' `order` (benchmarks and tests force phase 2's order with it):
    cluster-major serves argmax and topk only; the error names the argument before any launch."""
    import importlib

    from gemma4_mtp_kernels import cuda as cuda_backend

    message = "centroid_logits: order must be 'tokens' or, for argmax and topk, 'clusters', got"
    args = make(2, 16, 8, 32, torch.float32)
    with pytest.raises(ValueError, match=message):
        cuda_backend.centroid_logits(*args, top_k=2, output=output, fill_value=0.0, order=order)
    triton_plan = importlib.import_module("gemma4_mtp_kernels.triton.centroid_logits").plan
    with pytest.raises(ValueError, match=message):
        triton_plan(2, 2, 8, 4, 132, output=output, order=order)
