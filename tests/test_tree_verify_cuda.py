"""CUDA tree_verify against the reference (SPEC §4.4, §6). Needs a GPU (marked `gpu`).

Greedy decisions must match exactly. Sampling decisions must match except at honest floating-point
boundaries (cases_tree_verify.assert_matches_reference): where the two walks first part, the
uniform must lie within EPS of the boundary that separates the two choices.
"""
import pytest
import torch

from gemma4_mtp_kernels import _checks as checks
from gemma4_mtp_kernels import cuda as cuda_backend
from gemma4_mtp_kernels import tree_verify
from gemma4_mtp_kernels._types import VerifyResult
from cases_tree_verify import (assert_matches_reference, bench_like_chains, cdf_boundary_case, draft_probs_chains_case,
                               drafts_following, logits_for, random_tree, sampling_trees_case)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def check(draft_tokens, parents, logits, *, temperature=None, uniforms=None, draft_probs=None):
    kw = dict(temperature=temperature, uniforms=uniforms, draft_probs=draft_probs)
    dev_kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = tree_verify(draft_tokens.to(DEV), parents.to(DEV), logits.to(DEV), backend="cuda", **dev_kw)
    assert got.accept_len.dtype == torch.int32 and got.accepted_nodes.dtype == torch.int32
    assert got.output_tokens.dtype == torch.int64 and got.last_node.dtype == torch.int32
    got = type(got)(*(t.cpu() for t in got))
    ref = tree_verify(draft_tokens, parents, logits, backend="torch", **kw)
    boundary = assert_matches_reference(got, ref, draft_tokens, parents, logits, **kw)
    return got, ref, boundary


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,N,V", [(4, 9, 3001), (1, 8, 262144), (16, 4, 262144), (3, 1, 50)])
def test_greedy_trees(B, N, V, dtype):
    g = torch.Generator().manual_seed(1)
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, dtype, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g)
    check(tokens, parents, logits)


def test_greedy_chains_accept_fully():
    g = torch.Generator().manual_seed(7)
    B, N, V = 3, 6, 262144
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=1.0)
    got, _, _ = check(tokens, parents, logits)
    assert got.accept_len.tolist() == [N - 1] * B


def test_greedy_ties_lowest_id_and_duplicate_children():
    V = 20000  # the tie spans chunks of the grid
    logits = torch.zeros(1, 4, V)
    logits[0, 0, [700, 15000]] = 5.0
    logits[0, 1, [3, 4]] = 1.0
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    tokens = torch.tensor([[9, 700, 700, 3]])
    got, _, _ = check(tokens, parents, logits)
    assert got.accepted_nodes[0].tolist() == [1, 3, -1, -1]


@pytest.mark.parametrize("V", [1500, 262144])
def test_sampling_trees_mixed_with_greedy(V):
    tokens, parents, logits, kw = sampling_trees_case(V, torch.Generator().manual_seed(3))
    check(tokens, parents, logits, **kw)


def test_sampling_uniforms_on_cdf_boundaries_take_the_exception_path():
    tokens, parents, logits, kw = cdf_boundary_case(torch.Generator().manual_seed(4))
    check(tokens, parents, logits, **kw)


@pytest.mark.parametrize("V", [2100, 262144])
def test_chains_with_draft_probs(V):
    tokens, parents, logits, kw = draft_probs_chains_case(V, torch.Generator().manual_seed(5))
    _, ref, _ = check(tokens, parents, logits, **kw)
    assert int(ref.accept_len.sum()) > 0 and bool((ref.accept_len < parents.shape[1] - 1).any())


def test_temperature_without_uniforms_all_greedy():
    """With value checks on, an all-zero temperature needs no uniforms; the rows are greedy."""
    g = torch.Generator().manual_seed(6)
    parents = random_tree(2, 5, g)
    logits = logits_for(2, 5, 999, torch.float32, g)
    tokens = drafts_following(logits.argmax(-1), parents, 999, g)
    before = checks._value_checks_on_cuda
    checks.set_value_checks(True)
    try:
        got = tree_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV), temperature=0.0, backend="cuda")
    finally:
        checks.set_value_checks(before)
    ref = tree_verify(tokens, parents, logits, backend="torch")
    assert torch.equal(got.output_tokens.cpu(), ref.output_tokens)


