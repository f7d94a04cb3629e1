"""The CUDA centroid_logits kernel runs on the CPU: its own source (csrc/include/gemma4_mtp/centroid_logits.cuh,
prepare and launcher included) compiled with g++ against tests/cuda_emulator, under AddressSanitizer,
against the fp64 oracle of cases_centroid_logits (every output mode), like the other backends.

The kernel is one cooperative launch whose programs meet at a grid-wide barrier: the emulation runs
all of them at once (a round of each program's threads in turn; the thread spinning at the barrier lets
the others run), each with its own shared memory. tests/cuda_emulator/centroid_main.cpp copies the
inputs into allocations of exactly their extent, poisons the outputs and the workspace, launches once
and checks that both counters were left zero. Covered: the E2B / E4B head's width and top-k on a
reduced vocabulary, programs owning several tokens and tokens split over programs (the argmax merges
partials), the 16-byte and the element-wise loads, int32 / int64 orderings, strided rows, cluster and
argmax ties, out-of-range ids in token_ordering, both phase-2 orders of argmax and topk (token-major;
cluster-major, which the plan takes once the (token, cluster) pairs outnumber the SMs: on 4 emulated SMs
at T = 1 already, on a GPU's 132 at T >= 5), a cluster-major share in several passes, a pair's rows cut
over warps. Not covered: timing, the GPU's memory ordering and co-residency: test_centroid_logits_cuda.py
verifies those on a GPU.
"""
from __future__ import annotations

import pytest
import torch

import emulated
from cases_centroid_logits import (ARGMAX_TIES_TOPK, DTYPES, TIED_TOP_K, argmax_ties_case, check_all_outputs,
                                   check_nan_cluster_scores, check_topk, cluster_ties_case, exact_clusters, make,
                                   tol)
from helpers import DRAFTERS

E2B = DRAFTERS["E2B"]


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "centroid_main.cpp", "centroid")


