"""centroid_logits test inputs, fp64 oracle and the output checks shared by every backend's tests.

Discrete outputs (cluster choice, argmax token) must match the fp64 answer exactly except where the
competing exact values are within the fp32 accumulation error."""
import torch

import gemma4_mtp_kernels as g

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def check_all_outputs(args, top_k, what, *, backend="torch", device="cpu", fill_value=-7.5, call=None):
    """Every output mode of `backend` on `device` against fp64: cluster choice (exact up to near ties),
    logits within the fp32 accumulation bound, dense fill, argmax token. Returns the sparse
    (ids, logits) and the dense row block, on the CPU. `call`: what runs the op instead of the public
    op (the same arguments without backend=): the CUDA kernel on the CPU emulator."""
    op = call if call is not None else lambda *a, **kw: g.centroid_logits(*a, **kw, backend=backend)
    hidden, centroids, ordering, lm_head = args
    T, C, V = hidden.shape[0], centroids.shape[0], lm_head.shape[0]
    M = V // C
    scores, order = exact_clusters(hidden, centroids, top_k)
    dargs = [t.to(device) for t in args]
    eps = tol(hidden, lm_head)

    ids, logits = (t.cpu() for t in op(*dargs, top_k=top_k, output="sparse"))
    assert ids.dtype == torch.int64 and logits.dtype == torch.float32
    assert ids.shape == (T, top_k * M) and logits.shape == (T, top_k * M)
    check_clusters(clusters_of(ids, ordering, C, top_k), scores, order, tol(hidden, centroids))
    want = torch.einsum("td,tkd->tk", hidden.double(), lm_head[ids].double())
    assert (logits.double() - want).abs().max() <= eps, what

    dense = op(*dargs, top_k=top_k, output="dense").cpu()
    assert dense.dtype == torch.float32 and dense.shape == (T, V)
    cand = torch.zeros(T, V, dtype=torch.bool)
    cand.scatter_(1, ids, True)
    assert (dense.gather(1, ids).double() - want).abs().max() <= eps, what
    assert (dense[~cand] == float("-inf")).all()
    filled = op(*dargs, top_k=top_k, output="dense", fill_value=fill_value).cpu()
    assert (filled[~cand] == fill_value).all() and torch.equal(filled[cand], dense[cand])

    token, best = (t.cpu() for t in op(*dargs, top_k=top_k, output="argmax"))
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
    check_topk(op(*dargs, top_k=top_k, output="topk", k=min(4, top_k * M)), args, order, eps, what)
    return ids, logits, dense


def check_topk(got, args, order, eps, what):
    """output="topk" (ids [T, k], logits [T, k]) against fp64: rank r holds the candidate of fp64 rank r
    (by descending logit, then lower id) unless their exact logits are within the accumulation error, and
    its own logit within eps of its exact one; no id twice."""
    hidden, centroids, ordering, lm_head = args
    ids, logits = (t.cpu() for t in got)
    T, k = ids.shape
    M = lm_head.shape[0] // centroids.shape[0]
    assert ids.dtype == torch.int64 and logits.dtype == torch.float32 and logits.shape == (T, k)
    for t in range(T):
        exp_ids = torch.cat([ordering[c * M:(c + 1) * M] for c in order[t]]).long()
        exp_logits = (hidden[t].double() @ lm_head[exp_ids].double().T).tolist()
        ranked = sorted(range(len(exp_ids)), key=lambda i: (-exp_logits[i], int(exp_ids[i])))[:k]
        assert len(set(ids[t].tolist())) == k, f"{what} row {t}: repeated id in {ids[t].tolist()}"
        for r, i in enumerate(ranked):
            tok = int(ids[t, r])
            exact_tok = float(hidden[t].double() @ lm_head[tok].double())
            assert tok == int(exp_ids[i]) or abs(exp_logits[i] - exact_tok) <= 2 * eps, \
                f"{what} row {t} rank {r}: {tok} vs {int(exp_ids[i])}"
            assert abs(float(logits[t, r]) - exact_tok) <= eps, f"{what} row {t} rank {r}"


def best_of(ids, logits, k):
    """The k best of (ids, logits) [T, K] rows: higher logit first, then lower id (stable sorts)."""
    by_id = ids.argsort(dim=1, stable=True)
    ids, logits = ids.gather(1, by_id), logits.gather(1, by_id)
    best = logits.argsort(dim=1, descending=True, stable=True)[:, :k]
    return ids.gather(1, best), logits.gather(1, best)


