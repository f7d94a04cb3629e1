"""Triton tree_verify against the reference (SPEC §4.4, §6), under the interpreter on CPU.

Greedy decisions must match exactly; sampling decisions may part only at honest floating-point
boundaries (cases_tree_verify.assert_matches_reference).
"""
import importlib

import pytest
import torch
import triton

from gemma4_mtp_kernels import tree_verify
from gemma4_mtp_kernels.triton import tree_verify as triton_tree_verify
from gemma4_mtp_kernels.triton.tree_verify import BLOCK, chunk_size

# the package re-exports the op function under the module's name
tv = importlib.import_module("gemma4_mtp_kernels.triton.tree_verify")
counters_module = importlib.import_module("gemma4_mtp_kernels._counters")
from cases_tree_verify import (assert_matches_reference, bench_like_chains, cdf_boundary_case, cdf_boundary_ok,
                               draft_probs_chains_case, drafts_following, logits_for, random_tree, sampling_trees_case)

def check_against_reference(draft_tokens, parents, logits, **kw):
    impl_kw = kw.pop("impl_kw", None)  # backend-only knobs (chunk size): call the backend directly
    if impl_kw is None:
        got = tree_verify(draft_tokens, parents, logits, backend="triton", **kw)
    else:
        got = triton_tree_verify(draft_tokens, parents, logits, **impl_kw, **kw)
    ref = tree_verify(draft_tokens, parents, logits, backend="torch", **kw)
    got, ref = (type(r)(*(t.cpu() for t in r)) for r in (got, ref))  # a GPU run compares on the host
    cpu_kw = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    boundary_cases = assert_matches_reference(got, ref, draft_tokens.cpu(), parents.cpu(), logits.cpu(), **cpu_kw)
    return got, ref, boundary_cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [None, 512])
def test_greedy_trees(dtype, chunk):
    g = torch.Generator().manual_seed(1)
    B, N, V = 4, 9, 3001
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, dtype, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g)
    kw = {} if chunk is None else dict(impl_kw=dict(chunk=chunk))
    got, ref, _ = check_against_reference(tokens, parents, logits, **kw)
    assert int(ref.accept_len.max()) >= 2  # the walk goes deep somewhere


def test_greedy_ties_lowest_id_and_duplicate_children():
    V = 2000
    logits = torch.zeros(1, 4, V)
    logits[0, 0, [700, 1500]] = 5.0  # tie across chunks: 700 wins
    logits[0, 1, [3, 4]] = 1.0
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    tokens = torch.tensor([[9, 700, 700, 3]])  # node 1 and 2 both hold 700: node 1 wins
    got, ref, _ = check_against_reference(tokens, parents, logits, impl_kw=dict(chunk=512))
    assert got.accepted_nodes[0].tolist() == [1, 3, -1, -1]


def test_real_vocab_mixed_batch():
    g = torch.Generator().manual_seed(2)
    B, N, V = 2, 3, 262144
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=1.0)
    temperature = torch.tensor([0.0, 0.8])
    uniforms = torch.rand(B, N, 2, generator=g)
    got, ref, _ = check_against_reference(tokens, parents, logits, temperature=temperature, uniforms=uniforms)
    assert int(ref.accept_len[0]) == N - 1


@pytest.mark.parametrize("chunk", [None, 256])
def test_sampling_trees_mixed_with_greedy(chunk):
    tokens, parents, logits, kw = sampling_trees_case(1500, torch.Generator().manual_seed(3))
    if chunk is not None:
        kw["impl_kw"] = dict(chunk=chunk)
    check_against_reference(tokens, parents, logits, **kw)


def test_sampling_uniforms_on_cdf_boundaries_take_the_exception_path():
    """Uniforms set exactly to the reference's CDF values: the two implementations may now round to
    either side. Every difference must be an honest boundary case (checked), and identical rows
    still match."""
    tokens, parents, logits, kw = cdf_boundary_case(torch.Generator().manual_seed(4))
    _, _, boundary_cases = check_against_reference(tokens, parents, logits, impl_kw=dict(chunk=256), **kw)
    assert boundary_cases > 0  # the exception path really ran (its check is not vacuous)
    # ... and the check rejects a choice that is not on a boundary
    p = torch.softmax(logits[0, 0], 0)
    u = float(kw["uniforms"][0, 0, 0])
    t = int((torch.cumsum(p.double(), 0) > u).nonzero()[0])
    assert not cdf_boundary_ok(p, u, t, t + 40)


