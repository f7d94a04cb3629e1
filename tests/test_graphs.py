"""gemma4_mtp.graphs on CPU: the draft round that is captured as a CUDA graph, run eagerly.

`draft_tree` (device-only bookkeeping) must draft exactly the tree the per-request reference builds
(one drafter step per node level of one request at a time, host lists, as the decode loop did before
rounds were captured); `DraftGraphs(capture=False)` runs the same round from its static buffers
(bucket padding, block tables widened, stale rows of a larger earlier batch) and must agree with it.
The capture itself and the replay are checked on a GPU in test_graphs_cuda.py."""
import numpy as np
import pytest
import torch

import hf_tiny
from helpers import tree_path
from gemma4_mtp import load_drafter, load_target, speculative_generate
from gemma4_mtp.graphs import DraftGraphs, DraftSampling, TargetGraphs, draft_tree, level_sizes, tree_parents

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "centroids"])
def pair(request, tmp_path_factory):
    tp, dp = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    hf_tiny.build_agreeing_pair(tp, dp, seed=3, ordered=request.param)
    return load_target(tp, block_size=4, num_blocks=256), load_drafter(dp, backend="torch")


def test_tree_layout():
    assert level_sizes((2, 2, 1)) == [2, 4, 4]
    assert tree_parents((2, 2, 1)) == [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert tree_parents((1, 1, 1)) == [-1, 0, 1, 2]
    assert tree_parents(()) == [-1]


def per_request_tree(drafter, ctx, pending, hidden, widths):
    """The reference: each request alone, each node level as one step, children in node order."""
    out = []
    for b in range(pending.shape[0]):
        one = ctx.select([b])
        tokens, level_tok, level_hid = [int(pending[b])], pending[b].view(1, 1), hidden[b].view(1, 1, -1)
        for w in widths:
            last, proj = drafter.step(one, level_tok, level_hid)
            kids = drafter.top_tokens(last, w)[0]  # [Q, w]
            tokens += kids.reshape(-1).tolist()
            level_tok = kids.reshape(1, -1)
            level_hid = proj.repeat_interleave(w, dim=1)
        out.append(tokens)
    return torch.tensor(out)


def prefilled(target, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    reqs = [target.new_request() for _ in lengths]
    out = target.prefill(reqs, [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in lengths], last_only=True)
    pending = torch.randint(3, hf_tiny.VOCAB, (len(lengths),), generator=g)
    return reqs, pending, out.hidden[:, 0]


@pytest.mark.parametrize("widths", [(1, 1, 1, 1), (2, 2, 1), (3, 1)], ids=str)
def test_draft_tree_is_the_per_request_tree(pair, widths):
    target, drafter = pair
    reqs, pending, hidden = prefilled(target, (13, 5, 9), seed=len(widths))
    try:
        ctx = drafter.context(target, reqs)
        got = draft_tree(drafter, ctx, pending, hidden, widths)
        assert got.shape == (3, len(tree_parents(widths)))
        assert torch.equal(got, per_request_tree(drafter, ctx, pending, hidden, widths))
    finally:
        for r in reqs:
            target.release(r)


def test_static_buffers_agree_with_the_round(pair):
    """The graph runner's own path without the capture: padded buckets (3 rows in 4, then 2 after
    a batch of 5 left stale rows in a bucket of 8), block tables narrower than the static ones."""
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(1, 4, 8), capture=False, keep_after=1)
    for lengths, widths in (((13, 5, 9), (2, 2, 1)), ((7, 30, 2, 11, 4), (1, 1, 1)), ((6, 21), (1, 1, 1)),
                            ((17,), (2, 1))):
        reqs, pending, hidden = prefilled(target, lengths, seed=sum(lengths))
        try:
            ctx = drafter.context(target, reqs, "next")
            got = runner.draft(ctx, pending, hidden, widths)
            assert torch.equal(got, draft_tree(drafter, ctx, pending, hidden, widths)), (lengths, widths)
        finally:
            for r in reqs:
                target.release(r)
    assert len(runner.rounds) == 4 and runner.captures == 0


@torch.no_grad()
def per_request_sampled_chain(drafter, ctx, pending, hidden, temperature, uniforms):
    """The reference of a sampled chain: each request alone, q = softmax(logits / T) in fp64 from the
    drafter's dense logits, the token where numpy's cumulative sum of q first exceeds the uniform.
    Returns (tokens [B, 1 + depth], q [B, depth, V] fp64)."""
    tokens, probs = [], []
    for b in range(pending.shape[0]):
        one = ctx.select([b])
        row, qs, tok, hid = [int(pending[b])], [], pending[b].view(1, 1), hidden[b].view(1, 1, -1)
        for u in uniforms[b].tolist():
            last, proj = drafter.step(one, tok, hid)
            q = torch.softmax(drafter.logits(last)[0, 0].double() / float(temperature[b]), dim=0)
            t = int(np.searchsorted(np.cumsum(q.numpy()), u, side="right"))
            row.append(t)
            qs.append(q)
            tok, hid = torch.tensor([[t]]), proj
        tokens.append(row)
        probs.append(torch.stack(qs))
    return torch.tensor(tokens), torch.stack(probs)


def test_sampled_chain_is_the_per_request_draw(pair):
    """A sampled chain (DraftSampling) drafts, request by request, the inverse-CDF draw of the drafter's
    q at the given uniforms and hands back q (the leaf row untouched); the graph runner's static
    buffers (3 rows in a bucket of 4, then 1 after them) draft the same; a tree is refused."""
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(1, 4), capture=False, keep_after=1)
    V = drafter.config.text.vocab_size
    for lengths, temperature in (((13, 5, 9), (0.7, 1.0, 1.6)), ((8,), (1.3,)), ((6, 11, 4), (1.0, 0.5, 2.0))):
        reqs, pending, hidden = prefilled(target, lengths, seed=sum(lengths))
        B, depth = len(lengths), 3
        temps = torch.tensor(temperature)
        uniforms = torch.rand(B, depth, dtype=torch.float64, generator=torch.Generator().manual_seed(B))
        uniforms[0, 0] = 0.0  # the first id with probability
        try:
            ctx = drafter.context(target, reqs)
            want_tokens, want_q = per_request_sampled_chain(drafter, ctx, pending, hidden, temps, uniforms)
            # a given buffer is written (the leaf row left as it was), or the round hands out its own
            for run, given in ((draft_tree, True), (draft_tree, False), (runner.draft, True), (runner.draft, False)):
                probs = torch.full((B, depth + 1, V), float("nan")) if given else None
                s = DraftSampling(temps, uniforms, probs)
                got = run(drafter, ctx, pending, hidden, (1,) * depth, sampling=s) if run is draft_tree else \
                    run(ctx, pending, hidden, (1,) * depth, s)
                assert torch.equal(got, want_tokens), (lengths, run)
                assert s.probs.shape == (B, depth + 1, V) and (s.probs is probs or not given)
                torch.testing.assert_close(s.probs[:, :depth].double(), want_q, atol=1e-6, rtol=1e-5)
                leaf = s.probs[:, depth]
                assert bool(leaf.isnan().all() if given and run is draft_tree else (leaf == 0).all())
        finally:
            for r in reqs:
                target.release(r)
    assert len(runner.rounds) == 2 and runner.captures == 0
    reqs, pending, hidden = prefilled(target, (5,), seed=1)
    try:
        s = DraftSampling(torch.ones(1), torch.full((1, 2), 0.5, dtype=torch.float64), torch.zeros(1, 4, V))
        with pytest.raises(ValueError, match="chains only"):
            draft_tree(drafter, drafter.context(target, reqs), pending, hidden, (2, 1), sampling=s)
    finally:
        target.release(reqs[0])


