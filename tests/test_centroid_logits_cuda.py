"""CUDA centroid_logits against fp64 (SPEC §4.3, §6). Needs a GPU (marked `gpu`).

Discrete outputs (cluster choice, argmax token) must match the fp64 answer exactly except where the
competing exact values are within the fp32 accumulation error (checks in cases_centroid_logits)."""
import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import cuda as cuda_backend
from cases_centroid_logits import (ARGMAX_TIES_TOPK, DTYPES, TIED_TOP_K, argmax_ties_case, check_all_outputs,
                                   best_of, check_zero_tokens, cluster_ties_case, make, tol)
from helpers import DRAFTERS

pytestmark = pytest.mark.gpu
DEV = "cuda"
E2B = DRAFTERS["E2B"]


def check_cuda_outputs(args, top_k, what):
    check_all_outputs(args, top_k, what, backend="cuda", device=DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 3, 9, 64])
def test_real_e2b_shape(T, dtype):
    """The full E2B/E4B head: Hd 256, 2048 centroids of 128 tokens, top 32."""
    args = make(T, E2B["Hd"], E2B["centroids"], E2B["vocab"], dtype)
    check_cuda_outputs(args, E2B["top_k"], f"E2B T={T} {dtype}")


@pytest.mark.parametrize("T,order", [(1, "clusters"), (3, "clusters"), (9, "tokens"), (64, "tokens")])
def test_both_phase2_orders_at_any_T(T, order):
    """Each phase-2 order forced where the plan takes the other (argmax and topk; sparse and dense are
    token-major whatever is asked of argmax)."""
    def call(*args, output="argmax", **kw):
        if output in ("argmax", "topk"):
            return cuda_backend.centroid_logits(*args, output=output, order=order, **kw)
        return g.centroid_logits(*args, output=output, **kw, backend="cuda")
    args = make(T, E2B["Hd"], E2B["centroids"], E2B["vocab"], torch.bfloat16)
    check_all_outputs(args, E2B["top_k"], f"E2B T={T} {order}", device=DEV, call=call)


def test_cluster_major_order_is_refused_for_sparse_and_dense():
    args = [t.to(DEV) for t in make(2, 16, 8, 32, torch.float32)]
    for output in ("sparse", "dense"):
        with pytest.raises(ValueError, match="order"):
            cuda_backend.centroid_logits(*args, top_k=2, output=output, fill_value=0.0, order="clusters")
        K = 32 if output == "dense" else 2 * 4
        ids = torch.empty(2, 0 if output == "dense" else K, dtype=torch.int64, device=DEV)
        with pytest.raises(RuntimeError, match="order must be"):  # the op's own check, for raw callers
            cuda_backend._ops().centroid_logits(*args, 2, output, ids, torch.empty(2, K, device=DEV), "clusters")


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_small_heads(top_k, index_dtype):
    hidden, centroids, ordering, lm_head = make(7, 16, 8, 40, torch.float32)
    check_cuda_outputs((hidden, centroids, ordering.to(index_dtype), lm_head), top_k, f"top_k={top_k}")


@pytest.mark.parametrize("C", [3, 100, 4096])
def test_non_power_of_two_and_largest_centroid_counts(C):
    args = make(2, 40, C, C * 3, torch.bfloat16)  # Hd = 40: the scalar (non 16-byte) load path
    check_cuda_outputs(args, min(C, 32), f"C={C}")


def test_too_many_centroids_is_refused():
    args = [t.to(DEV) for t in make(1, 16, 4100, 4100, torch.float32)]
    with pytest.raises(ValueError, match="centroids"):
        g.centroid_logits(*args, top_k=2, backend="cuda")