@pytest.mark.parametrize("chunk", [None, 512])
def test_chains_with_draft_probs(chunk):
    tokens, parents, logits, kw = draft_probs_chains_case(2100, torch.Generator().manual_seed(5))
    if chunk is not None:
        kw["impl_kw"] = dict(chunk=chunk)
    got, ref, _ = check_against_reference(tokens, parents, logits, **kw)
    assert int(ref.accept_len.sum()) > 0 and bool((ref.accept_len < parents.shape[1] - 1).any())


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(1, 8), (16, 5)])
def test_real_vocab_on_gpu(B, N):
    g = torch.Generator().manual_seed(7)
    V = 262144
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=0.8)
    temperature = (torch.rand(B, generator=g) * 1.5) * (torch.arange(B) % 2)  # even rows greedy
    uniforms = torch.rand(B, N, 2, generator=g)
    cuda = dict(temperature=temperature.cuda(), uniforms=uniforms.cuda())
    check_against_reference(tokens.cuda(), parents.cuda(), logits.cuda(), **cuda)
    chain = random_tree(B, N, g, chain=True)
    q = torch.softmax(logits.float() * 0.9, -1)
    check_against_reference(tokens.cuda(), chain.cuda(), logits.cuda(), draft_probs=q.cuda(), **cuda)


def test_single_node_and_padding_only():
    g = torch.Generator().manual_seed(6)
    logits = logits_for(3, 1, 700, torch.float16, g)
    parents = torch.full((3, 1), -1, dtype=torch.int32)
    tokens = torch.zeros(3, 1, dtype=torch.int32)
    check_against_reference(tokens, parents, logits, temperature=torch.tensor([0.0, 1.0, 0.3]),
                            uniforms=torch.rand(3, 1, 2, generator=g))
    parents = torch.tensor([[-1, -1, -1]], dtype=torch.int32)
    check_against_reference(torch.zeros(1, 3, dtype=torch.int64), parents, logits_for(1, 3, 700, torch.float32, g))


def test_chunk_size_fills_the_gpu():
    assert triton.cdiv(262144, chunk_size(8, 262144, 132)) * 8 >= 4 * 132  # B = 1, N = 8
    assert triton.cdiv(262144, chunk_size(40, 262144, 132)) * 40 >= tv.PROGRAMS_PER_SM * 132  # B = 8, N = 5
    assert chunk_size(320, 262144, 132) == tv.MAX_CHUNK  # B = 64: long programs, still > 12 per SM
    assert chunk_size(1, 100, 132) == BLOCK


@pytest.mark.parametrize("chunk", [None, 256])
@pytest.mark.parametrize("bad", ["-inf", "nan", "one nan"])
def test_sampling_row_without_mass_gives_token_minus_one(chunk, bad):
    """A sampling row with no distribution (all -inf logits, or a NaN) is refused by the op's value
    checks, which do not run on the GPU by default: the backend must then emit the bonus token -1
    (and stop), never an unwritten sample slot. Called on the backend directly, as an unchecked
    CUDA call reaches it."""
    g = torch.Generator().manual_seed(11)
    B, N, V = 3, 3, 1000
    logits = logits_for(B, N, V, torch.float32, g)
    if bad == "one nan":
        logits[1, 0, 777] = float("nan")
    else:
        logits[1, 0] = float(bad)
    parents = random_tree(B, N, g, chain=True)
    tokens = drafts_following(logits.argmax(-1), parents, V, g, hit=0.0)
    kw = dict(temperature=torch.ones(B), uniforms=torch.rand(B, N, 2, generator=g))
    kw.update({} if chunk is None else dict(chunk=chunk))
    for _ in range(3):  # fresh, unpoisoned scratch each time
        got = triton_tree_verify(tokens, parents, logits, **kw)
        assert got.output_tokens[1].tolist() == [-1] * N and int(got.accept_len[1]) == 0
        assert int(got.last_node[1]) == 0 and got.accepted_nodes[1].tolist() == [-1] * N
        assert bool((got.output_tokens[[0, 2], 0] >= 0).all())


def counters_left(dev):
    return int(counters_module.zeroed_counters(torch.device(dev), 1, tv.COUNTER_OWNER).count_nonzero())


@pytest.mark.parametrize("case", ["sampling", "draft_probs"])
@pytest.mark.parametrize("chunk", [None, 128])
def test_counters_are_reset_so_calls_replay(chunk, case):
    """The single launch elects each row's and each request's last program with counters that the
    kernel itself resets (no memset between calls, so a CUDA graph can replay it): after a call
    every counter is 0 again (with draft_probs: the ticket, the row states and the phase B counters
    too), and a second call gives the same, correct result."""
    g = torch.Generator().manual_seed(12)
    if case == "sampling":
        tokens, parents, logits, kw = sampling_trees_case(1500, g)
    else:
        tokens, parents, logits, kw = bench_like_chains(4, 5, 1500, torch.bfloat16, g, torch.bfloat16)
    kw["impl_kw"] = {} if chunk is None else dict(chunk=chunk)
    first, _, _ = check_against_reference(tokens, parents, logits, **kw)
    assert counters_left("cpu") == 0
    second, _, _ = check_against_reference(tokens, parents, logits, **kw)
    assert counters_left("cpu") == 0
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["greedy", "sampling", "draft_probs"])
def test_many_programs_per_row(case):
    """64-id chunks: 16-33 programs share each row, so the row decision (made by the row's last
    program from the others' published statistics: argmax across chunks, the crossing chunk of the
    CDF, the per-chunk residual masses) and the walk (by the request's last decided row) read
    values other programs wrote. Mixed greedy and sampling rows; draft_probs chains."""
    g = torch.Generator().manual_seed(13)
    if case == "greedy":
        B, N, V = 3, 6, 1000
        parents = random_tree(B, N, g)
        logits = logits_for(B, N, V, torch.float32, g)
        tokens = drafts_following(logits.argmax(-1), parents, V, g, hit=0.9)
        kw = {}
    elif case == "sampling":
        tokens, parents, logits, kw = sampling_trees_case(1200, g)
    else:
        tokens, parents, logits, kw = draft_probs_chains_case(2100, g)
    _, ref, _ = check_against_reference(tokens, parents, logits, impl_kw=dict(chunk=64), **kw)
    assert int(ref.accept_len.sum()) > 0  # the walks go past the root somewhere
    assert counters_left("cpu") == 0


