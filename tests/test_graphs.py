"""gemma4_mtp.graphs on CPU: the draft round that is captured as a CUDA graph, run eagerly.

`draft_tree` (device-only bookkeeping) must draft exactly the tree the per-request reference builds
(one drafter step per node level of one request at a time, host lists, as the decode loop did before
rounds were captured); `DraftGraphs(capture=False)` runs the same round from its static buffers
(bucket padding, block tables widened, stale rows of a larger earlier batch) and must agree with it.
The capture itself and the replay are checked on a GPU in test_graphs_cuda.py."""
import pytest
import torch

import hf_tiny
from gemma4_mtp import load_drafter, load_target, speculative_generate
from gemma4_mtp.graphs import DraftGraphs, draft_tree, level_sizes, tree_parents

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