def test_sampled_chain_through_the_triton_kernels(pair):
    """The same draw with the drafter on its Triton backend (the interpreter here; a captured round on a
    GPU): the step's kernels, then softmax_sample's two launches, against the per-request numpy draw
    from that drafter's own logits; a row strided into the [B, N, V] buffer, the leaf row untouched."""
    target, drafter = pair
    reqs, pending, hidden = prefilled(target, (9, 6), seed=3)
    temps = torch.tensor([0.8, 1.4])
    uniforms = torch.rand(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    drafter.backend = "triton"
    try:
        ctx = drafter.context(target, reqs)
        want_tokens, want_q = per_request_sampled_chain(drafter, ctx, pending, hidden, temps, uniforms)
        s = DraftSampling(temps, uniforms, torch.full((2, 3, drafter.config.text.vocab_size), float("nan")))
        got = draft_tree(drafter, ctx, pending, hidden, (1, 1), sampling=s)
        assert torch.equal(got, want_tokens)
        torch.testing.assert_close(s.probs[:, :2].double(), want_q, atol=1e-6, rtol=1e-5)
        assert bool(s.probs[:, 2].isnan().all())
    finally:
        drafter.backend = "torch"
        for r in reqs:
            target.release(r)


def test_batch_beyond_the_buckets_runs_eagerly(pair):
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(1, 2), capture=False, keep_after=1)
    reqs, pending, hidden = prefilled(target, (5, 6, 7), seed=0)
    try:
        ctx = drafter.context(target, reqs)
        got = runner.draft(ctx, pending, hidden, (1, 1))
        assert torch.equal(got, draft_tree(drafter, ctx, pending, hidden, (1, 1))) and not runner.rounds
    finally:
        for r in reqs:
            target.release(r)