def test_counter_workspace_grows_and_keeps_outgrown_buffers():
    """A call needing more counters than cached gets a larger zeroed buffer; the smaller one stays
    alive (a captured graph may still address it). Each owner has its own buffer."""
    dev = torch.device("cpu")
    small = counters_module.zeroed_counters(dev, 1, "test.owner")
    assert counters_module.zeroed_counters(dev, small.numel(), "test.owner") is small
    assert counters_module.zeroed_counters(dev, 1, "test.other owner") is not small
    big = counters_module.zeroed_counters(dev, small.numel() + 1, "test.owner")
    assert big.numel() > small.numel() and int(big.count_nonzero()) == 0
    assert counters_module.zeroed_counters(dev, 1, "test.owner") is big
    assert any(t is small for t in counters_module._OUTGROWN)


@pytest.mark.gpu
def test_counters_are_per_stream():
    """Launches on two streams may overlap in time: each stream gets its own counters (a launch on one
    stream never shares them with a launch still running on another)."""
    dev = torch.device("cuda")
    mine = counters_module.zeroed_counters(dev, 1, "test.owner")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        theirs = counters_module.zeroed_counters(dev, 1, "test.owner")
        assert counters_module.zeroed_counters(dev, 1, "test.owner") is theirs
    assert theirs is not mine and counters_module.zeroed_counters(dev, 1, "test.owner") is mine
    # a tensor's device names its index, a caller's may not: both are the one device's buffer
    assert counters_module.zeroed_counters(torch.empty(1, device=dev).device, 1, "test.owner") is mine


@pytest.mark.gpu
def test_a_capture_after_its_warm_up_takes_the_graphs_counters():
    """A graph replays on any stream: captured launches take the graphs' buffer, which the eager
    warm-up made ready, so the capture allocates nothing (no zeroing node in the graph); without a
    warm-up big enough the capture gets a graph-private buffer that is not cached."""
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        eager = counters_module.zeroed_counters(dev, 5000, "test.capture")
    graphs = counters_module._CACHE[(torch.device("cuda", torch.cuda.current_device()), counters_module._GRAPHS,
                                     "test.capture")]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = counters_module.zeroed_counters(dev, 5000, "test.capture")
        bigger = counters_module.zeroed_counters(dev, 9000, "test.capture")
    assert captured is graphs and captured is not eager and int(graphs.count_nonzero()) == 0
    assert bigger.numel() >= 9000 and counters_module._CACHE[(graphs.device, counters_module._GRAPHS, "test.capture")] is graphs


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_rejections_draw_from_the_residual_in_parallel(q_dtype):
    """Most nodes reject (q unrelated to p): each rejected row's residual mass is summed per granule
    by its phase B programs (ticket order, after the row's decision), and its last B program draws
    the bonus; 12 chunks per row."""
    tokens, parents, logits, kw = bench_like_chains(4, 5, 3000, torch.bfloat16, torch.Generator().manual_seed(14),
                                                    q_dtype)
    _, ref, _ = check_against_reference(tokens, parents, logits, impl_kw=dict(chunk=256), **kw)
    assert bool((ref.accept_len < 4).any()) and int(ref.accept_len.sum()) > 0
    assert counters_left("cpu") == 0


def test_chunk_override_must_tile_the_granules():
    tokens, parents, logits, _ = sampling_trees_case(1500, torch.Generator().manual_seed(15))
    with pytest.raises(ValueError, match="chunk"):
        triton_tree_verify(tokens, parents, logits, chunk=300)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_residual_phase_on_gpu(q_dtype):
    """The benchmark's sampled-chain case at the real vocabulary: phase B programs really wait for
    their rows' decisions while other programs run (the interpreter runs them one after another)."""
    tokens, parents, logits, kw = bench_like_chains(8, 5, 262144, torch.bfloat16, torch.Generator().manual_seed(16),
                                                    q_dtype)
    cuda = {k: v.cuda() for k, v in kw.items()}
    for _ in range(2):  # the counters come back to zero
        check_against_reference(tokens.cuda(), parents.cuda(), logits.cuda(), **cuda)
