"""Triton centroid_logits against the reference (SPEC §4.3, §6), under the interpreter on CPU.

Discrete outputs (the selected clusters, their order, the argmax token) must equal the reference's
except where the competing exact (fp64) values lie within the fp32 summation-error bound of each
other; the test checks each such exception against that bound.
"""
import pytest
import torch

from cases_centroid_logits import ARGMAX_TIES_TOPK, argmax_ties_case, best_of, check_nan_cluster_scores
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


def phase2_order(T, C, CS, top_k, output, order, device):
    """The phase-2 order the Triton launcher takes for this call (plan(): forced or chosen)."""
    from gemma4_mtp_kernels.triton._common import num_sms
    from gemma4_mtp_kernels.triton.centroid_logits import plan
    return plan(T, top_k, CS, C, num_sms(torch.device(device)), output, order)["order"]


def run_all_outputs(T, Hd, C, CS, top_k, dtype, g, inputs=None, dense=True, device="cpu", order=None):
    """Every output against the kernel's own sparse candidates. `order`: argmax and topk forced to that
    phase-2 order (the Triton implementation called directly; None: the public op, plan()'s choice).
    Token-major computes each logit as the sparse output does (exact equality); cluster-major on the
    tensor cores (each logit within the fp32 accumulation bound, ranks equal up to near ties)."""
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
    hidden, centroids, ordering, lm_head = (x.to(device) for x in (inputs or make_inputs(T, Hd, C, CS, dtype, g)))
    args = (hidden, centroids, ordering, lm_head)
    ids, logits = centroid_logits(*args, top_k=top_k, output="sparse", backend="triton")
    assert ids.dtype == torch.int64 and ids.shape == (T, top_k * CS)
    check_clusters(ids, hidden, centroids, ordering, top_k)
    check_logits(ids, logits, hidden, lm_head)

    def ranked(output, **kw):
        if order is None:
            return centroid_logits(*args, top_k=top_k, output=output, backend="triton", **kw)
        return triton_impl(*args, top_k=top_k, output=output, order=order, **kw)

    token, best = ranked("argmax")
    ref_token, ref_best = centroid_logits(*args, top_k=top_k, output="argmax", backend="torch")
    assert token.dtype == torch.int64 and best.dtype == torch.float32
    exact = lambda tok: torch.einsum("td,t...d->t...", hidden.double(), lm_head[tok].double())  # noqa: E731
    bound = lambda tok: Hd * U32 * torch.einsum("td,t...d->t...", hidden.double().abs(),  # noqa: E731
                                                 lm_head[tok].double().abs()) * 2 + 1e-6
    # the argmax over the kernel's own candidates, ties to the lowest id
    top = logits.max(1, keepdim=True).values
    own = torch.where(logits == top, ids, torch.iinfo(torch.int64).max).min(1).values
    k = min(5, top_k * CS)
    own_ids, own_logits = best_of(ids, logits, k)
    top_ids, top_logits = ranked("topk", k=k)
    if phase2_order(T, C, CS, top_k, "argmax", order, device) == "tokens":
        assert torch.equal(token, own) and torch.equal(best, top.squeeze(1))
        assert torch.equal(top_ids, own_ids) and torch.equal(top_logits, own_logits)
    else:
        assert bool((ids == token[:, None]).any(1).all()), "argmax not among the token's candidates"
        assert bool(((exact(own) - exact(token)).abs() <= 2 * bound(own)).all()), "argmax beyond a near tie"
        assert bool(((best.double() - exact(token)).abs() <= bound(token)).all())
        assert bool((ids[:, :, None] == top_ids[:, None, :]).any(1).all()), "topk id not among the candidates"
        assert all(len(set(row)) == k for row in top_ids.tolist()), "topk id twice"
        assert bool(((exact(own_ids) - exact(top_ids)).abs() <= 2 * bound(own_ids)).all()), "topk beyond near ties"
        assert bool(((top_logits.double() - exact(top_ids)).abs() <= bound(top_ids)).all())
    ex_tok = torch.einsum("td,td->t", hidden.double(), lm_head[token].double())
    ex_ref = torch.einsum("td,td->t", hidden.double(), lm_head[ref_token].double())
    tol = Hd * U32 * torch.einsum("td,td->t", hidden.double().abs(), lm_head[token].double().abs()) * 4 + 1e-6
    differs = token != ref_token
    assert bool(((ex_tok - ex_ref).abs()[differs] <= tol[differs]).all()), "argmax differs beyond a near tie"

    if not dense:
        return token
    fill = -1234.5
    dense = centroid_logits(*args, top_k=top_k, output="dense", fill_value=fill, backend="triton")
    expect = torch.full((T, C * CS), fill, dtype=torch.float32, device=device).scatter_(1, ids, logits)
    assert torch.equal(dense, expect)
    dense_inf = centroid_logits(*args, top_k=top_k, output="dense", backend="triton")
    assert torch.equal(dense_inf, torch.full_like(dense, float("-inf")).scatter_(1, ids, logits))
    return token


