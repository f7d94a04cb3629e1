"""tree_verify test inputs and the comparison with the reference shared by every backend's tests.

Greedy decisions must match exactly (argmax of the same values). Sampling decisions must match
except at honest floating-point boundaries: where the two walks first part, the test recomputes the
reference's distribution at that node and asserts that the uniform lies within EPS of the boundary
that separates the two choices (a CDF value, or p(x)/q(x) for the accept test).
"""
import torch

EPS = 2e-5  # fp32 softmax/cumsum rounding over a few thousand ids


def random_tree(B, N, g, chain=False):
    parents = torch.full((B, N), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(1, N):
            if chain:
                parents[b, i] = i - 1
            elif torch.rand(1, generator=g).item() < 0.15:
                parents[b, i] = -1  # padding slot
            else:
                used = [j for j in range(i) if j == 0 or parents[b, j] >= 0]
                parents[b, i] = used[int(torch.randint(len(used), (1,), generator=g))]
    return parents


def drafts_following(target_choice, parents, V, g, hit=0.6):
    """Draft tokens that agree with `target_choice[b, parent]` often enough to walk deep, plus
    duplicate children (the lowest index must win)."""
    B, N = parents.shape
    tokens = torch.randint(0, V, (B, N), generator=g)
    for b in range(B):
        for i in range(1, N):
            p = int(parents[b, i])
            if p >= 0 and torch.rand(1, generator=g).item() < hit:
                tokens[b, i] = int(target_choice[b, p])
    return tokens


def cdf_boundary_ok(probs, u, t_a, t_b):
    """Both ids are honest inverse-CDF answers for u: every CDF value between them is within EPS of u."""
    cdf = torch.cumsum(probs.double(), 0)
    lo, hi = sorted((int(t_a), int(t_b)))
    return bool(((cdf[lo:hi] - u).abs() <= EPS).all())


def logits_for(B, N, V, dtype, g):
    return (torch.randn(B, N, V, generator=g) * 3).to(dtype)


def assert_matches_reference(got, ref, draft_tokens, parents, logits, *, temperature=None, uniforms=None,
                             draft_probs=None):
    """Row by row: identical results, or a sampling row whose walks part at an honest boundary.
    Returns the number of boundary rows."""
    q = draft_probs
    B, N = parents.shape
    boundary_cases = 0
    for b in range(B):
        if (torch.equal(got.output_tokens[b], ref.output_tokens[b])
                and torch.equal(got.accepted_nodes[b], ref.accepted_nodes[b])):
            assert got.accept_len[b] == ref.accept_len[b] and got.last_node[b] == ref.last_node[b]
            continue
        temp = 0.0 if temperature is None else float(temperature[b])
        assert temp > 0, f"greedy row {b} differs: {got.output_tokens[b]} vs {ref.output_tokens[b]}"
        # first step where the walks part; both walks sit at the same node there
        j = int((got.output_tokens[b] != ref.output_tokens[b]).nonzero()[0])
        node = 0 if j == 0 else int(ref.accepted_nodes[b, j - 1])
        p = torch.softmax(logits[b, node].float() / temp, 0)
        t_got, t_ref = int(got.output_tokens[b, j]), int(ref.output_tokens[b, j])
        if q is None:
            assert cdf_boundary_ok(p, float(uniforms[b, node, 0]), t_got, t_ref), (b, node, t_got, t_ref)
        else:
            kids = (parents[b] == node).nonzero().flatten().tolist()
            kids = [k for k in kids if k > 0]
            u0, u1 = float(uniforms[b, node, 0]), float(uniforms[b, node, 1])
            if not kids:  # leaf bonus from p
                assert cdf_boundary_ok(p, u1, t_got, t_ref), (b, node, t_got, t_ref)
            else:
                x = int(draft_tokens[b, kids[0]])
                qx = float(q[b, node, x])
                accepted_got = j < int(got.accept_len[b])
                accepted_ref = j < int(ref.accept_len[b])
                if accepted_got != accepted_ref:
                    ratio = float(p[x]) / qx
                    assert abs(u0 - ratio) <= EPS * max(1.0, ratio), (b, node, u0, ratio)
                else:  # both rejected, residual samples differ
                    res = (p - q[b, node].float()).clamp(min=0)
                    assert cdf_boundary_ok(res / res.sum(), u1, t_got, t_ref), (b, node, t_got, t_ref)
        boundary_cases += 1
    return boundary_cases


def sampling_trees_case(V, g):
    """6 trees of 7 nodes, greedy and sampling rows mixed, drafts mostly equal to samples of the
    target's own distribution (so sampling rows accept too). Returns (tokens, parents, logits, kw)."""
    B, N = 6, 7
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, torch.bfloat16, g) * 0.5
    temperature = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    uniforms = torch.rand(B, N, 2, generator=g)
    ref_samples = torch.stack([torch.stack([
        torch.multinomial(torch.softmax(logits[b, i].float() / max(float(temperature[b]), 1e-3), 0), 1, generator=g)[0]
        for i in range(N)]) for b in range(B)])
    tokens = drafts_following(ref_samples, parents, V, g, hit=0.9)
    return tokens, parents, logits, dict(temperature=temperature, uniforms=uniforms)


