"""Reference centroid_logits (SPEC §4.3) against an independent fp64 computation."""
import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import reference
from helpers import DRAFTERS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E2B = DRAFTERS["E2B"]


def make(T, Hd, C, V, dtype, *, gen=None):
    hidden = torch.randn(T, Hd, generator=gen).to(dtype)
    centroids = (torch.randn(C, Hd, generator=gen) / Hd**0.5).to(dtype)
    ordering = torch.randperm(V, generator=gen)
    lm_head = (torch.randn(V, Hd, generator=gen) / Hd**0.5).to(dtype)
    return hidden, centroids, ordering, lm_head


def exact_clusters(hidden, centroids, top_k):
    """fp64 scores and, per row, the top_k clusters by descending score, ties to the lower index."""
    scores = (hidden.double() @ centroids.double().T).tolist()
    order = [sorted(range(len(s)), key=lambda c: (-s[c], c))[:top_k] for s in scores]
    return torch.tensor(scores, dtype=torch.float64), order


def tol(hidden, other):
    """Bound on the fp32-accumulation error of a dot product of `hidden` with a row of `other`."""
    return 1e-6 * hidden.shape[1] * hidden.double().abs().max().item() * other.double().abs().max().item() + 1e-6


def check_clusters(got, scores, order, eps):
    """The op's cluster choice per row (a list of top_k cluster ids) equals the fp64 one, except where the
    competing exact scores are within eps (then either order is within the accumulation error)."""
    for t, (got_t, want_t) in enumerate(zip(got, order)):
        assert len(set(got_t)) == len(got_t), f"row {t}: repeated cluster in {got_t}"
        for r, (a, b) in enumerate(zip(got_t, want_t)):
            assert a == b or abs(scores[t, a] - scores[t, b]) <= eps, \
                f"row {t} rank {r}: cluster {a} (score {scores[t, a]}) instead of {b} (score {scores[t, b]})"


def clusters_of(ids, ordering, C, top_k):
    """The clusters a sparse id list [T, K] came from, checked to be whole clusters in ordering order."""
    M = ordering.shape[0] // C
    ordering = ordering.long()
    owner = torch.empty_like(ordering)
    owner[ordering] = torch.arange(ordering.shape[0]) // M
    out = []
    for row in ids:
        blocks = row.view(top_k, M)
        cl = [int(owner[blk[0]]) for blk in blocks]
        for c, blk in zip(cl, blocks):
            assert torch.equal(blk, ordering[c * M:(c + 1) * M]), "candidates must follow token_ordering"
        out.append(cl)
    return out


def check_all_outputs(args, top_k, what, fill_value=-7.5):
    hidden, centroids, ordering, lm_head = args
    T, C, V = hidden.shape[0], centroids.shape[0], lm_head.shape[0]
    M = V // C
    scores, order = exact_clusters(hidden, centroids, top_k)

    ids, logits = g.centroid_logits(*args, top_k=top_k, output="sparse", backend="torch")
    assert ids.dtype == torch.int64 and logits.dtype == torch.float32
    assert ids.shape == (T, top_k * M) and logits.shape == (T, top_k * M)
    check_clusters(clusters_of(ids, ordering, C, top_k), scores, order, tol(hidden, centroids))
    want = torch.einsum("td,tkd->tk", hidden.double(), lm_head[ids].double())
    eps = tol(hidden, lm_head)
    assert (logits.double() - want).abs().max() <= eps, what

    dense = g.centroid_logits(*args, top_k=top_k, output="dense", backend="torch")
    assert dense.dtype == torch.float32 and dense.shape == (T, V)
    cand = torch.zeros(T, V, dtype=torch.bool)
    cand.scatter_(1, ids, True)
    assert torch.equal(dense.gather(1, ids), logits)
    assert (dense[~cand] == float("-inf")).all()
    filled = g.centroid_logits(*args, top_k=top_k, output="dense", fill_value=fill_value, backend="torch")
    assert (filled[~cand] == fill_value).all() and torch.equal(filled[cand], dense[cand])

    token, best = g.centroid_logits(*args, top_k=top_k, output="argmax", backend="torch")
    assert token.dtype == torch.int64 and best.dtype == torch.float32
    assert token.shape == (T,) and best.shape == (T,)
    for t in range(T):
        exp_ids = torch.cat([ordering[c * M:(c + 1) * M] for c in order[t]]).long()
        exp_logits = hidden[t].double() @ lm_head[exp_ids].double().T
        m = exp_logits.max()
        exp_token = int(exp_ids[exp_logits == m].min())
        tok = int(token[t])
        exact_tok = float(hidden[t].double() @ lm_head[tok].double())
        assert tok == exp_token or m - exact_tok <= 2 * eps, f"{what} row {t}: {tok} vs {exp_token}"
        assert abs(float(best[t]) - exact_tok) <= eps


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
    args = make(0, 16, 4, 12, torch.float32)
    ids, logits = g.centroid_logits(*args, top_k=2, output="sparse", backend="torch")
    assert ids.shape == (0, 6) and logits.shape == (0, 6)
    assert g.centroid_logits(*args, top_k=2, output="dense", backend="torch").shape == (0, 12)
    token, best = g.centroid_logits(*args, top_k=2, backend="torch")
    assert token.shape == (0,) and best.shape == (0,)