@pytest.mark.parametrize("order", ["tokens", "clusters"])
@pytest.mark.parametrize("name", ["E2B", "E4B"])
def test_real_drafter_shapes(name, order):
    d = DRAFTERS[name]
    g = torch.Generator().manual_seed(0)
    # dense output at this size only adds a [T, 262144] fill; the awkward shapes cover it
    run_all_outputs(1, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], d["top_k"], torch.bfloat16, g,
                    dense=False, order=order)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["tokens", "clusters"])
@pytest.mark.parametrize("name", ["E2B", "E4B"])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_real_drafter_shapes_on_gpu(name, T, order):
    """On 132 SMs plan() takes tokens at T = 1 and clusters at T = 5 and 64: each forced the other way too."""
    d = DRAFTERS[name]
    g = torch.Generator().manual_seed(0)
    run_all_outputs(T, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], d["top_k"], torch.bfloat16, g,
                    device="cuda", order=order)


@pytest.mark.parametrize("T,Hd,C,CS,top_k,dtype", [
    (1, 64, 64, 8, 5, torch.float32),
    (5, 40, 48, 12, 7, torch.bfloat16),   # odd T, Hd not a tile multiple, non-power-of-two cluster size
    (3, 96, 33, 3, 33, torch.float16),    # top_k = every cluster
    (17, 32, 20, 130, 1, torch.bfloat16),  # clusters larger than one row tile, T > 16
    (70, 16, 12, 5, 2, torch.float32),     # more tokens than a cluster-major token block (64)
    (4, 300, 16, 8, 3, torch.bfloat16),    # hidden rows wider than a cluster-major tile (256)
])
@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_awkward_shapes(T, Hd, C, CS, top_k, dtype, order):
    run_all_outputs(T, Hd, C, CS, top_k, dtype, torch.Generator().manual_seed(1), order=order)


@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_ties_lower_cluster_and_lowest_vocab_id(order):
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
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
    token = run_all_outputs(T, Hd, C, CS, top_k, torch.float32, g, inputs=(hidden, centroids, ordering, lm_head),
                            order=order)
    assert int(token[0]) == min(int(cl2[1]), int(cl2[3]))
    ids, _ = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="topk", k=2, order=order)
    assert ids[0].tolist() == sorted([int(cl2[1]), int(cl2[3])])
    ids, logits = triton_impl(*argmax_ties_case(torch.float32), top_k=2, output="topk", k=4, order=order)
    assert (ids[0].tolist(), logits[0].tolist()) == ARGMAX_TIES_TOPK
    token, _ = triton_impl(*argmax_ties_case(torch.float32), top_k=2, output="argmax", order=order)
    assert token.tolist() == ARGMAX_TIES_TOPK[0][:1]


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


@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_nan_cluster_scores_rank_first_whatever_their_sign(order):
    """check_nan_cluster_scores with argmax and topk in both phase-2 orders (sparse is token-major only)."""
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
    check_nan_cluster_scores(lambda *args, output, **kw: triton_impl(
        *args, output=output, order=None if output == "sparse" else order, **kw))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over the NaN logits