def cdf_boundary_case(g):
    """8 chains of 3 nodes whose uniforms sit exactly on the reference's CDF values (fp32-rounded, so
    just above or below), where implementations may honestly part. Returns (tokens, parents, logits, kw)."""
    B, N, V = 8, 3, 800
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.float32, g)
    temperature = torch.full((B,), 1.0)
    uniforms = torch.rand(B, N, 2, generator=g)
    for b in range(B):
        for i in range(N):
            cdf = torch.cumsum(torch.softmax(logits[b, i], 0).double(), 0)
            uniforms[b, i, 0] = float(cdf[int(torch.randint(V // 4, V // 2, (1,), generator=g))])
    tokens = drafts_following(logits.argmax(-1), parents, V, g, hit=0.0)
    return tokens, parents, logits, dict(temperature=temperature, uniforms=uniforms)


def draft_probs_chains_case(V, g):
    """6 chains of 5 nodes drafted from q: a row with p == q (empty residual), a q that is 0 on half
    the vocabulary (those drafts always rejected), a greedy row. Returns (tokens, parents, logits, kw)."""
    B, N = 6, 5
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.bfloat16, g) * 0.3
    q = torch.softmax(logits.float() * 0.8 + torch.randn(B, N, V, generator=g) * 0.3, -1)
    q[1, 0] = torch.softmax(logits[1, 0].float(), 0)  # p == q at T = 1: residual empty, sample from p
    q[2, 1, :] = 0
    q[2, 1, :V // 2] = 2.0 / V  # q(x) = 0 for half the vocabulary
    tokens = torch.stack([torch.stack([torch.multinomial(q[b, max(i - 1, 0)], 1, generator=g)[0] for i in range(N)])
                          for b in range(B)])
    temperature = torch.tensor([1.0, 1.0, 0.7, 0.0, 1.3, 1.0])
    uniforms = torch.rand(B, N, 2, generator=g)
    return tokens, parents, logits, dict(temperature=temperature, uniforms=uniforms, draft_probs=q.to(torch.bfloat16))


def bench_like_chains(B, N, V, dtype, g, q_dtype):
    """The benchmark's sampled-chain case: q unrelated to p, so nearly every node rejects and draws
    its bonus from the residual (phase B), and requests whose q is close to p (chains that accept, and
    leaves that sample p). Returns (tokens, parents, logits, kw)."""
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, dtype, g)
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    p = torch.softmax(logits.float() / 0.8, -1)
    q[: B // 2] = p[: B // 2] * 0.7 + q[: B // 2] * 0.3  # half the requests draft close to p: accepts
    tokens = torch.stack([torch.stack([torch.multinomial(q[b, max(i - 1, 0)], 1, generator=g)[0] for i in range(N)])
                          for b in range(B)])
    kw = dict(temperature=torch.full((B,), 0.8), uniforms=torch.rand(B, N, 2, generator=g),
              draft_probs=q.to(q_dtype))
    return tokens, parents, logits, kw