def one_hot_head(scores, logits, M):
    """hidden = e0, so centroid scores and token logits are exact small integers in every dtype."""
    C, V = len(scores), len(logits)
    assert V == C * M
    hidden = torch.zeros(1, 4)
    hidden[0, 0] = 1
    centroids = torch.zeros(C, 4)
    centroids[:, 0] = torch.tensor(scores, dtype=torch.float32)
    centroids[:, 1] = torch.randn(C)  # ignored by hidden, must not break ties
    lm_head = torch.zeros(V, 4)
    lm_head[:, 0] = torch.tensor(logits, dtype=torch.float32)
    lm_head[:, 2] = torch.randn(V)
    return hidden, centroids, lm_head


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_centroid_ties_go_to_lower_cluster(dtype):
    scores = [3, 5, 5, 1, 5, 2, 0, 4]
    M = 2
    hidden, centroids, lm_head = one_hot_head(scores, list(range(len(scores) * M)), M)
    ordering = torch.randperm(len(scores) * M)
    args = (hidden.to(dtype), centroids.to(dtype), ordering, lm_head.to(dtype))
    for top_k, want in [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (5, [1, 2, 4, 7, 0])]:
        ids, _ = reference.centroid_logits(*args, top_k=top_k, output="sparse")
        assert torch.equal(ids[0], torch.cat([ordering[c * M:(c + 1) * M] for c in want])), top_k
        dense = g.centroid_logits(*args, top_k=top_k, output="dense", backend="torch")
        assert torch.equal(torch.isfinite(dense[0]).nonzero().flatten().sort().values, ids[0].sort().values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_ties_go_to_lowest_vocab_id(dtype):
    # clusters 0 and 1 are selected (cluster 1 first); tokens 3 and 17 tie for the best logit and the
    # higher id 17 comes first in candidate order
    C, M = 4, 5
    ordering = torch.tensor([0, 1, 2, 3, 4, 17, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19])
    logits = [0.0] * (C * M)
    logits[3] = logits[17] = 6.0
    logits[19] = 6.0  # in an unselected cluster: must not win
    hidden, centroids, lm_head = one_hot_head([1, 2, 0, -1], logits, M)
    args = (hidden.to(dtype), centroids.to(dtype), ordering, lm_head.to(dtype))
    ids, _ = g.centroid_logits(*args, top_k=2, output="sparse", backend="torch")
    assert ids[0].tolist().index(3) > ids[0].tolist().index(17)
    assert 19 not in ids[0].tolist()
    token, best = g.centroid_logits(*args, top_k=2, backend="torch")
    assert token.tolist() == [3] and best.tolist() == [6.0]


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
