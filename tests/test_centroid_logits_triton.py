"""Triton centroid_logits against the reference (SPEC §4.3, §6), under the interpreter on CPU.

Discrete outputs (the selected clusters, their order, the argmax token) must equal the reference's
except where the competing exact (fp64) values lie within the fp32 summation-error bound of each
other; the test checks each such exception against that bound.
"""
import pytest
import torch

from cases_centroid_logits import ARGMAX_TIES_TOPK, argmax_ties_case, best_of
from gemma4_mtp_kernels import centroid_logits
from helpers import DRAFTERS

U32 = 2.0 ** -24


def make_inputs(T, Hd, C, CS, dtype, g):
    V = C * CS
    hidden = torch.randn(T, Hd, generator=g).to(dtype)
    centroids = torch.randn(C, Hd, generator=g).to(dtype)
    ordering = torch.randperm(V, generator=g)
    lm_head = torch.randn(V, Hd, generator=g).to(dtype)
    return hidden, centroids, ordering, lm_head


def exact_dot(a, b):
    """fp64 a @ b.T and a bound on the fp32-accumulation error of any summation order."""
    return a.double() @ b.double().T, a.shape[1] * U32 * (a.double().abs() @ b.double().abs().T)


def check_clusters(got_ids, hidden, centroids, ordering, top_k):
    """The clusters behind sparse ids: each rank holds a cluster whose exact score equals the exact
    score of that rank up to the error bound; differences from the reference only at such near ties."""
    C = centroids.shape[0]
    CS = ordering.numel() // C
    cluster_of = torch.empty_like(ordering)
    cluster_of[ordering] = torch.arange(ordering.numel(), device=ordering.device) // CS
    got = cluster_of[got_ids[:, ::CS]]  # [T, top_k]
    assert torch.equal(got_ids, ordering.view(C, CS)[got].reshape(got_ids.shape)), "ids not in ordering order"
    scores = hidden.float() @ centroids.float().T
    ref = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    s64, bound = exact_dot(hidden, centroids)
    for t in range(got.shape[0]):
        assert got[t].unique().numel() == top_k
        for i in torch.nonzero(got[t] != ref[t]).flatten().tolist():
            a, b = int(got[t, i]), int(ref[t, i])
            gap = abs(float(s64[t, a] - s64[t, b]))
            assert gap <= 2 * (float(bound[t, a]) + float(bound[t, b])), f"token {t} rank {i}: {a} vs {b}, gap {gap}"
    return got


def check_logits(ids, logits, hidden, lm_head):
    rows = lm_head[ids].double()  # [T, K, Hd]
    exact = torch.einsum("td,tkd->tk", hidden.double(), rows)
    bound = hidden.shape[1] * U32 * torch.einsum("td,tkd->tk", hidden.double().abs(), rows.abs())
    assert logits.dtype == torch.float32 and not torch.isnan(logits).any()
    assert bool(((logits.double() - exact).abs() <= 2 * bound + 1e-6).all())


def run_all_outputs(T, Hd, C, CS, top_k, dtype, g, inputs=None, dense=True, device="cpu"):
    hidden, centroids, ordering, lm_head = (x.to(device) for x in (inputs or make_inputs(T, Hd, C, CS, dtype, g)))
    args = (hidden, centroids, ordering, lm_head)
    ids, logits = centroid_logits(*args, top_k=top_k, output="sparse", backend="triton")
    assert ids.dtype == torch.int64 and ids.shape == (T, top_k * CS)
    check_clusters(ids, hidden, centroids, ordering, top_k)
    check_logits(ids, logits, hidden, lm_head)

    token, best = centroid_logits(*args, top_k=top_k, output="argmax", backend="triton")
    ref_token, ref_best = centroid_logits(*args, top_k=top_k, output="argmax", backend="torch")
    assert token.dtype == torch.int64 and best.dtype == torch.float32
    # the argmax over the kernel's own candidates, ties to the lowest id
    top = logits.max(1, keepdim=True).values
    own = torch.where(logits == top, ids, torch.iinfo(torch.int64).max).min(1).values
    assert torch.equal(token, own) and torch.equal(best, top.squeeze(1))
    ex_tok = torch.einsum("td,td->t", hidden.double(), lm_head[token].double())
    ex_ref = torch.einsum("td,td->t", hidden.double(), lm_head[ref_token].double())
    tol = Hd * U32 * torch.einsum("td,td->t", hidden.double().abs(), lm_head[token].double().abs()) * 4 + 1e-6
    differs = token != ref_token
    assert bool(((ex_tok - ex_ref).abs()[differs] <= tol[differs]).all()), "argmax differs beyond a near tie"
    # topk: the best k of the kernel's own candidates (its sparse logits), best first, ties to the lower id
    k = min(5, top_k * CS)
    top_ids, top_logits = centroid_logits(*args, top_k=top_k, output="topk", k=k, backend="triton")
    own_ids, own_logits = best_of(ids, logits, k)
    assert torch.equal(top_ids, own_ids) and torch.equal(top_logits, own_logits)

    if not dense:
        return token
    fill = -1234.5
    dense = centroid_logits(*args, top_k=top_k, output="dense", fill_value=fill, backend="triton")
    expect = torch.full((T, C * CS), fill, dtype=torch.float32, device=device).scatter_(1, ids, logits)
    assert torch.equal(dense, expect)
    dense_inf = centroid_logits(*args, top_k=top_k, output="dense", backend="triton")
    assert torch.equal(dense_inf, torch.full_like(dense, float("-inf")).scatter_(1, ids, logits))
    return token