class Emulated:
    """centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k, output, fill_value) run by
    the emulator, on `sms` SMs (the launch's programs). order: phase 2's order of argmax and topk ("auto":
    the plan's; "tokens" / "clusters" forced and checked); the other outputs are token-major."""

    def __init__(self, binary, tmp_path, *, sms=4, schedule="rr", order="auto"):
        self.binary, self.dir, self.sms, self.schedule, self.order = binary, tmp_path, sms, schedule, order
        self.last = {}

    def __call__(self, hidden, centroids, ordering, lm_head, *, top_k=32, output="argmax", fill_value=None, k=1):
        d = self.dir
        for name, t in (("hidden", hidden), ("centroids", centroids), ("token_ordering", ordering),
                        ("lm_head", lm_head)):
            emulated.write(d / f"{name}.bin", t)
        (T, Hd), C, V = hidden.shape, centroids.shape[0], lm_head.shape[0]
        fill = "" if output != "dense" else f"fill={float('-inf') if fill_value is None else float(fill_value)!r} "
        order = self.order if output in ("argmax", "topk") else "auto"
        self.last = emulated.run(self.binary, (
            f"dir={d} dtype={emulated.DTYPE_NAMES[hidden.dtype]} T={T} Hd={Hd} C={C} V={V} top_k={top_k} "
            f"output={output} k={k} {fill}ord64={int(ordering.dtype == torch.int64)} hs={hidden.stride(0)} "
            f"cs={centroids.stride(0)} ls={lm_head.stride(0)} ho={hidden.storage_offset()} sms={self.sms} "
            f"schedule={self.schedule} order={order}"))
        assert order == "auto" or self.last["order"] == order
        K = {"argmax": None, "topk": k, "sparse": top_k * (V // C), "dense": V}[output]
        shape = (T,) if K is None else (T, K)
        logits = emulated.read(d / "logits.bin", torch.float32, shape)
        if output == "dense":
            return logits
        return emulated.read(d / "ids.bin", torch.int64, shape), logits


@pytest.mark.parametrize("T,dtype,schedule,order", [
    (1, torch.float32, "rr", "tokens"), (1, torch.float16, "rr", "tokens"), (1, torch.bfloat16, "rr", "tokens"),
    (1, torch.bfloat16, "rr", "clusters"), (9, torch.bfloat16, "rr", "tokens"), (9, torch.bfloat16, "rr", "clusters"),
    (1, torch.bfloat16, "ahead", "tokens"), (1, torch.bfloat16, "ahead", "clusters"),
    (9, torch.float32, "behind", "clusters")], ids=str)
def test_e2b_width_and_top_k(binary, tmp_path, T, dtype, schedule, order):
    """The E2B / E4B head's width (256) and top 32 clusters, 512 clusters of 16 tokens on 4 SMs. Token-major:
    at T = 1 a cluster's rows split into chunks over programs, at T = 9 programs own several tokens;
    cluster-major: a program's share spans several clusters, their members several tokens. With
    schedule ahead / behind, each program (and warp) runs as far as it can before the next, from the
    lowest / highest index: the first reaches the grid barrier before any other has scored its centroids."""
    args = make(T, E2B["Hd"], 512, 512 * 16, dtype, gen=torch.Generator().manual_seed(T))
    check_all_outputs(args, E2B["top_k"], f"T={T} {dtype} {order}",
                      call=Emulated(binary, tmp_path, schedule=schedule, order=order))


def test_token_major_merge_of_more_programs_than_lanes(binary, tmp_path):
    """Token-major at T = 1 on 70 SMs (2048 centroids: 70 programs, 32 clusters' items over them, some
    programs without any): phase 3's warp merges up to three partials a lane (programs q, q + 32, q + 64),
    loaded together, the programs without items left out."""
    args = make(1, 64, 2048, 2048 * 16, torch.bfloat16, gen=torch.Generator().manual_seed(6))
    check_all_outputs(args, E2B["top_k"], "70 programs", call=Emulated(binary, tmp_path, sms=70, order="tokens"))


@pytest.mark.parametrize("top_k", [1, 3, 8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_small_heads(binary, tmp_path, top_k, index_dtype, order):
    hidden, centroids, ordering, lm_head = make(7, 16, 8, 40, torch.float32, gen=torch.Generator().manual_seed(2))
    check_all_outputs((hidden, centroids, ordering.to(index_dtype), lm_head), top_k, f"top_k={top_k} {order}",
                      call=Emulated(binary, tmp_path, sms=3, order=order))


def test_non_power_of_two_centroids_and_unaligned_rows(binary, tmp_path):
    args = make(2, 40, 100, 300, torch.bfloat16, gen=torch.Generator().manual_seed(3))  # Hd 40: element-wise loads
    check_all_outputs(args, 32, "C=100", call=Emulated(binary, tmp_path))


def test_strided_inputs(binary, tmp_path):
    hidden, centroids, ordering, lm_head = make(4, 32, 8, 32, torch.bfloat16, gen=torch.Generator().manual_seed(4))
    wide = lambda t: torch.cat([t, torch.full_like(t, float("nan"))], dim=1)[:, : t.shape[1]]  # noqa: E731
    check_all_outputs((wide(hidden), wide(centroids), ordering, wide(lm_head)), 3, "strided",
                      call=Emulated(binary, tmp_path))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_cluster_and_argmax_ties(binary, tmp_path, dtype, order):
    M = 2
    call = Emulated(binary, tmp_path, order=order)
    args, ordering = cluster_ties_case(dtype, M)
    for top_k, want in TIED_TOP_K:
        ids, _ = call(*args, top_k=top_k, output="sparse")
        assert torch.equal(ids[0], torch.cat([ordering[c * M:(c + 1) * M] for c in want])), top_k
    token, best = call(*argmax_ties_case(dtype), top_k=2)
    assert token.tolist() == [3] and best.tolist() == [6.0]
    ids, logits = call(*argmax_ties_case(dtype), top_k=2, output="topk", k=4)
    assert (ids[0].tolist(), logits[0].tolist()) == ARGMAX_TIES_TOPK


@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_nan_cluster_scores_rank_first_whatever_their_sign(binary, tmp_path, order):
    check_nan_cluster_scores(Emulated(binary, tmp_path, sms=3, order=order))


@pytest.mark.parametrize("order", ["tokens", "clusters"])
def test_unchecked_bad_ordering_ids_give_nan_not_a_read(binary, tmp_path, order):
    """Out-of-range ids in token_ordering (not validated on the GPU) are never dereferenced (the emulation
    runs under AddressSanitizer): a token whose selected clusters hold one gets (-1, NaN) for its argmax
    and every top-k answer; a token whose clusters hold none its own answer."""
    hidden, centroids, ordering, lm_head = make(6, 32, 8, 32, torch.float32, gen=torch.Generator().manual_seed(5))
    scores, _ = exact_clusters(hidden, centroids, 2)
    bad_cluster = int(scores[0].argmax())
    ordering[bad_cluster * 4 + 1] = 10**9
    call = Emulated(binary, tmp_path, sms=3, order=order)
    hit = [bad_cluster in sorted(range(8), key=lambda c: (-float(s[c]), c))[:2] for s in scores]
    assert hit[0] and not all(hit)
    token, best = call(hidden, centroids, ordering, lm_head, top_k=2)
    ids, logits = call(hidden, centroids, ordering, lm_head, top_k=2, output="topk", k=3)
    good = torch.tensor([not h for h in hit])
    assert (token[~good] == -1).all() and best[~good].isnan().all()
    assert (ids[~good] == -1).all() and logits[~good].isnan().all()
    assert (token[good] >= 0).all() and not best[good].isnan().any()
    assert (ids[good] >= 0).all() and not logits[good].isnan().any()


def test_plan_takes_clusters_once_pairs_outnumber_the_sms(binary, tmp_path):
    """Cluster-major for argmax and topk once T * top_k exceeds the SMs, token-major below and for sparse."""
    args = make(2, 16, 8, 32, torch.float32, gen=torch.Generator().manual_seed(6))
    call = Emulated(binary, tmp_path, sms=4)
    call(*args, top_k=2)
    assert call.last["order"] == "tokens"  # 4 pairs on 4 SMs
    call(*args, top_k=3)
    assert call.last["order"] == "clusters"
    call(*args, top_k=3, output="topk", k=2)
    assert call.last["order"] == "clusters"
    call(*args, top_k=3, output="sparse")
    assert call.last["order"] == "tokens"


def test_cluster_major_share_in_several_passes(binary, tmp_path):
    """One program's share of 33 * 128 pairs is more than a pass holds (4096): two passes, the second
    starting inside a cluster's members; every pair of every token is scored once (argmax, topk)."""
    args = make(33, 16, 256, 1024, torch.float32, gen=torch.Generator().manual_seed(7))
    call = Emulated(binary, tmp_path, sms=1, order="clusters")
    _, order = exact_clusters(args[0], args[1], 128)
    eps = tol(args[0], args[3])
    token, best = call(*args, top_k=128)
    ordering, M = args[2], 4
    for t in range(33):
        exp_ids = torch.cat([ordering[c * M:(c + 1) * M] for c in order[t]]).long()
        exp = args[0][t].double() @ args[3][exp_ids].double().T
        exact_tok = float(args[0][t].double() @ args[3][int(token[t])].double())
        assert int(token[t]) == int(exp_ids[exp.argmax()]) or float(exp.max()) - exact_tok <= 2 * eps
        assert abs(float(best[t]) - exact_tok) <= eps
    check_topk(call(*args, top_k=128, output="topk", k=5), args, order, eps, "passes")


def test_cluster_major_rows_split_over_warps(binary, tmp_path):
    """Few pairs for many warps: each pair's 64 rows are cut into 4 items of 16 (chunks), whose partials
    the merge takes together."""
    args = make(2, 32, 16, 16 * 64, torch.bfloat16, gen=torch.Generator().manual_seed(8))
    call = Emulated(binary, tmp_path, sms=2, order="clusters")
    check_all_outputs(args, 3, "chunks", call=call)
    assert call.last["chunks"] == "4" and call.last["order"] == "clusters"