def test_repeated_launches_reuse_the_counters():
    """The in-kernel counters are reset by the CTAs that consume them: back-to-back launches and a
    replayed CUDA graph keep giving the reference's answer."""
    g = torch.Generator().manual_seed(8)
    B, N, V = 4, 6, 70000
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g)
    for _ in range(3):
        check(tokens, parents, logits)
    d_tokens, d_parents, d_logits = tokens.to(DEV), parents.to(DEV), logits.to(DEV)
    tree_verify(d_tokens, d_parents, d_logits, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = tree_verify(d_tokens, d_parents, d_logits, backend="cuda")
    for seed in range(3):
        gg = torch.Generator().manual_seed(100 + seed)
        new_logits = logits_for(B, N, V, torch.bfloat16, gg)
        d_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        ref = tree_verify(tokens, parents, new_logits, backend="torch")
        assert torch.equal(res.output_tokens.cpu(), ref.output_tokens)
        assert torch.equal(res.accept_len.cpu(), ref.accept_len)


def test_torch_compile_fullgraph():
    g = torch.Generator().manual_seed(9)
    parents = random_tree(2, 5, g)
    logits = logits_for(2, 5, 5000, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, 5000, g)

    def verify(t, p, lg):
        r = tree_verify(t, p, lg, backend="cuda")
        return r.output_tokens, r.accept_len

    out, n = torch.compile(verify, fullgraph=True)(tokens.to(DEV), parents.to(DEV), logits.to(DEV))
    ref = tree_verify(tokens, parents, logits, backend="torch")
    assert torch.equal(out.cpu(), ref.output_tokens) and torch.equal(n.cpu(), ref.accept_len)


@pytest.mark.parametrize("sampling", [False, True])
def test_opcheck(sampling):
    g = torch.Generator().manual_seed(10)
    B, N, V = 2, 4, 300
    parents = random_tree(B, N, g, chain=True).to(DEV)
    logits = logits_for(B, N, V, torch.float32, g).to(DEV)
    tokens = torch.randint(0, V, (B, N), generator=g).to(DEV)
    temp = torch.ones(B, device=DEV) if sampling else None
    uni = torch.rand(B, N, 2, generator=g).to(DEV) if sampling else None
    dp = torch.softmax(torch.randn(B, N, V, generator=g), -1).to(DEV) if sampling else None
    outs = (torch.empty(B, dtype=torch.int32, device=DEV), torch.empty(B, N, dtype=torch.int32, device=DEV),
            torch.empty(B, N, dtype=torch.int64, device=DEV), torch.empty(B, dtype=torch.int32, device=DEV))
    cuda_backend._ops()
    torch.library.opcheck(torch.ops.gemma4_mtp.tree_verify.default, (tokens, parents, logits, temp, uni, dp, *outs))


# ---- the one-launch kernel's paths (granules, chunks of several batches, phase B, scalar loads) ----

SENTINEL = -77  # no answer of the op: every output element must be overwritten


def run_op_poisoned(draft_tokens, parents, logits, *, temperature=None, uniforms=None, draft_probs=None):
    """The custom op itself with sentinel-filled outputs (the wrapper allocates them empty)."""
    B, N = parents.shape
    outs = VerifyResult(torch.full((B,), SENTINEL, dtype=torch.int32, device=DEV),
                        torch.full((B, N), SENTINEL, dtype=torch.int32, device=DEV),
                        torch.full((B, N), SENTINEL, dtype=torch.int64, device=DEV),
                        torch.full((B,), SENTINEL, dtype=torch.int32, device=DEV))
    cuda_backend._ops()
    dev = [None if t is None else t.to(DEV) for t in (temperature, uniforms, draft_probs)]
    torch.ops.gemma4_mtp.tree_verify(draft_tokens.to(DEV), parents.to(DEV), logits.to(DEV), *dev, *outs)
    return VerifyResult(*(t.cpu() for t in outs))


def check_poisoned(draft_tokens, parents, logits, **kw):
    got = run_op_poisoned(draft_tokens, parents, logits, **kw)
    cpu_kw = {k: v.cpu() for k, v in kw.items() if v is not None}
    ref = tree_verify(draft_tokens.cpu(), parents.cpu(), logits.cpu(), backend="torch", **cpu_kw)
    assert not any(bool((t == SENTINEL).any()) for t in got), "an output element was never written"
    boundary = assert_matches_reference(got, ref, draft_tokens.cpu(), parents.cpu(), logits.cpu(), **cpu_kw)
    return got, ref, boundary


# 8 x 5 rows: one batch of loads per CTA; 40 x 5: chunks of 4 batches (on 132 SMs)
@pytest.mark.parametrize("B,N,q_dtype", [(8, 5, torch.bfloat16), (8, 5, torch.float32), (40, 5, torch.bfloat16)])
def test_draft_probs_residual_phase(B, N, q_dtype):
    """Rejected nodes draw from max(p - q, 0), summed per granule by the phase B CTAs after they wait
    for their row's decision; q read in the logits' dtype (bf16) or fp32."""
    tokens, parents, logits, kw = bench_like_chains(B, N, 262144, torch.bfloat16, torch.Generator().manual_seed(21),
                                                    q_dtype)
    got, ref, _ = check_poisoned(tokens, parents, logits, **kw)
    rejected = ref.accept_len < N - 1
    assert bool(rejected.any()) and int(ref.accept_len.sum()) > 0


def test_draft_probs_fp16_logits_with_bf16_q():
    """A q dtype that is neither fp32 nor the logits' is converted by the wrapper (exactly)."""
    tokens, parents, logits, kw = bench_like_chains(4, 4, 5000, torch.float16, torch.Generator().manual_seed(22),
                                                    torch.bfloat16)
    got = tree_verify(tokens.to(DEV), parents.to(DEV), logits.to(DEV), backend="cuda",
                      **{k: v.to(DEV) for k, v in kw.items()})
    got = VerifyResult(*(t.cpu() for t in got))
    ref = tree_verify(tokens, parents, logits, backend="torch", **kw)
    assert_matches_reference(got, ref, tokens, parents, logits, **kw)


# chunks of 4 (bf16, 32 batches per row) and 2 (fp32, 64 per row) batches of loads per CTA on 132 SMs
@pytest.mark.parametrize("B,N,dtype", [(64, 5, torch.bfloat16), (8, 5, torch.float32)])
def test_long_chunks_greedy_and_sampling(B, N, dtype):
    """Large batches take chunks of several load batches per CTA (the double-buffered loop) and up to
    512 granules per row (fp32)."""
    g = torch.Generator().manual_seed(23)
    V = 262144
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, dtype, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=0.8)
    check_poisoned(tokens, parents, logits)
    temperature = (torch.rand(B, generator=g) + 0.3) * (torch.arange(B) % 3 != 0)  # every third row greedy
    check_poisoned(tokens, parents, logits, temperature=temperature, uniforms=torch.rand(B, N, 2, generator=g))