def test_capture_needs_cuda(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="CUDA"):
        DraftGraphs(drafter, table_width=8, capture=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        speculative_generate(target, drafter, torch.tensor([3, 4, 5]), max_new_tokens=4, num_draft_tokens=2,
                             cuda_graphs=True)


def test_rounds_are_keyed_by_window_and_capped(pair):
    """The query-position convention changes the sliding window baked into a round: another round;
    past max_rounds (a growing heuristic chain) new rounds run eagerly, still the same tokens."""
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(4,), capture=False, max_rounds=3,
                         keep_after=1)
    reqs, pending, hidden = prefilled(target, (13, 5, 9), seed=7)
    try:
        for qp in ("last_cached", "next"):
            ctx = drafter.context(target, reqs, qp)
            want = draft_tree(drafter, ctx, pending, hidden, (1, 1))
            assert torch.equal(runner.draft(ctx, pending, hidden, (1, 1)), want)
        assert len(runner.rounds) == 2
        for widths in ((1,), (1, 1, 1), (2, 1)):
            ctx = drafter.context(target, reqs)
            want = draft_tree(drafter, ctx, pending, hidden, widths)
            assert torch.equal(runner.draft(ctx, pending, hidden, widths), want)
        assert len(runner.rounds) == 3
    finally:
        for r in reqs:
            target.release(r)


def test_a_round_is_kept_from_its_second_use(pair):
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(4,), capture=False)
    reqs, pending, hidden = prefilled(target, (13, 5), seed=8)
    try:
        ctx = drafter.context(target, reqs)
        want = draft_tree(drafter, ctx, pending, hidden, (1, 1))
        assert torch.equal(runner.draft(ctx, pending, hidden, (1, 1)), want) and not runner.rounds
        assert torch.equal(runner.draft(ctx, pending, hidden, (1, 1)), want) and len(runner.rounds) == 1
    finally:
        for r in reqs:
            target.release(r)


