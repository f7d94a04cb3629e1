"""Draft rounds captured as CUDA graphs (GPU only): replay equals the eager round on the same inputs,
round after round (new inputs in the static buffers, padded buckets, chains and trees), for the
embedded model and a real-shape drafter; the decode loop with graphs gives the tokens it gives
without them, and reproduces target-only greedy decoding."""
import pytest
import torch

from gemma4_mtp import load_drafter, load_target, speculative_generate
from gemma4_mtp import train as T
from helpers import held_out_prompts
from gemma4_mtp.drafter import random_drafter, synthetic_context
from gemma4_mtp.graphs import DraftGraphs, DraftSampling, draft_tree

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def target():
    return load_target(T.ASSETS / "target", device=DEV)


@pytest.fixture(scope="module")
def prompts():
    return held_out_prompts((64, 41, 23, 50, 9))  # ragged


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("widths", [(1, 1, 1, 1), (2, 2, 1)], ids=str)
def test_replay_equals_eager_round(target, prompts, backend, widths):
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend=backend)
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(2, 4, 8), keep_after=1)
    for batch in (prompts[:3], prompts[:2], prompts[1:5], prompts[:3]):
        reqs = [target.new_request() for _ in batch]
        try:
            out = target.prefill(reqs, [p.to(DEV) for p in batch], last_only=True)
            pending = out.logits[:, 0].argmax(-1)
            hidden = out.hidden[:, 0]
            ctx = drafter.context(target, reqs)
            eager = draft_tree(drafter, ctx, pending, hidden, widths)
            replayed = runner.draft(ctx, pending, hidden, widths).clone()
            assert torch.equal(replayed, eager), f"batch of {len(batch)}"
        finally:
            for r in reqs:
                target.release(r)
    assert runner.captures == 2  # buckets 2 and 4, each captured once and replayed after


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_sampled_round_replay_equals_eager(target, prompts, backend):
    """A sampled chain (DraftSampling: softmax, inverse CDF, q rows, all inside the graph) replays the
    eager round's tokens and q, over padded buckets and new inputs (q to rounding: a padded bucket can
    split the kernels' sums otherwise than the eager batch)."""
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend=backend)
    runner = DraftGraphs(drafter, table_width=target.num_blocks, buckets=(2, 4), keep_after=1)
    g = torch.Generator().manual_seed(0)
    for batch in (prompts[:3], prompts[:2], prompts[1:4], prompts[:3]):
        reqs = [target.new_request() for _ in batch]
        try:
            out = target.prefill(reqs, [p.to(DEV) for p in batch], last_only=True)
            pending, hidden = out.logits[:, 0].argmax(-1), out.hidden[:, 0]
            ctx = drafter.context(target, reqs)
            temps = torch.full((len(batch),), 0.8, device=DEV)
            uniforms = torch.rand(len(batch), 4, dtype=torch.float64, generator=g).to(DEV)
            eager = DraftSampling(temps, uniforms)
            want = draft_tree(drafter, ctx, pending, hidden, (1, 1, 1, 1), sampling=eager)
            replayed = DraftSampling(temps, uniforms)
            got = runner.draft(ctx, pending, hidden, (1, 1, 1, 1), replayed)
            assert torch.equal(got, want), f"batch of {len(batch)}"
            torch.testing.assert_close(replayed.probs, eager.probs, atol=1e-6, rtol=1e-4)
        finally:
            for r in reqs:
                target.release(r)
    assert runner.captures == 2


def test_sampled_decode_loop_with_graphs(target, prompts):
    """Sampled drafts through captured rounds draw what the eager loop draws for the same seed."""
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend="triton")
    kw = dict(max_new_tokens=40, num_draft_tokens=4, temperature=0.8, seed=5)
    graphed = speculative_generate(target, drafter, prompts, cuda_graphs=True, **kw)
    eager = speculative_generate(target, drafter, prompts, cuda_graphs=False, **kw)
    for b in range(len(prompts)):
        assert torch.equal(graphed.ids[b], eager.ids[b])
    assert graphed.stats.accepted_per_round == eager.stats.accepted_per_round


@pytest.mark.parametrize("name", ["E2B", "31B"])
def test_real_shape_round(name):
    drafter = random_drafter(name, device=DEV, backend="triton")
    ctx = synthetic_context(drafter, 3, 8192, device=DEV)
    runner = DraftGraphs(drafter, table_width=ctx.block_table["full_attention"].shape[1], buckets=(4,), keep_after=1)
    g = torch.Generator(device=DEV).manual_seed(0)
    for widths in ((1, 1, 1, 1), (2, 2, 1)):
        pending = torch.randint(0, drafter.config.text.vocab_size, (3,), generator=g, device=DEV)
        hidden = torch.randn(3, drafter.config.backbone_hidden_size, generator=g, device=DEV).to(torch.bfloat16)
        eager = draft_tree(drafter, ctx, pending, hidden, widths)
        assert torch.equal(runner.draft(ctx, pending, hidden, widths), eager)


@pytest.mark.parametrize("shape", [dict(num_draft_tokens=4), dict(num_draft_tokens=None, tree=(2, 2, 1)),
                                   dict(num_draft_tokens=2, draft_schedule="heuristic")], ids=str)
def test_decode_loop_with_graphs(target, prompts, shape):
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend="triton")
    graphed = speculative_generate(target, drafter, prompts, max_new_tokens=40, cuda_graphs=True, **shape)
    eager = speculative_generate(target, drafter, prompts, max_new_tokens=40, cuda_graphs=False, **shape)
    base = speculative_generate(target, None, prompts, max_new_tokens=40, num_draft_tokens=0)
    for b in range(len(prompts)):
        assert torch.equal(graphed.ids[b], eager.ids[b]) and torch.equal(graphed.ids[b], base.ids[b])
    assert graphed.stats.accepted_per_round == eager.stats.accepted_per_round
    if "draft_schedule" not in shape:  # a constant shape is replayed from its second round on
        assert drafter._draft_graphs and all(r.captures for r in drafter._draft_graphs.values())


def test_target_forward_replay_equals_forward_tree(target, prompts):
    """Target forwards captured and replayed (padded buckets, a chain and a tree shape, shapes seen
    again with new inputs) give forward_tree's outputs on the same cache state."""
    from gemma4_mtp.graphs import TargetGraphs
    from gemma4_mtp.graphs import tree_parents

    runner = TargetGraphs(target, buckets=(2, 4), keep_after=1)
    g = torch.Generator().manual_seed(0)
    for batch, widths in ((prompts[:3], (1, 1, 1, 1)), (prompts[1:4], (2, 2, 1)), (prompts[:2], (1, 1, 1, 1)),
                          (prompts[2:5], (1, 1, 1, 1))):
        reqs = [target.new_request() for _ in batch]
        try:
            target.prefill(reqs, [p.to(DEV) for p in batch])
            parents = tree_parents(widths)
            tokens = [torch.randint(3, target.config.vocab_size, (len(parents),), generator=g) for _ in batch]
            want = target.forward_tree(reqs, tokens, [parents] * len(batch))
            got = runner.forward(reqs, tokens, [parents] * len(batch))
            torch.testing.assert_close(got.logits, want.logits, atol=2e-4, rtol=1e-4)
        finally:
            for r in reqs:
                target.release(r)
    assert runner.captures >= 2