def test_zero_tokens():
    check_zero_tokens("cuda", DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_centroid_ties_go_to_lower_cluster(dtype):
    M = 2
    args, ordering = cluster_ties_case(dtype, M)
    args = [t.to(DEV) for t in args]
    for top_k, want in TIED_TOP_K:
        ids, _ = g.centroid_logits(*args, top_k=top_k, output="sparse", backend="cuda")
        assert torch.equal(ids[0].cpu(), torch.cat([ordering[c * M:(c + 1) * M] for c in want])), top_k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_ties_go_to_lowest_vocab_id(dtype):
    args = [t.to(DEV) for t in argmax_ties_case(dtype)]
    token, best = g.centroid_logits(*args, top_k=2, backend="cuda")
    assert token.tolist() == [3] and best.tolist() == [6.0]
    ids, logits = g.centroid_logits(*args, top_k=2, output="topk", k=4, backend="cuda")
    assert (ids[0].tolist(), logits[0].tolist()) == ARGMAX_TIES_TOPK


def test_strided_inputs():
    hidden, centroids, ordering, lm_head = make(4, 32, 8, 32, torch.bfloat16)
    wide = lambda t: torch.cat([t, torch.full_like(t, float("nan"))], dim=1)[:, : t.shape[1]]  # noqa: E731
    check_cuda_outputs((wide(hidden), wide(centroids), ordering, wide(lm_head)), 3, "strided")


def test_cuda_graph_capture_and_replay():
    hidden, centroids, ordering, lm_head = (t.to(DEV) for t in make(2, 256, 2048, 2048 * 128, torch.bfloat16))
    g.centroid_logits(hidden, centroids, ordering, lm_head, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token, best = g.centroid_logits(hidden, centroids, ordering, lm_head, backend="cuda")
    for _ in range(2):
        hidden.copy_(torch.randn(2, 256).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        want_tok, want_best = g.centroid_logits(hidden.cpu(), centroids.cpu(), ordering.cpu(), lm_head.cpu(),
                                                backend="torch")
        eps = tol(hidden.cpu(), lm_head.cpu())
        assert (best.cpu() - want_best).abs().max() <= 2 * eps
        same = token.cpu() == want_tok
        assert bool(same.all()) or bool(((best.cpu() - want_best).abs()[~same] <= 2 * eps).all())


def test_torch_compile_fullgraph():
    args = [t.to(DEV) for t in make(3, 64, 16, 16 * 8, torch.bfloat16)]

    def head(*a):
        ids, logits = g.centroid_logits(*a, top_k=4, output="sparse", backend="cuda")
        return ids, logits * 1.0

    ids, logits = torch.compile(head, fullgraph=True)(*args)
    want_ids, want = g.centroid_logits(*[t.cpu() for t in args], top_k=4, output="sparse", backend="torch")
    assert torch.equal(ids.cpu(), want_ids)
    assert (logits.cpu() - want).abs().max() <= tol(args[0].cpu(), args[3].cpu())


@pytest.mark.parametrize("output", ["argmax", "topk", "sparse", "dense"])
def test_opcheck(output):
    hidden, centroids, ordering, lm_head = (t.to(DEV) for t in make(2, 32, 8, 32, torch.float32))
    K = 2 * 4
    shapes = {"argmax": ((2,), (2,)), "topk": ((2, 3), (2, 3)), "sparse": ((2, K), (2, K)),
              "dense": ((0,), (2, 32))}[output]
    ids = torch.empty(shapes[0], dtype=torch.int64, device=DEV)
    logits = torch.full(shapes[1], float("-inf"), device=DEV)
    cuda_backend._ops()
    torch.library.opcheck(torch.ops.gemma4_mtp.centroid_logits.default,
                          (hidden, centroids, ordering, lm_head, 2, output, ids, logits))


def raw_op(args, top_k, output):
    """The custom op on poisoned outputs (NaN logits, ids -7), so that an element the one-launch kernel
    does not write shows."""
    hidden, centroids, ordering, lm_head = args
    T, C, V = hidden.shape[0], centroids.shape[0], ordering.shape[0]
    K = top_k * (V // C)
    shape = {"argmax": (T,), "topk": (T, 3), "sparse": (T, K)}[output]
    ids = torch.full(shape, -7, dtype=torch.int64, device=DEV)
    logits = torch.full(shape, float("nan"), device=DEV)
    cuda_backend._ops().centroid_logits(hidden, centroids, ordering, lm_head, top_k, output, ids, logits)
    return ids.cpu(), logits.cpu()


@pytest.mark.parametrize("T", [1, 2, 64, 200])
def test_poisoned_outputs_fully_written(T):
    """Every item of every token is owned by one program (T = 1, 2: token-major, 4 chunks per cluster at
    T = 1; T = 64, 200: cluster-major, a token's pairs over many programs, so the argmax merges partials)."""
    cpu = make(T, E2B["Hd"], E2B["centroids"], E2B["vocab"], torch.bfloat16)
    args = [t.to(DEV) for t in cpu]
    top_k = E2B["top_k"]
    ids, logits = raw_op(args, top_k, "sparse")
    want_ids, want = g.centroid_logits(*cpu, top_k=top_k, output="sparse", backend="torch")
    eps = tol(cpu[0], cpu[3])
    same = (ids == want_ids).all(dim=1)  # rows whose cluster choice hit no near tie
    assert same.float().mean() > 0.9 and (ids >= 0).all() and not logits.isnan().any()
    assert (logits[same] - want[same]).abs().max() <= eps
    token, best = raw_op(args, top_k, "argmax")
    assert (token >= 0).all() and not best.isnan().any()
    top_ids, top_logits = raw_op(args, top_k, "topk")  # k = 3
    own_ids, own_logits = best_of(ids, logits, 3)
    assert torch.equal(top_ids, own_ids) and torch.equal(top_logits, own_logits)
    # the argmax over the kernel's own sparse candidates, ties to the lowest id
    top = logits.max(1, keepdim=True).values
    own = torch.where(logits == top, ids, torch.iinfo(torch.int64).max).min(1).values
    assert torch.equal(token, own) and torch.equal(best, top.squeeze(1))


def test_large_top_k_and_tied_scores():
    """top_k = C = 300 (every cluster, ranked by the radix select and the rank count) and all-equal
    scores (the four passes end without narrowing; clusters go by index)."""
    hidden, centroids, ordering, lm_head = make(3, 32, 300, 600, torch.float32)
    check_cuda_outputs((hidden, centroids, ordering, lm_head), 300, "top_k = C")
    centroids[:] = centroids[0]
    ids, _ = raw_op([t.to(DEV) for t in (hidden, centroids, ordering, lm_head)], 5, "sparse")
    assert torch.equal(ids, ordering.view(300, 2)[:5].reshape(1, 10).expand(3, 10))


@pytest.mark.parametrize("T", [2, 140])
def test_unchecked_bad_ordering_ids_give_nan_not_a_read(T):
    """token_ordering is not validated on the GPU: out-of-range ids are never dereferenced; their logit
    is NaN and their sparse id -1, and they make the token's argmax (-1, NaN), as in the Triton backend.
    T = 140: 280 (token, cluster) pairs, more than any GPU's SMs here: the cluster-major argmax and topk."""
    hidden, centroids, ordering, lm_head = make(T, 32, 8, 32, torch.float32)
    ordering[::4] = 10**9  # the first token of every cluster
    args = [t.to(DEV) for t in (hidden, centroids, ordering, lm_head)]
    token, best = raw_op(args, 2, "argmax")
    assert token.tolist() == [-1] * T and best.isnan().all()
    ids, logits = raw_op(args, 2, "topk")
    assert (ids == -1).all() and logits.isnan().all()
    ids, logits = raw_op(args, 2, "sparse")
    assert (ids[:, ::4] == -1).all() and logits[:, ::4].isnan().all()
    assert (ids[:, 1::4] >= 0).all() and not logits[:, 1::4].isnan().any()
    dense = cuda_backend.centroid_logits(*args, top_k=2, output="dense", fill_value=float("-inf")).cpu()
    assert not dense.isnan().any() and int(torch.isfinite(dense).sum()) == T * 2 * 3


def test_misaligned_views_take_the_elementwise_path():
    """Row views that start 2 bytes into their storage cannot use 16-byte loads: same answers."""
    hidden, centroids, ordering, lm_head = make(3, 64, 16, 16 * 8, torch.bfloat16)
    shift = lambda t: torch.cat([t.new_zeros(t.shape[0], 1), t], dim=1)[:, 1:]  # noqa: E731
    check_cuda_outputs((shift(hidden), shift(centroids), ordering, shift(lm_head)), 4, "misaligned")


@pytest.mark.parametrize("T", [1, 64])  # token-major (one grid barrier), cluster-major (three)
def test_graph_replays_reuse_the_counters(T):
    """The kernel's programs meet at grid barriers on cached counters that every launch leaves zero:
    many replays in a row, and eager calls between them, stay correct (a counter left non-zero would
    hang the barrier or release it early)."""
    cpu = make(T, E2B["Hd"], E2B["centroids"], E2B["vocab"], torch.bfloat16)
    hidden, centroids, ordering, lm_head = (t.to(DEV) for t in cpu)
    first_token, first_best = g.centroid_logits(hidden, centroids, ordering, lm_head, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token, best = g.centroid_logits(hidden, centroids, ordering, lm_head, backend="cuda")
    for _ in range(20):
        graph.replay()
        eager_token, eager_best = g.centroid_logits(hidden, centroids, ordering, lm_head, backend="cuda")
    torch.cuda.synchronize()
    # every launch is the first one's, bit for bit (the kernel is deterministic)
    assert torch.equal(token, first_token) and torch.equal(best, first_best)
    assert torch.equal(eager_token, first_token) and torch.equal(eager_best, first_best)
    # and the first one is right: within the accumulation bound of the reference, except where a near tie
    # at the top_k-th cluster score picked another cluster (a token or two of 64 at most)
    want_tok, want_best = g.centroid_logits(*cpu, backend="torch")
    close = (first_best.cpu() - want_best).abs() <= 2 * tol(cpu[0], cpu[3])
    assert bool(close.all()) if T == 1 else close.float().mean() >= 0.95
