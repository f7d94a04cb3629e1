"""The drafter step in one host call (backend="cuda", csrc/ops/drafter_step.cu) on a GPU: the same
kernels with the same plans as the step made of the ops one by one, so the same bits, eagerly and
replayed as a CUDA graph, the LM head's top tokens included (step_top_tokens: the head op's kernels in the
same call) and a sampled token (step_sample_tokens: the head's logits and softmax_sample); and every
refused argument a ValueError (a TypeError for a dtype) naming it, as the ops one by one raise, before any
launch.
Its CPU twin, tests/test_drafter_step_emulated.py, runs the same C++ against the reference step."""
import copy

import pytest
import torch

from gemma4_mtp.drafter import random_drafter, synthetic_context
from helpers import SMALL_DRAFTER

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SMALL_CENTROIDS = dict(SMALL_DRAFTER, centroids=8, top_k=2)  # 12 tokens a cluster, 24 candidates a token


def _setup(B, Q, name=None, dtype=torch.bfloat16):
    drafter = random_drafter(name or SMALL_DRAFTER, device=DEV, dtype=dtype, backend="cuda", seed=3)
    ctx = synthetic_context(drafter, B, 200, device=DEV, dtype=dtype, seed=3)
    g = torch.Generator(device=DEV).manual_seed(4)
    tokens = torch.randint(0, drafter.config.text.vocab_size, (B, Q), generator=g, device=DEV)
    hidden = torch.randn(B, Q, drafter.config.backbone_hidden_size, generator=g, device=DEV).to(dtype)
    ops = copy.copy(drafter)
    ops.one_call_step = False
    return drafter, ops, ctx, tokens, hidden


@pytest.mark.parametrize("B,Q,name", [(1, 1, None), (3, 2, None), (1, 1, "E2B"), (8, 1, "E2B")])
def test_one_call_matches_the_ops_one_by_one(B, Q, name):
    drafter, ops, ctx, tokens, hidden = _setup(B, Q, name)
    last, proj = drafter.step(ctx, tokens, hidden)
    ref_last, ref_proj = ops.step(ctx, tokens, hidden)
    assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)


@pytest.mark.parametrize("B,Q,name,k", [(1, 1, None, 1), (3, 2, None, 4), (1, 1, SMALL_CENTROIDS, 1),
                                       (2, 2, SMALL_CENTROIDS, 3), (1, 1, "E2B", 1), (8, 1, "E2B", 2)])
def test_one_call_head_matches_the_head_op(B, Q, name, k):
    drafter, ops, ctx, tokens, hidden = _setup(B, Q, name)
    last, proj, ids = drafter.step_top_tokens(ctx, tokens, hidden, k)
    ref_last, ref_proj = ops.step(ctx, tokens, hidden)
    assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)
    assert torch.equal(ids, ops.top_tokens(ref_last, k))


@pytest.mark.parametrize("name,k,what", [(None, 17, "k must be in"), (SMALL_CENTROIDS, 17, "ids must be")])
def test_bad_head_k_is_refused_by_name(name, k, what):
    drafter, _, ctx, tokens, hidden = _setup(1, 1, name)
    with pytest.raises(ValueError, match=what):
        drafter.step_top_tokens(ctx, tokens, hidden, k)


def _sampling(T, seed=5):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return 0.5 + torch.rand(T, generator=g, device=DEV), torch.rand(T, generator=g, device=DEV, dtype=torch.float64)


@pytest.mark.parametrize("B,Q,name", [(1, 1, None), (3, 2, None), (2, 1, SMALL_CENTROIDS), (2, 2, SMALL_CENTROIDS),
                                      (1, 1, "E2B"), (8, 1, "E2B")])
def test_one_call_sampled_head_matches_the_ops(B, Q, name):
    """step_sample_tokens' one call: the head op's dense logits (the centroid head's -inf filled by its own
    launch instead of torch.full) and softmax_sample's kernels, so the same draws and q, bit for bit."""
    drafter, ops, ctx, tokens, hidden = _setup(B, Q, name)
    T, V = B * Q, drafter.config.text.vocab_size
    temperature, uniforms = _sampling(T)
    probs_out = torch.full((T, V), float("nan"), device=DEV)
    last, proj, drawn, probs = drafter.step_sample_tokens(ctx, tokens, hidden, temperature, uniforms, probs_out)
    ref_last, ref_proj = ops.step(ctx, tokens, hidden)
    ref_drawn, ref_probs = ops.sample_tokens(ref_last.reshape(T, -1), temperature, uniforms)
    assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)
    assert probs.data_ptr() == probs_out.data_ptr() and torch.equal(probs, ref_probs)
    assert torch.equal(drawn, ref_drawn)


@pytest.mark.parametrize("what,error", [("uniforms", TypeError), ("temperature", ValueError), ("probs", ValueError)])
def test_bad_sampling_argument_is_refused_by_name(what, error):
    drafter, _, ctx, tokens, hidden = _setup(2, 1, SMALL_CENTROIDS)
    temperature, uniforms = _sampling(2)
    probs = torch.empty(2, drafter.config.text.vocab_size, device=DEV)
    bad = {"uniforms": (temperature, uniforms.float(), probs), "temperature": (temperature[:1], uniforms, probs),
           "probs": (temperature, uniforms, probs[:, 1:])}[what]
    with pytest.raises(error, match=what):
        drafter.step_sample_tokens(ctx, tokens, hidden, *bad)