def test_steps_of_a_kept_round_are_graphed_steps(pair, monkeypatch):
    """backend="auto" decides a step's path by the graph-replayed steps' evidence inside a kept round (its
    warm-up and capture alike) and by the eager ones elsewhere: the runner marks its rounds' steps."""
    target, drafter = pair
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(4,), capture=False)
    seen, step = [], type(drafter).step

    def watched(self, *args):
        seen.append(self._graphed)
        return step(self, *args)
    monkeypatch.setattr(type(drafter), "step", watched)
    reqs, pending, hidden = prefilled(target, (13, 5), seed=8)
    try:
        ctx = drafter.context(target, reqs)
        runner.draft(ctx, pending, hidden, (1, 1))  # a first use: eager
        assert seen == [False, False] and not runner.rounds
        runner.draft(ctx, pending, hidden, (1, 1))  # kept from its second use
        assert seen[2:] == [True, True] and len(runner.rounds) == 1
        assert not drafter._graphed  # restored after the round
        with pytest.raises(RuntimeError, match="inside"), drafter.graphed_steps():
            raise RuntimeError("inside")
        assert not drafter._graphed  # and after a round that raised
    finally:
        for r in reqs:
            target.release(r)


# ---- the target's forward from static buffers (TargetGraphs) -------------------------------------

@pytest.fixture(scope="module", params=["31B", "E2B"])
def twins(request, tmp_path_factory):
    """Two copies of one random target of the family (E2B: per-layer embeddings, KV-shared layers): one
    driven through forward_tree, one through TargetGraphs' static buffers."""
    tp = tmp_path_factory.mktemp("twin")
    hf_tiny.build_target(tp, seed=5, family=request.param)
    return load_target(tp, block_size=4, num_blocks=256), load_target(tp, block_size=4, num_blocks=256)


def _trees(g, sizes):
    tokens = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in sizes]
    parents = [[-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)] for n in sizes]
    return tokens, parents


def test_static_forward_is_forward_tree(twins):
    """Rounds of random trees over ragged requests longer than the sliding window (8), in padded
    buckets, with commits of random accepted paths between them: the static forward gives
    forward_tree's logits and hidden states (zeros past a request's nodes) and leaves the same
    committed cache."""
    eager, static = twins
    runner = TargetGraphs(static, buckets=(2, 4), capture=False, keep_after=1)
    g = torch.Generator().manual_seed(11)
    lengths = (13, 5, 9)
    prompts = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in lengths]
    reqs = [([t.new_request() for _ in lengths]) for t in (eager, static)]
    try:
        for t, rs in zip((eager, static), reqs):
            t.prefill(rs, prompts)
        for step, sizes in enumerate(((5, 5, 5), (1, 7, 3), (4, 2, 6), (5, 5, 5), (3, 1, 1))):
            tokens, parents = _trees(g, sizes)
            want = eager.forward_tree(reqs[0], tokens, parents)
            got = runner.forward(reqs[1], tokens, parents)
            torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(got.hidden, want.hidden, atol=2e-5, rtol=1e-5)
            for b, n in enumerate(sizes):
                assert not got.logits[b, n:].any() and not got.hidden[b, n:].any(), (step, b)
                leaf = max(range(n), key=lambda i: (len(tree_path(parents[b], i)), -i))
                for t, rs in zip((eager, static), reqs):
                    t.commit(rs[b], tree_path(parents[b], leaf))
        for t_e, t_s in ((eager.caches[k], static.caches[k]) for k in eager.caches):
            for r_e, r_s in zip(*reqs):
                n = eager.lengths[r_e]
                pos = torch.arange(max(0, n - (t_e.window or n) - 1), n)
                for layer in range(t_e.k.shape[0]):
                    torch.testing.assert_close(t_s.read(layer, r_s, pos), t_e.read(layer, r_e, pos), atol=2e-5,
                                               rtol=1e-5)
    finally:
        for t, rs in zip((eager, static), reqs):
            for r in rs:
                t.release(r)
    assert runner.captures == 0 and {k[:2] for k in runner.kept} == {(4, 5), (4, 7), (4, 6), (4, 3)}