@pytest.mark.parametrize("what", ["logits", "draft_probs", "both"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unaligned_views_take_the_scalar_kernel(what, dtype):
    """A logits or q view that starts one element into its storage cannot use 16-byte loads: the
    launcher picks the scalar-load kernel (never a misaligned access)."""
    tokens, parents, logits, kw = bench_like_chains(3, 4, 20000, dtype, torch.Generator().manual_seed(24),
                                                    dtype)

    def shifted(t):
        storage = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=DEV)
        view = storage[1:].view(t.shape)
        view.copy_(t.to(DEV))
        return view

    d_logits = shifted(logits) if what in ("logits", "both") else logits.to(DEV)
    kw_dev = {k: v.to(DEV) for k, v in kw.items()}
    if what in ("draft_probs", "both"):
        kw_dev["draft_probs"] = shifted(kw["draft_probs"])
    got = run_op_poisoned(tokens, parents, d_logits, **kw_dev)
    ref = tree_verify(tokens, parents, logits, backend="torch", **kw)
    assert_matches_reference(got, ref, tokens, parents, logits, **kw)


def test_walk_longer_than_the_shared_window():
    """Chains of 300 nodes: the walk reads the decisions of nodes past the first 256 from global memory."""
    g = torch.Generator().manual_seed(25)
    B, N, V = 2, 300, 1000
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.float32, g)
    tokens = drafts_following(logits.argmax(-1), parents, V, g, hit=1.0)
    tokens[1, 280] = (tokens[1, 280] + 1) % V  # request 1 stops at node 279
    got, ref, _ = check_poisoned(tokens, parents, logits)
    assert ref.accept_len.tolist() == [N - 1, 279]


def test_draft_probs_launches_replay_in_a_graph():
    """The ticket, the row states and the phase B counters are reset in-kernel too: repeated draft
    launches and a replayed graph keep matching the reference."""
    g = torch.Generator().manual_seed(26)
    tokens, parents, logits, kw = bench_like_chains(6, 5, 70000, torch.bfloat16, g, torch.bfloat16)
    for _ in range(3):
        check_poisoned(tokens, parents, logits, **kw)
    d = {k: v.to(DEV) for k, v in kw.items()}
    d_tokens, d_parents, d_logits = tokens.to(DEV), parents.to(DEV), logits.to(DEV)
    tree_verify(d_tokens, d_parents, d_logits, backend="cuda", **d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = tree_verify(d_tokens, d_parents, d_logits, backend="cuda", **d)
    for seed in range(3):
        gg = torch.Generator().manual_seed(200 + seed)
        new_logits = logits_for(6, 5, 70000, torch.bfloat16, gg)
        new_uniforms = torch.rand(6, 5, 2, generator=gg)
        d_logits.copy_(new_logits)
        d["uniforms"].copy_(new_uniforms)
        graph.replay()
        torch.cuda.synchronize()
        ref = tree_verify(tokens, parents, new_logits, backend="torch", **{**kw, "uniforms": new_uniforms})
        got = VerifyResult(*(t.cpu() for t in res))
        assert_matches_reference(got, ref, tokens, parents, new_logits, **{**kw, "uniforms": new_uniforms})