@pytest.mark.parametrize("name", ["E2B", "E4B"])
def test_real_drafter_shapes(name):
    d = DRAFTERS[name]
    g = torch.Generator().manual_seed(0)
    # dense output at this size only adds a [T, 262144] fill; the awkward shapes cover it
    run_all_outputs(1, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], d["top_k"], torch.bfloat16, g,
                    dense=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["E2B", "E4B"])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_real_drafter_shapes_on_gpu(name, T):
    d = DRAFTERS[name]
    g = torch.Generator().manual_seed(0)
    run_all_outputs(T, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], d["top_k"], torch.bfloat16, g,
                    device="cuda")


@pytest.mark.parametrize("T,Hd,C,CS,top_k,dtype", [
    (1, 64, 64, 8, 5, torch.float32),
    (5, 40, 48, 12, 7, torch.bfloat16),   # odd T, Hd not a tile multiple, non-power-of-two cluster size
    (3, 96, 33, 3, 33, torch.float16),    # top_k = every cluster
    (17, 32, 20, 130, 1, torch.bfloat16),  # clusters larger than one row tile, T > 16
])
def test_awkward_shapes(T, Hd, C, CS, top_k, dtype):
    run_all_outputs(T, Hd, C, CS, top_k, dtype, torch.Generator().manual_seed(1))


def test_ties_lower_cluster_and_lowest_vocab_id():
    g = torch.Generator().manual_seed(2)
    T, Hd, C, CS, top_k = 2, 32, 16, 4, 3
    # small integers: every sum is exact in fp32, so ties are exact in any summation order
    hidden, centroids, ordering, lm_head = (x.round() if x.is_floating_point() else x
                                            for x in make_inputs(T, Hd, C, CS, torch.float32, g))
    centroids[9] = centroids[2] = hidden[0] * 10  # the same top score twice: cluster 2 ranks first
    centroids[12] = centroids[5]  # duplicates elsewhere in the order
    cl2 = ordering.view(C, CS)[2]
    lm_head[cl2[3]] = lm_head[cl2[1]] = hidden[0] * 3  # tied best logit: the lower vocabulary id wins
    ids, _ = centroid_logits(hidden, centroids, ordering, lm_head, top_k=top_k, output="sparse", backend="triton")
    got = check_clusters(ids, hidden, centroids, ordering, top_k)
    assert got[0, :2].tolist() == [2, 9]
    token = run_all_outputs(T, Hd, C, CS, top_k, torch.float32, g, inputs=(hidden, centroids, ordering, lm_head))
    assert int(token[0]) == min(int(cl2[1]), int(cl2[3]))
    ids, _ = centroid_logits(hidden, centroids, ordering, lm_head, top_k=top_k, output="topk", k=2, backend="triton")
    assert ids[0].tolist() == sorted([int(cl2[1]), int(cl2[3])])
    ids, logits = centroid_logits(*argmax_ties_case(torch.float32), top_k=2, output="topk", k=4, backend="triton")
    assert (ids[0].tolist(), logits[0].tolist()) == ARGMAX_TIES_TOPK