def test_static_forward_pads_to_the_nodes_asked_for(twins):
    """nodes= widens the static shape past the longest request (the decode loop's cut rounds): the
    outputs are that wide, forward_tree's values in front, zeros after; a bad count is refused."""
    eager, static = twins
    runner = TargetGraphs(static, buckets=(2,), capture=False, keep_after=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in (6, 9)]
    reqs = [[t.new_request() for _ in prompts] for t in (eager, static)]
    try:
        for t, rs in zip((eager, static), reqs):
            t.prefill(rs, prompts)
        tokens, parents = _trees(g, (3, 2))
        want = eager.forward_tree(reqs[0], tokens, parents)
        with pytest.raises(ValueError, match="nodes"):
            runner.forward(reqs[1], tokens, parents, nodes=0)
        got = runner.forward(reqs[1], tokens, parents, nodes=6)
        assert got.logits.shape[1] == 6 and {k[1] for k in runner.kept} == {6}
        torch.testing.assert_close(got.logits[:, :3], want.logits, atol=2e-5, rtol=1e-5)
        assert not got.logits[0, 3:].any() and not got.logits[1, 2:].any()
    finally:
        for t, rs in zip((eager, static), reqs):
            for r in rs:
                t.release(r)


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=3), dict(num_draft_tokens=None, tree=(2, 2, 1))], ids=str)
def test_decode_loop_with_static_target_forwards(pair, shape):
    """The loop's rounds through the target's static forward and the drafter's static rounds (what
    they capture on a GPU; the drafted tokens stay a [B, N] tensor from the round to the target's
    forward and the verification) decode what the eager loop decodes, and target-only decoding
    through the static forward too (one node per request)."""
    target, drafter = pair
    prompts = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (14, 9, 21)]
    eager = speculative_generate(target, drafter, prompts, max_new_tokens=14, **shape)
    base = speculative_generate(target, None, prompts, max_new_tokens=14, num_draft_tokens=0)
    target.graph_runner = TargetGraphs(target, capture=False)
    drafter.graph_runner = DraftGraphs(drafter, table_width=target.num_blocks, capture=False)
    try:
        static = speculative_generate(target, drafter, prompts, max_new_tokens=14, **shape)
        static_base = speculative_generate(target, None, prompts, max_new_tokens=14, num_draft_tokens=0)
        assert target.graph_runner.kept and drafter.graph_runner.kept  # shapes seen twice: static buffers
        off = speculative_generate(target, drafter, prompts, max_new_tokens=14, cuda_graphs=False, **shape)
    finally:
        target.graph_runner = drafter.graph_runner = None
    for b in range(len(prompts)):
        for out in (static, static_base, off, base):
            assert torch.equal(out.ids[b], eager.ids[b]), b
    assert static.stats.accepted_per_round == eager.stats.accepted_per_round


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=3), dict(num_draft_tokens=None, tree=(2, 2, 1)),
                                   dict(num_draft_tokens=3, temperature=0.9, seed=5)], ids=str)