@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_unchecked_bad_ordering_ids_give_nan_not_a_read(order):
    """token_ordering is not validated on the GPU; called on the backend directly, as an unchecked
    CUDA call would reach it, out-of-range ids must not be dereferenced (NaN logits, token -1)."""
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
    g = torch.Generator().manual_seed(5)
    T, Hd, C, CS, top_k = 2, 32, 8, 4, 2
    hidden, centroids, ordering, lm_head = make_inputs(T, Hd, C, CS, torch.float32, g)
    ordering[::CS] = 10**9  # the first token of every cluster
    token, logit = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="argmax", order=order)
    assert token.tolist() == [-1, -1] and torch.isnan(logit).all()
    ids, logits = triton_impl(hidden, centroids, ordering, lm_head, top_k=top_k, output="topk", k=3, order=order)
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
    whole clusters (2048 items over 132 programs) token-major. Argmax and topk go cluster-major once the
    T * top_k items exceed the SMs (T = 5 at E2B), on every SM; sparse and dense never."""
    from gemma4_mtp_kernels.triton.centroid_logits import plan
    assert plan(1, 32, 128, 2048, 132) == dict(grid=128, chunks=4, rows=32, items=128, order="tokens")
    assert plan(64, 32, 128, 2048, 132, "sparse") == dict(grid=132, chunks=1, rows=128, items=2048, order="tokens")
    assert plan(1, 2, 4, 8, 132) == dict(grid=2, chunks=1, rows=4, items=2, order="tokens")
    assert plan(4, 32, 128, 2048, 132, "topk")["order"] == "tokens"
    assert plan(5, 32, 128, 2048, 132, "topk") == dict(grid=132, chunks=1, rows=128, items=160, order="clusters")
    assert plan(64, 32, 128, 2048, 132, "argmax")["order"] == "clusters"
    assert plan(64, 32, 128, 2048, 132, "dense")["order"] == "tokens"
    assert plan(1, 32, 128, 2048, 132, "argmax", "clusters") == dict(grid=128, chunks=1, rows=128, items=32,
                                                                     order="clusters")
    with pytest.raises(ValueError, match="order"):
        plan(64, 32, 128, 2048, 132, "sparse", "clusters")


def test_cluster_major_deals_every_selected_cluster_once():
    """Many tokens sharing a few clusters (the flags dedupe them) and tokens whose clusters are all
    distinct, over programs with uneven shares: every token's argmax and top-k equal the reference's
    (integer logits: exact in any summation order)."""
    from gemma4_mtp_kernels.triton import centroid_logits as triton_impl
    g = torch.Generator().manual_seed(8)
    T, Hd, C, CS, top_k = 9, 16, 12, 3, 2
    hidden = torch.randint(-3, 4, (T, Hd), generator=g).float()
    centroids = torch.randint(-3, 4, (C, Hd), generator=g).float()
    centroids[:, 0] = torch.arange(C, dtype=torch.float32) * 100  # wins over the rest for tokens with hidden[0] > 0
    hidden[:5, 0] = 1.0  # five tokens choose clusters 11 and 10
    hidden[5:, 0] = 0.0
    ordering = torch.randperm(C * CS, generator=g)
    lm_head = torch.randint(-3, 4, (C * CS, Hd), generator=g).float()
    args = (hidden, centroids, ordering, lm_head)
    ref_ids, ref_logits = centroid_logits(*args, top_k=top_k, output="topk", k=4, backend="torch")
    ids, logits = triton_impl(*args, top_k=top_k, output="topk", k=4, order="clusters")
    assert torch.equal(ids, ref_ids) and torch.equal(logits, ref_logits)
    token, best = triton_impl(*args, top_k=top_k, output="argmax", order="clusters")
    assert torch.equal(token, ref_ids[:, 0]) and torch.equal(best, ref_logits[:, 0])


@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_tokens_spread_over_programs(order):
    """More tokens than programs (4 under the interpreter) and tokens split across programs: the
    argmax partials of a token come from several programs; every output row is written."""
    g = torch.Generator().manual_seed(6)
    run_all_outputs(11, 16, 8, 6, 3, torch.float32, g, order=order)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])  # token-major (one barrier), cluster-major (three)
def test_graph_replays_reuse_the_counters(T):
    """The one-launch kernel meets at a grid-wide barrier on cached counters that every launch leaves
    zero: captured and replayed many times in a row, it stays correct (a counter left non-zero would
    hang or release the barrier early)."""
    d = DRAFTERS["E2B"]
    g = torch.Generator().manual_seed(7)
    hidden, centroids, ordering, lm_head = (x.to("cuda") for x in make_inputs(
        T, d["Hd"], d["centroids"], d["vocab"] // d["centroids"], torch.bfloat16, g))
    token, best = centroid_logits(hidden, centroids, ordering, lm_head, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token, best = centroid_logits(hidden, centroids, ordering, lm_head, backend="triton")
    for _ in range(3):
        hidden.copy_(torch.randn(T, d["Hd"], generator=g).to(torch.bfloat16))
        for _ in range(10):
            graph.replay()
        ref_token, ref_best = centroid_logits(hidden, centroids, ordering, lm_head, backend="torch")
        torch.cuda.synchronize()
        tol = d["Hd"] * U32 * float(hidden.double().abs().sum(1).max()) * float(lm_head.double().abs().max()) + 1e-6
        assert float((best - ref_best).abs().max()) <= tol