def test_negative_zero_scores_tie_with_zero():
    T, Hd, C, CS = 1, 16, 8, 2
    hidden = torch.zeros(T, Hd)
    hidden[0, 0] = 1.0
    centroids = torch.zeros(C, Hd)
    centroids[:, 0] = torch.tensor([-1.0, -0.0, 0.0, -2.0, -0.0, 0.0, -3.0, -4.0])
    ordering = torch.arange(C * CS)
    lm_head = torch.randn(C * CS, Hd, generator=torch.Generator().manual_seed(3))
    ids, _ = centroid_logits(hidden, centroids, ordering, lm_head, top_k=4, output="sparse", backend="triton")
    ref, _ = centroid_logits(hidden, centroids, ordering, lm_head, top_k=4, output="sparse", backend="torch")
    assert torch.equal(ids, ref)  # 1, 2, 4, 5 (all 0.0 or -0.0) in index order


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the NaN logits
def test_unchecked_bad_ordering_ids_give_nan_not_a_read():
    """token_ordering is not validated on the GPU; called on the backend directly, as an unchecked
    CUDA call would reach it, out-of-range ids must not be dereferenced (NaN logits, token -1)."""
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
    g = torch.Generator().manual_seed(5)
    T, Hd, C, CS, top_k = 2, 32, 8, 4, 2
    hidden, centroids, ordering, lm_head = make_inputs(T, Hd, C, CS, torch.float32, g)
    ordering[::CS] = 10**9  # the first token of every cluster
    token, logit = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="argmax")
    assert token.tolist() == [-1, -1] and torch.isnan(logit).all()
    ids, logits = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="topk", k=3)
    assert (ids == -1).all() and torch.isnan(logits).all()
    ids, logits = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="sparse")
    assert torch.isnan(logits[:, ::CS]).all() and not torch.isnan(logits[:, 1::CS]).any()
    # backends receive the fill the public op resolved (-inf by default)
    dense = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="dense",
                        fill_value=float("-inf"))
    assert not torch.isnan(dense).any() and int(torch.isfinite(dense).sum()) == T * top_k * (CS - 1)


def test_empty_T():
    g = torch.Generator().manual_seed(4)
    hidden, centroids, ordering, lm_head = make_inputs(0, 16, 8, 2, torch.bfloat16, g)
    token, logit = centroid_logits(hidden, centroids, ordering, lm_head, top_k=2, backend="triton")
    assert token.shape == (0,) and logit.shape == (0,)


def test_plan_cuts_items_for_idle_programs():
    """T = 1 on 132 SMs: the 32 clusters are cut into 4 items of 32 rows (128 programs); T = 64 keeps
    whole clusters (2048 items over 132 programs), and T = 200 gives several tokens per program."""
    from gemma4_mtp_kernels.triton.centroid_logits import plan
    assert plan(1, 32, 128, 2048, 132) == dict(grid=128, chunks=4, rows=32, items=128)
    assert plan(64, 32, 128, 2048, 132) == dict(grid=132, chunks=1, rows=128, items=2048)
    assert plan(1, 2, 4, 8, 132) == dict(grid=2, chunks=1, rows=4, items=2)


def test_tokens_spread_over_programs():
    """More tokens than programs (4 under the interpreter) and tokens split across programs: the
    argmax partials of a token come from several programs; every output row is written."""
    g = torch.Generator().manual_seed(6)
    run_all_outputs(11, 16, 8, 6, 3, torch.float32, g)


@pytest.mark.gpu
def test_graph_replays_reuse_the_counters():
    """The one-launch kernel meets at a grid-wide barrier on cached counters that every launch leaves
    zero: captured and replayed many times in a row, it stays correct (a counter left non-zero would
    hang or release the barrier early)."""
    d = DRAFTERS["E2B"]
    g = torch.Generator().manual_seed(7)
    hidden, centroids, ordering, lm_head = (x.to("cuda") for x in make_inputs(
        1, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], torch.bfloat16, g))
    token, best = centroid_logits(hidden, centroids, ordering, lm_head, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token, best = centroid_logits(hidden, centroids, ordering, lm_head, backend="triton")
    for _ in range(3):
        hidden.copy_(torch.randn(1, d["Hd"], generator=g).to(torch.bfloat16))
        for _ in range(10):
            graph.replay()
        ref_token, ref_best = centroid_logits(hidden, centroids, ordering, lm_head, backend="torch")
        torch.cuda.synchronize()
        tol = d["Hd"] * U32 * float(hidden.double().abs().sum()) * float(lm_head.double().abs().max()) + 1e-6
        assert abs(float(best) - float(ref_best)) <= tol