def test_a_repeated_decode_replays_every_round(pair, shape):
    """Rounds that the token budget cuts short replay the full round's static shapes (the draft round
    and the target's forward): a second identical decode, an engine's steady state, makes no new
    static shape (on a GPU: captures no graph while it is timed, which the 2026-12-04 main commands
    did one to four times each), and both decode what the eager loop decodes."""
    target, drafter = pair
    # prompt + 15 new tokens + a round's nodes span 5-8 blocks of 4: one static block-table width (8),
    # so that only a cut round could make a shape of its own
    n = 13 if shape.get("tree") is None else 6
    prompt = torch.randint(3, hf_tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=15, **shape)
    eager = speculative_generate(target, drafter, prompt, **kw)
    assert min(eager.stats.draft_lengths[0]) < 3  # the budget cut a round short (both shapes are 3 deep)
    target.graph_runner = TargetGraphs(target, capture=False)
    drafter.graph_runner = DraftGraphs(drafter, table_width=target.num_blocks, capture=False)
    try:
        first = speculative_generate(target, drafter, prompt, **kw)
        second = speculative_generate(target, drafter, prompt, **kw)
        draft_shapes = {key[1] for key in drafter.graph_runner.kept}
    finally:
        target.graph_runner = drafter.graph_runner = None
    assert first.stats.new_static_shapes > 0 and second.stats.new_static_shapes == 0
    assert draft_shapes == {(1, 1, 1) if shape.get("tree") is None else (2, 2, 1)}
    for out in (first, second):
        assert torch.equal(out.ids[0], eager.ids[0])
        assert out.stats.draft_lengths == eager.stats.draft_lengths
        assert out.stats.accepted_per_round == eager.stats.accepted_per_round


def test_sampled_decode_with_static_rounds(pair):
    """Sampled drafts (the default of a sampling chain) go through the drafter's static rounds, keyed
    apart from argmax rounds, and decode what the eager loop decodes for the same seed."""
    target, drafter = pair
    prompts = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (14, 9, 21)]
    kw = dict(max_new_tokens=14, num_draft_tokens=3, temperature=0.9, seed=11)
    eager = speculative_generate(target, drafter, prompts, **kw)
    target.graph_runner = TargetGraphs(target, capture=False)
    drafter.graph_runner = DraftGraphs(drafter, table_width=target.num_blocks, capture=False)
    try:
        static = speculative_generate(target, drafter, prompts, **kw)
        argmax = speculative_generate(target, drafter, prompts, sample_drafts=False, **kw)
        sampled = {key[2] for key in drafter.graph_runner.kept}
    finally:
        target.graph_runner = drafter.graph_runner = None
    assert sampled == {True, False}
    for b in range(len(prompts)):
        assert torch.equal(static.ids[b], eager.ids[b]), b
    assert static.stats.accepted_per_round == eager.stats.accepted_per_round
    assert argmax.stats.accepted_per_round != eager.stats.accepted_per_round


def test_target_graphs_refuse_moe_and_cpu_capture(tmp_path, pair):
    target, _ = pair
    with pytest.raises(ValueError, match="CUDA"):
        TargetGraphs(target, capture=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        speculative_generate(target, None, torch.tensor([3, 4, 5]), max_new_tokens=4, num_draft_tokens=0,
                             cuda_graphs=True)
    hf_tiny.build_target(tmp_path, seed=0, family="26B-A4B")
    with pytest.raises(ValueError, match="enable_moe_block"):
        TargetGraphs(load_target(tmp_path, block_size=4, num_blocks=16), capture=False)


@pytest.mark.parametrize("family", list(hf_tiny.FAMILIES))
def test_static_forward_reads_nothing_on_the_host(tmp_path, family):
    """What a CUDA graph captures must not read a tensor's value on the host: forward_static runs on
    meta tensors, where any such read raises. The MoE block's expert dispatch does read the routing
    (why TargetGraphs refuses MoE targets)."""
    hf_tiny.build_target(tmp_path, seed=0, family=family)
    target = load_target(tmp_path, block_size=4, num_blocks=16).to("meta")
    target._ensure_caches()
    B, N, W = 2, 3, 4

    def z(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device="meta")

    args = (z(B, N), z(B, N), z(B, N, N, dtype=torch.bool), z(B), z(B),
            {t: z(B, W, dtype=torch.int32) for t in target.caches})
    if "moe" in hf_tiny.FAMILIES[family]:
        with pytest.raises((RuntimeError, NotImplementedError)):
            target.forward_static(*args)
    else:
        out = target.forward_static(*args)
        assert out.logits.shape == (B, N, hf_tiny.VOCAB) and out.logits.device.type == "meta"