def test_one_call_sampled_step_replays_as_a_graph():
    drafter, ops, ctx, tokens, hidden = _setup(2, 1, SMALL_CENTROIDS)
    temperature, uniforms = _sampling(2)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        drafter.step_sample_tokens(ctx, tokens, hidden, temperature, uniforms)  # warm-up: the cached counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, _, drawn, probs = drafter.step_sample_tokens(ctx, tokens, hidden, temperature, uniforms)
    hidden.copy_(torch.randn_like(hidden))
    uniforms.copy_(torch.rand_like(uniforms))
    graph.replay()
    ref_drawn, ref_probs = ops.sample_tokens(ops.step(ctx, tokens, hidden)[0].reshape(2, -1), temperature, uniforms)
    assert torch.equal(drawn, ref_drawn) and torch.equal(probs, ref_probs)


def test_one_call_step_replays_as_a_graph():
    drafter, ops, ctx, tokens, hidden = _setup(2, 1)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        drafter.step(ctx, tokens, hidden)  # warm-up: the cached counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        last, proj = drafter.step(ctx, tokens, hidden)
    hidden.copy_(torch.randn_like(hidden))
    tokens.copy_(torch.randint_like(tokens, drafter.config.text.vocab_size))
    graph.replay()
    ref_last, ref_proj = ops.step(ctx, tokens, hidden)
    assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)


def test_one_call_step_and_head_replay_as_a_graph():
    drafter, ops, ctx, tokens, hidden = _setup(2, 1, SMALL_CENTROIDS)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        drafter.step_top_tokens(ctx, tokens, hidden, 2)  # warm-up: the cached counters
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, _, ids = drafter.step_top_tokens(ctx, tokens, hidden, 2)
    hidden.copy_(torch.randn_like(hidden))
    tokens.copy_(torch.randint_like(tokens, drafter.config.text.vocab_size))
    graph.replay()
    assert torch.equal(ids, ops.top_tokens(ops.step(ctx, tokens, hidden)[0], 2))


def _mutations(ctx):
    k = ctx.k_cache["sliding_attention"]
    return {
        # 2 bytes past a 16-byte boundary
        "k_caches[0]": lambda c: setattr(c, "k_cache", {**c.k_cache, "sliding_attention": torch.empty(
            k.numel() + 8, dtype=k.dtype, device=DEV)[1:1 + k.numel()].view(k.shape)}),
        "block_tables[1]": lambda c: setattr(c, "block_table", {**c.block_table, "full_attention":
                                                                c.block_table["full_attention"].long()}),
        "seq_lens": lambda c: setattr(c, "seq_lens", c.seq_lens[:-1]),
        "positions": lambda c: setattr(c, "positions", c.positions.float()),
        "embed_table": lambda c: setattr(c, "embed_table", c.embed_table.float()),
    }


@pytest.mark.parametrize("what,error", [("k_caches[0]", ValueError), ("block_tables[1]", TypeError),
                                        ("seq_lens", ValueError), ("positions", TypeError),
                                        ("embed_table", TypeError)])
def test_bad_context_is_refused_by_name(what, error):
    drafter, _, ctx, tokens, hidden = _setup(2, 1)
    bad = copy.copy(ctx)
    _mutations(ctx)[what](bad)
    with pytest.raises(error, match=what.replace("[", r"\[").replace("]", r"\]")):
        drafter.step(bad, tokens, hidden)


def test_bad_layer_weight_is_refused_by_layer_and_name():
    drafter, _, ctx, tokens, hidden = _setup(1, 1)
    gate = drafter.layers[2].mlp.gate_proj
    gate.weight.data = gate.weight.data.float()
    with pytest.raises(TypeError, match="layer 2 gate has dtype"):
        drafter.step(ctx, tokens, hidden)


def test_value_checks_take_the_ops_that_read_values():
    """With value checks on, the step is the ops one by one, which read the token ids back: an id out of
    the vocabulary is refused by name instead of becoming a NaN row."""
    from gemma4_mtp_kernels import set_value_checks

    drafter, _, ctx, tokens, hidden = _setup(1, 1)
    tokens.fill_(drafter.config.text.vocab_size)
    set_value_checks(True)
    try:
        with pytest.raises(ValueError, match="token_ids"):
            drafter.step(ctx, tokens, hidden)
    finally:
        set_value_checks(False)


def test_auto_is_one_call_where_the_evidence_names_the_cuda_step(monkeypatch):
    """backend="auto": an eager step is the one call when verified.py names cuda for eager steps of this
    drafter, dtype and batch (the same bits as backend="cuda"); inside graphed_steps() the graph-replayed
    steps' entry decides (triton here: the ops one by one)."""
    from gemma4_mtp_kernels import _dispatch, cuda, verified

    drafter, _, ctx, tokens, hidden = _setup(1, 1, "E2B")
    auto = copy.copy(drafter)
    auto.backend = "auto"
    shape = (("Hb", 1536), ("Hd", 256), ("Q", 1))
    device = _dispatch.device_class(torch.cuda.current_device())
    monkeypatch.setattr(verified, "EVIDENCE", {
        (device, "drafter_step_eager", "bfloat16"): ((shape, ("B", 1, 8), "cuda", "test"),),
        (device, "drafter_step", "bfloat16"): ((shape, ("B", 1, 8), "triton", "test"),)})
    calls, one_call = [], cuda.drafter_step

    def counted(*args, **kwargs):
        calls.append(1)
        return one_call(*args, **kwargs)
    monkeypatch.setattr(cuda, "drafter_step", counted)
    last, proj = auto.step(ctx, tokens, hidden)
    assert len(calls) == 1
    ref_last, ref_proj = drafter.step(ctx, tokens, hidden)
    assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)
    with auto.graphed_steps():  # not run: the ops one by one would compile the Triton step here
        assert not auto._in_one_call(tokens)
    assert auto._in_one_call(tokens)
