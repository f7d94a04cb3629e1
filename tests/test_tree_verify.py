"""Reference tree_verify (SPEC §4.4): brute force on random trees, and the sampling distributions."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GARBAGE = 10**9  # token of a padding slot: never read


# ---- trees --------------------------------------------------------------------------------------

def random_trees(B, N, V, rng, *, pad=0.25, chain_rows=0.2):
    """Parents and tokens of B random trees: padding slots, duplicate child tokens, some chains."""
    parents = np.full((B, N), -1, dtype=np.int32)
    tokens = rng.integers(0, V, size=(B, N))
    for b in range(B):
        chain = rng.random() < chain_rows
        for i in range(1, N):
            if chain:
                parents[b, i] = i - 1
            elif rng.random() < pad:
                tokens[b, i] = GARBAGE
            else:
                used = [j for j in range(i) if j == 0 or parents[b, j] >= 0]
                parents[b, i] = rng.choice(used)
    tokens[:, 0] = rng.integers(-5, 2 * V, size=B)  # the committed token: never read
    return torch.from_numpy(tokens), torch.from_numpy(parents)


def first_argmax(row):
    best = max(row)
    return min(v for v, x in enumerate(row) if x == best)


def inverse_cdf(p, u):
    """First id whose cumulative probability exceeds u, and whether u sits within 1e-6 of a boundary."""
    cdf = np.cumsum(p)
    ambiguous = bool(np.any(np.abs(cdf[:-1] - u) < 1e-6))
    hit = np.nonzero(cdf > u)[0]
    return (int(hit[0]) if hit.size else int(np.nonzero(p > 0)[0][-1])), ambiguous


def softmax64(x, temperature):
    z = np.asarray(x, dtype=np.float64) / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


def brute_force(tokens, parents, pick):
    """The accepted path of one tree, computed node by node in index order (not by walking).

    pick(u) -> the target's token at node u. Node i is on the accepted path iff its parent is, it holds
    pick(parent), and no lower-index sibling holds the same token. Those nodes form one chain."""
    N = len(parents)
    on_path = [True] + [False] * (N - 1)
    depth = [0] * N
    choice = {}
    for i in range(1, N):
        p = parents[i]
        if p < 0 or not on_path[p]:
            continue
        if p not in choice:
            choice[p] = pick(p)
        earlier = [j for j in range(1, i) if parents[j] == p and tokens[j] == tokens[i]]
        if tokens[i] == choice[p] and not earlier:
            on_path[i], depth[i] = True, depth[p] + 1
    last = max(range(N), key=lambda i: (depth[i] if on_path[i] else -1, -i))
    path = []
    node = last
    while node != 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    bonus = choice[last] if last in choice else pick(last)
    return path, [int(tokens[i]) for i in path] + [bonus]


def check_row(res, b, path, emitted):
    N = res.accepted_nodes.shape[1]
    n = len(path)
    assert int(res.accept_len[b]) == n
    assert res.accepted_nodes[b].tolist() == path + [-1] * (N - n)
    assert res.output_tokens[b].tolist() == emitted + [-1] * (N - n - 1)
    assert int(res.last_node[b]) == (path[-1] if path else 0)


def check_types(res, B, N):
    assert res.accept_len.dtype == torch.int32 and res.accept_len.shape == (B,)
    assert res.accepted_nodes.dtype == torch.int32 and res.accepted_nodes.shape == (B, N)
    assert res.output_tokens.dtype == torch.int64 and res.output_tokens.shape == (B, N)
    assert res.last_node.dtype == torch.int32 and res.last_node.shape == (B,)


# ---- greedy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,V", [(1, 3), (2, 2), (6, 3), (12, 4), (24, 6)])
def test_greedy_random_trees(N, V, dtype):
    rng = np.random.default_rng(N * 100 + V)
    B = 150
    tokens, parents = random_trees(B, N, V, rng)
    # small integer logits: exact in every dtype, many argmax ties
    logits = torch.from_numpy(rng.integers(0, 3, size=(B, N, V))).to(dtype)
    res = g.tree_verify(tokens, parents, logits, backend="torch")
    check_types(res, B, N)
    lists = logits.tolist()
    for b in range(B):
        path, emitted = brute_force(tokens[b].tolist(), parents[b].tolist(), lambda u: first_argmax(lists[b][u]))
        check_row(res, b, path, emitted)
    if N > 2:
        assert res.accept_len.max() >= 2, "the trees should accept something"


def test_greedy_continuous_logits_and_temperature_zero():
    """temperature=0 (float or per row) is greedy and ignores uniforms."""
    rng = np.random.default_rng(1)
    B, N, V = 200, 8, 5
    tokens, parents = random_trees(B, N, V, rng)
    logits = torch.randn(B, N, V)
    # make the target agree with some drafts
    for b in range(B):
        for i in range(1, N):
            if parents[b, i] >= 0 and rng.random() < 0.5:
                logits[b, parents[b, i], tokens[b, i]] += 5
    plain = g.tree_verify(tokens, parents, logits, backend="torch")
    zero = g.tree_verify(tokens, parents, logits, temperature=0.0, backend="torch")
    per_row = reference.tree_verify(tokens, parents, logits, temperature=torch.zeros(B),
                                    uniforms=torch.rand(B, N, 2))
    lists = logits.tolist()
    for b in range(B):
        path, emitted = brute_force(tokens[b].tolist(), parents[b].tolist(), lambda u: first_argmax(lists[b][u]))
        for res in (plain, zero, per_row):
            check_row(res, b, path, emitted)


def test_duplicate_children_lowest_index_wins():
    # root has children 1 and 2, both token 7; only child 2 has a child that the target accepts
    tokens = torch.tensor([[0, 7, 7, 4]])
    parents = torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32)
    logits = torch.zeros(1, 4, 9)
    logits[0, 0, 7] = 1
    logits[0, 1, 3] = 1
    logits[0, 2, 4] = 1
    res = g.tree_verify(tokens, parents, logits, backend="torch")
    check_row(res, 0, [1], [7, 3])


def test_single_node_and_empty_batch():
    res = g.tree_verify(torch.tensor([[5]]), torch.tensor([[-1]], dtype=torch.int32),
                        torch.tensor([[[0.0, 2.0, 2.0]]]), backend="torch")
    check_row(res, 0, [], [1])
    res = g.tree_verify(torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.int32),
                        torch.zeros(0, 3, 4), backend="torch")
    check_types(res, 0, 3)


def test_full_chain_accepted():
    N, V = 6, 10
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4]], dtype=torch.int32)
    logits = torch.zeros(1, N, V)
    for i in range(N - 1):
        logits[0, i, tokens[0, i + 1]] = 1
    logits[0, N - 1, 2] = 1
    res = g.tree_verify(tokens, parents, logits, backend="torch")
    check_row(res, 0, [1, 2, 3, 4, 5], [1, 4, 1, 5, 9, 2])


# ---- sampling, decisions ------------------------------------------------------------------------

def test_sampling_random_trees_match_brute_force():
    """Deterministic drafts: each decision is the inverse CDF of p_u at uniforms[b, u, 0]."""
    rng = np.random.default_rng(2)
    B, N, V = 300, 10, 4
    tokens, parents = random_trees(B, N, V, rng)
    logits = torch.randn(B, N, V) * 2
    temperature = torch.from_numpy(rng.choice([0.0, 0.5, 1.0, 2.0], size=B).astype(np.float32))
    uniforms = torch.rand(B, N, 2)
    res = g.tree_verify(tokens, parents, logits, temperature=temperature, uniforms=uniforms, backend="torch")
    lists = logits.tolist()
    skipped = 0
    for b in range(B):
        temp = float(temperature[b])
        ambiguous = []

        def pick(u):
            if temp == 0:
                return first_argmax(lists[b][u])
            t, amb = inverse_cdf(softmax64(lists[b][u], temp), float(uniforms[b, u, 0]))
            ambiguous.append(amb)
            return t

        path, emitted = brute_force(tokens[b].tolist(), parents[b].tolist(), pick)
        if any(ambiguous):
            skipped += 1
            continue
        check_row(res, b, path, emitted)
    assert skipped <= 3


def brute_force_chain_with_draft_probs(tokens, logits, q, temp, u):
    """Rejection sampling along a chain, in fp64. Returns (emitted tokens, ambiguous)."""
    N = len(tokens)
    emitted, ambiguous = [], False
    for node in range(N):
        p = softmax64(logits[node], temp)
        if node + 1 < N:
            x = tokens[node + 1]
            qx = q[node][x]
            ratio = p[x] / qx if qx > 0 else 0.0
            ambiguous |= qx > 0 and abs(u[node][0] - ratio) < 1e-5
            if qx > 0 and u[node][0] < ratio:
                emitted.append(x)
                continue
            residual = np.maximum(p - np.asarray(q[node], dtype=np.float64), 0)
            t, amb = inverse_cdf(residual / residual.sum(), u[node][1])
        else:
            t, amb = inverse_cdf(p, u[node][1])
        return emitted + [t], ambiguous or amb
    raise AssertionError("unreachable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chain_draft_probs_match_brute_force(dtype):
    rng = np.random.default_rng(3)
    B, N, V = 300, 5, 4
    parents = torch.arange(-1, N - 1, dtype=torch.int32).expand(B, N).contiguous()
    q = torch.softmax(torch.randn(B, N, V) * 2, dim=-1)
    q[torch.rand(B, N, V) < 0.2] = 0  # unnormalised zeros: q(x) = 0 must never accept x
    tokens = torch.from_numpy(rng.integers(0, V, size=(B, N)))
    logits = (torch.randn(B, N, V) * 2).to(dtype)
    q = q.to(dtype)
    temperature = torch.from_numpy(rng.choice([0.7, 1.0, 1.5], size=B).astype(np.float32))
    uniforms = torch.rand(B, N, 2)
    res = g.tree_verify(tokens, parents, logits, temperature=temperature, uniforms=uniforms, draft_probs=q,
                        backend="torch")
    skipped = 0
    for b in range(B):
        emitted, ambiguous = brute_force_chain_with_draft_probs(
            tokens[b].tolist(), logits[b].double().tolist(), q[b].double().tolist(), float(temperature[b]),
            uniforms[b].double().tolist())
        if ambiguous:
            skipped += 1
            continue
        n = len(emitted) - 1
        check_row(res, b, list(range(1, n + 1)), emitted)
    assert skipped <= 3


def test_zero_probability_draft_never_accepted():
    B, V = 64, 5
    tokens = torch.tensor([[0, 2, 3]]).expand(B, 3).contiguous()
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32).expand(B, 3).contiguous()
    logits = torch.randn(B, 3, V)
    logits[:, 0, 2] = 30  # p(2) ~ 1 at the root
    q = torch.full((B, 3, V), 0.25)
    q[:, 0, 2] = 0  # but the drafter gave 2 zero probability
    uniforms = torch.rand(B, 3, 2)
    uniforms[:, :, 0] = 0
    res = g.tree_verify(tokens, parents, logits, temperature=1.0, uniforms=uniforms, draft_probs=q, backend="torch")
    assert (res.accept_len == 0).all()
    assert (res.last_node == 0).all()


def test_mixed_greedy_and_sampling_rows_are_independent():
    """A row's result does not depend on the other rows of the batch, greedy or sampling."""
    rng = np.random.default_rng(4)
    B, N, V = 40, 7, 3
    tokens, parents = random_trees(B, N, V, rng)
    logits = torch.randn(B, N, V)
    temperature = torch.tensor([0.0, 1.0] * (B // 2))
    uniforms = torch.rand(B, N, 2)
    res = g.tree_verify(tokens, parents, logits, temperature=temperature, uniforms=uniforms, backend="torch")
    for b in range(B):
        one = g.tree_verify(tokens[b:b + 1], parents[b:b + 1], logits[b:b + 1], temperature=temperature[b:b + 1],
                            uniforms=uniforms[b:b + 1], backend="torch")
        for field, row in zip(res, one):
            assert torch.equal(field[b], row[0])


# ---- sampling, distributions --------------------------------------------------------------------

def chi_square(counts, probs, what):
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() * np.asarray(probs, dtype=np.float64)
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"{what}: drew a zero-probability token"
    assert expected[keep].min() >= 5, f"{what}: too few draws for a chi-square test"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    p_value = stats.chi2.sf(stat, keep.sum() - 1)
    # a wrong distribution gives p ~ 0 with these sample sizes; 1e-4 keeps false alarms negligible
    assert p_value > 1e-4, f"{what}: chi-square p = {p_value:.2e}, counts {counts.tolist()}, expected {expected.tolist()}"


@pytest.mark.slow
def test_tree_with_deterministic_drafts_emits_target_distribution():
    """First emitted token ~ p_root; after accepting a child, the next token ~ p_child."""
    B, V, temp = 60_000, 5, 0.8
    # root children: 1, 1 (duplicate), 3; node 1 has child 4 (token 0); node 3 has child 5 (token 2)
    tokens = torch.tensor([[0, 1, 1, 3, 0, 2]]).expand(B, 6).contiguous()
    parents = torch.tensor([[-1, 0, 0, 0, 1, 3]], dtype=torch.int32).expand(B, 6).contiguous()
    base = torch.tensor([[0.3, 1.2, -0.5, 0.9, 0.1],
                         [1.0, -1.0, 0.2, 0.0, 0.5],
                         [0.0, 0.0, 0.0, 0.0, 0.0],
                         [-0.2, 0.4, 1.1, 0.3, -1.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0]])
    logits = base.expand(B, 6, V).contiguous()
    res = g.tree_verify(tokens, parents, logits, temperature=temp, uniforms=torch.rand(B, 6, 2), backend="torch")
    first = res.output_tokens[:, 0].numpy()
    chi_square(np.bincount(first, minlength=V), softmax64(base[0], temp), "first token")
    for child, token in ((1, 1), (3, 3)):
        took = (res.accepted_nodes[:, 0] == child).numpy()
        assert took.sum() == (first == token).sum(), "the lowest-index child holding the token is accepted"
        second = res.output_tokens[took, 1].numpy()
        chi_square(np.bincount(second, minlength=V), softmax64(base[child], temp), f"after child {child}")


@pytest.mark.slow
def test_chain_with_draft_probs_emits_target_sequence_distribution():
    """Drafts x1 ~ q0, x2 ~ q1(.|x1): emitted y1 ~ p0, and y2 | y1 ~ p1(.|y1) when a second token is emitted,
    y3 | y1, y2 ~ p2(.|y1, y2) when a third is."""
    rng = np.random.default_rng(5)
    B, V, temp = 60_000, 4, 1.3
    q0 = np.array([0.5, 0.3, 0.0, 0.2])  # token 2 is only reachable through the residual
    q1 = rng.dirichlet(np.ones(V), size=V)
    q1[1, 3] = 0
    q1 /= q1.sum(axis=1, keepdims=True)
    L0 = np.array([0.2, -0.4, 0.9, 0.0])
    L1 = rng.normal(size=(V, V))
    L2 = rng.normal(size=(V, V, V))
    x1 = rng.choice(V, size=B, p=q0)
    x2 = np.array([rng.choice(V, p=q1[a]) for a in x1])
    tokens = torch.from_numpy(np.stack([np.zeros(B, dtype=np.int64), x1, x2], axis=1))
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32).expand(B, 3).contiguous()
    logits = torch.from_numpy(np.stack([np.broadcast_to(L0, (B, V)), L1[x1], L2[x1, x2]], axis=1)).float()
    # q at node 2 is never used (a leaf has no child); give it an arbitrary distribution
    q = torch.from_numpy(np.stack([np.broadcast_to(q0, (B, V)), q1[x1], np.full((B, V), 1 / V)], axis=1)).float()
    res = g.tree_verify(tokens, parents, logits.contiguous(), temperature=temp, uniforms=torch.rand(B, 3, 2),
                        draft_probs=q.contiguous(), backend="torch")
    out = res.output_tokens.numpy()
    n = res.accept_len.numpy()
    chi_square(np.bincount(out[:, 0], minlength=V), softmax64(L0, temp), "y1")
    assert (n >= 1).sum() > 1000 and (n == 2).sum() > 1000
    for a in range(V):
        rows = (n >= 1) & (out[:, 0] == a)
        if rows.sum() > 200:
            chi_square(np.bincount(out[rows, 1], minlength=V), softmax64(L1[a], temp), f"y2 | y1={a}")
        for c in range(V):
            rows3 = (n == 2) & (out[:, 0] == a) & (out[:, 1] == c)
            if rows3.sum() > 400:
                chi_square(np.bincount(out[rows3, 2], minlength=V), softmax64(L2[a, c], temp), f"y3 | {a},{c}")


def test_inverse_cdf_extreme_uniforms():
    """u = 0 gives the first id with nonzero probability; u just below 1 the last one."""
    tokens = torch.tensor([[0]])
    parents = torch.tensor([[-1]], dtype=torch.int32)
    logits = torch.tensor([[[-math.inf, 0.0, 0.0, -math.inf]]])
    for u, want in ((0.0, 1), (1 - 2**-24, 2)):
        uniforms = torch.full((1, 1, 2), u)
        res = g.tree_verify(tokens, parents, logits, temperature=1.0, uniforms=uniforms, backend="torch")
        check_row(res, 0, [], [want])