# Cluster scores with three-way ties (5 at clusters 1, 2, 4), M = 2 tokens per cluster, and the
# clusters each top_k must select, in order: equal scores rank the lower cluster first.
TIED_SCORES = [3, 5, 5, 1, 5, 2, 0, 4]
TIED_TOP_K = [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (5, [1, 2, 4, 7, 0])]


def cluster_ties_case(dtype, M=2):
    """(args, ordering) of a head with exactly tied cluster scores (TIED_SCORES)."""
    hidden, centroids, lm_head = one_hot_head(TIED_SCORES, list(range(len(TIED_SCORES) * M)), M)
    ordering = torch.randperm(len(TIED_SCORES) * M)
    return (hidden.to(dtype), centroids.to(dtype), ordering, lm_head.to(dtype)), ordering


# top_k = 2, k = 4 of argmax_ties_case: 3 and 17 (6, tied: the lower id first), then the lowest ids of
# the candidates at 0
ARGMAX_TIES_TOPK = ([3, 17, 0, 1], [6.0, 6.0, 0.0, 0.0])


def argmax_ties_case(dtype):
    """Clusters 0 and 1 are selected at top_k = 2 (cluster 1 first); tokens 3 and 17 tie for the best
    logit 6 and the higher id 17 comes first in candidate order; token 19 (also 6) is in an
    unselected cluster. The argmax must be token 3 (top 4: ARGMAX_TIES_TOPK)."""
    C, M = 4, 5
    ordering = torch.tensor([0, 1, 2, 3, 4, 17, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19])
    logits = [0.0] * (C * M)
    logits[3] = logits[17] = logits[19] = 6.0
    hidden, centroids, lm_head = one_hot_head([1, 2, 0, -1], logits, M)
    return hidden.to(dtype), centroids.to(dtype), ordering, lm_head.to(dtype)


def check_nan_cluster_scores(call):
    """A NaN centroid score ranks above every number, as torch's sort puts it, also a NaN with its sign bit
    set (x86's default NaN, which the interpreter's and the CPU emulation's arithmetic keep; a GPU's makes
    positive NaNs): clusters 3 (NaN) and 5 (-NaN) are selected first, in index order, and `call`'s argmax
    and top-k (call: the op's signature, without backend) are the reference's."""
    T, Hd, C, CS, top_k = 3, 16, 8, 4, 3
    hidden, centroids, ordering, lm_head = make(T, Hd, C, C * CS, torch.float32, gen=torch.Generator().manual_seed(9))
    centroids[3] = float("nan")
    centroids[5] = -torch.tensor(float("nan"))
    assert torch.signbit(centroids[5]).all() and not torch.signbit(centroids[3]).any()
    args = (hidden, centroids, ordering, lm_head)
    ids, _ = call(*args, top_k=top_k, output="sparse", k=1)
    assert set(ordering.view(C, CS)[[3, 5]].flatten().tolist()) == set(ids[0, :2 * CS].tolist())
    ref_ids, _ = g.centroid_logits(*args, top_k=top_k, output="sparse", backend="torch")
    assert torch.equal(ids[:, :2 * CS], ref_ids[:, :2 * CS])
    for output, k in (("argmax", 1), ("topk", 3)):
        got = call(*args, top_k=top_k, output=output, k=k)
        ref = g.centroid_logits(*args, top_k=top_k, output=output, k=k, backend="torch")
        assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-5), output


def check_zero_tokens(backend, device):
    args = [t.to(device) for t in make(0, 16, 4, 12, torch.float32)]
    ids, logits = g.centroid_logits(*args, top_k=2, output="sparse", backend=backend)
    assert ids.shape == (0, 6) and logits.shape == (0, 6)
    assert g.centroid_logits(*args, top_k=2, output="dense", backend=backend).shape == (0, 12)
    token, best = g.centroid_logits(*args, top_k=2, backend=backend)
    assert token.shape == (0,) and best.shape == (0,)
    ids, logits = g.centroid_logits(*args, top_k=2, output="topk", k=3, backend=backend)
    assert ids.shape == (0, 3) and logits.shape == (0, 3)
