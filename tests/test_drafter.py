"""gemma4_mtp.Gemma4MTPDrafter against Hugging Face Gemma4AssistantForCausalLM (fp32, torch backend ops).

The HF assistant gets the HF target's own shared_kv_states and final hidden state, and the query at
HF's position (P + 1); ours reads our target's paged cache at the same position."""
import contextlib
import copy
import dataclasses
import importlib

import pytest
import torch

import hf_tiny
import gemma4_mtp_kernels as g
from gemma4_mtp import load_drafter, load_target
from gemma4_mtp_kernels import BackendUnavailableError

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module", params=[(True, False), (False, True), (True, True)],
                ids=["k_eq_v-dense", "separate_v-centroids", "k_eq_v-centroids"])
def models(request, tmp_path_factory):
    k_eq_v, ordered = request.param
    tp, dp = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("d")
    hf_t = hf_tiny.build_target(tp, seed=5, k_eq_v=k_eq_v)
    hf_d = hf_tiny.build_drafter(dp, seed=6, k_eq_v=k_eq_v, ordered=ordered)
    return hf_t, hf_d, load_target(tp, block_size=4, num_blocks=64), load_drafter(dp, backend="torch")


def close(a, b):
    torch.testing.assert_close(a, b, atol=3e-5, rtol=1e-5)


def compare_logits(ours, hf, ordered):
    if not ordered:
        close(ours, hf)
        return
    # HF fills tokens outside the selected clusters with (min candidate logit - 1); ours with -inf
    cand = torch.isfinite(ours)
    assert torch.equal(cand, hf > hf.min()), "different candidate sets"
    close(ours[cand], hf[cand])


@torch.no_grad()
def test_draft_steps_match_hf(models):
    hf_t, hf_d, target, drafter = models
    ordered = drafter.config.use_ordered_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g) for n in (13, 5)]  # beyond / within the window
    reqs = [target.new_request() for _ in prompts]
    try:
        pre = target.prefill(reqs, prompts)
        hf_state = []
        for b, p in enumerate(prompts):
            out = hf_t(p[None], output_hidden_states=True, return_shared_kv_states=True)
            close(pre.hidden[b, len(p) - 1], out.hidden_states[-1][0, -1])
            # the cache the drafter reads is what HF hands its assistant
            for lt, (k, v) in out.shared_kv_states.items():
                kc, vc = target.kv_cache(lt)
                table = target.caches[lt].tables[reqs[b]]
                lo = 0 if lt == "full_attention" else len(p) - hf_tiny.WINDOW
                pos = torch.arange(max(0, lo), len(p))
                blocks = torch.tensor(table)[pos // 4]
                close(kc[blocks, pos % 4], k[0].transpose(0, 1)[pos])
                close(vc[blocks, pos % 4], v[0].transpose(0, 1)[pos])
            hf_state.append((out.shared_kv_states, out.hidden_states[-1][:, -1:]))
        tokens = torch.tensor([[7], [100]])
        hidden = torch.stack([pre.hidden[b, len(p) - 1] for b, p in enumerate(prompts)])[:, None]
        positions = torch.tensor([len(p) for p in prompts])  # HF's P + 1
        ctx = drafter.context(target, reqs, "next")
        assert torch.equal(ctx.positions, positions)
        for step in range(3):
            last, proj = drafter.step(ctx, tokens, hidden)
            ours_logits = drafter.logits(last)
            nxt = []
            for b, (skv, h) in enumerate(hf_state):
                embeds = hf_t.model.embed_tokens(tokens[b][None])
                o = hf_d(inputs_embeds=torch.cat([embeds, h], dim=-1), position_ids=positions[b].view(1, 1),
                         shared_kv_states=skv)
                close(proj[b], o.last_hidden_state[0])
                compare_logits(ours_logits[b], o.logits[0].float(), ordered)
                hf_state[b] = (skv, o.last_hidden_state)
                nxt.append(int(o.logits[0, -1].argmax()))
            assert drafter.top_tokens(last, 1)[:, 0, 0].tolist() == nxt
            tokens, hidden = torch.tensor(nxt)[:, None], proj
    finally:
        for r in reqs:
            target.release(r)


@contextlib.contextmanager
def _draft_inputs(target, drafter, lengths, Q, seed):
    """Requests prefilled with random prompts of `lengths`, released after: (their drafter context, random
    tokens [B, Q] and hidden states [B, Q, Hb], the generator for more)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [target.new_request() for _ in lengths]
    try:
        target.prefill(reqs, [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g) for n in lengths])
        B = len(lengths)
        yield (drafter.context(target, reqs, "last_cached"), torch.randint(0, hf_tiny.VOCAB, (B, Q), generator=g),
               torch.randn(B, Q, hf_tiny.HB, generator=g), g)
    finally:
        for r in reqs:
            target.release(r)


@torch.no_grad()
def test_step_top_tokens_is_step_then_top_tokens(models):
    """A greedy draft step (what draft_tree runs): the step's outputs and top_tokens of its last."""
    _, _, target, drafter = models
    with _draft_inputs(target, drafter, (9, 5), 3, seed=2) as (ctx, tokens, hidden, _):
        ref_last, ref_proj = drafter.step(ctx, tokens, hidden)
        for k in (1, 3):
            last, proj, ids = drafter.step_top_tokens(ctx, tokens, hidden, k)
            assert ids.shape == (2, 3, k) and ids.dtype == torch.int64
            assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)
            assert torch.equal(ids, drafter.top_tokens(ref_last, k))
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="k must be a positive int"):
                drafter.step_top_tokens(ctx, tokens, hidden, bad)


@torch.no_grad()
def test_step_sample_tokens_is_step_then_sample_tokens(models):
    """A sampled draft step (what draft_tree runs with sampling): the step's outputs and sample_tokens over
    its B * Q rows of last, q into probs_out when given."""
    _, _, target, drafter = models
    with _draft_inputs(target, drafter, (7, 11), 2, seed=3) as (ctx, tokens, hidden, g):
        temperature = 0.5 + torch.rand(4, generator=g)
        uniforms = torch.rand(4, generator=g, dtype=torch.float64)
        ref_last, ref_proj = drafter.step(ctx, tokens, hidden)
        ref_tokens, ref_probs = drafter.sample_tokens(ref_last.reshape(4, -1), temperature, uniforms)
        probs_out = torch.full((4, hf_tiny.VOCAB), float("nan"))
        last, proj, drawn, probs = drafter.step_sample_tokens(ctx, tokens, hidden, temperature, uniforms, probs_out)
        assert torch.equal(last, ref_last) and torch.equal(proj, ref_proj)
        assert torch.equal(drawn, ref_tokens) and drawn.shape == (4,) and drawn.dtype == torch.int64
        assert probs.data_ptr() == probs_out.data_ptr() and torch.equal(probs, ref_probs)


@torch.no_grad()
def test_one_call_step_hands_the_head_its_weights(models, monkeypatch):
    """The one call's head arguments (csrc/torch_bindings.cpp drafter_step: ..., centroids, token_ordering,
    lm_head, centroid_top_k, temperature, uniforms, last, proj, ids, scores, probs) are those top_tokens (and,
    sampled, sample_tokens) give the head ops: the centroid head's with centroids, the dense one's without,
    none for a step alone. The op itself is a stand-in recording them (the kernels run in
    test_drafter_step_emulated.py and, on a GPU, test_drafter_step_cuda.py)."""
    from gemma4_mtp_kernels import cuda

    _, _, target, drafter = models
    seen = []

    class Ops:
        @staticmethod
        def drafter_step(*args):
            seen.append(args[-11:])
    monkeypatch.setattr(cuda, "_ops", lambda: Ops)
    req = target.new_request()
    try:
        target.prefill([req], [torch.arange(6)])
        ctx = drafter.context(target, [req], "last_cached")
        tokens, hidden = torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, hf_tiny.HB)
        last, proj, ids = drafter._one_call_step(ctx, tokens, hidden, 3)
        assert len(drafter._one_call_step(ctx, tokens, hidden)) == 2
        temperature, uniforms = torch.ones(2), torch.zeros(2, dtype=torch.float64)
        probs_out = torch.empty(2, hf_tiny.VOCAB)
        s_last, s_proj, drawn, probs = drafter._one_call_step(ctx, tokens, hidden,
                                                              sample=(temperature, uniforms, probs_out))
    finally:
        target.release(req)
    (centroids, ordering, lm_head, top_k, temp, u, o_last, o_proj, o_ids, o_scores, o_probs), alone, sampled = seen
    assert lm_head is drafter.lm_head_weight and o_last is last and o_proj is proj and o_ids is ids
    assert ids.shape == (1, 2, 3) and ids.dtype == torch.int64
    assert o_scores.shape == (1, 2, 3) and o_scores.dtype == torch.float32
    assert temp is None and u is None and o_probs is None
    if drafter.config.use_ordered_embeddings:
        assert centroids is drafter.centroids.weight and ordering is drafter.token_ordering
        assert top_k == drafter.config.centroid_top_k
    else:
        assert centroids is None and ordering is None
    assert alone[:3] == (None,) * 3 and alone[4:6] == (None, None) and alone[-3:] == (None, None, None)
    # sampled: the head's weights as logits gives them, the draws as [B, Q, 1] (returned as [T]), no scores
    assert all(x is y for x, y in zip(sampled[:3], (centroids, ordering, lm_head))) and sampled[3] == top_k
    assert sampled[4] is temperature and sampled[5] is uniforms
    assert sampled[6] is s_last and sampled[7] is s_proj and sampled[9] is None and sampled[10] is probs is probs_out
    assert sampled[8].shape == (1, 2, 1) and sampled[8].dtype == torch.int64 and drawn.shape == (2,)


@torch.no_grad()
def test_tree_level_shares_one_call(models):
    """Q branches of one request in one step equal Q separate single-query steps."""
    _, _, target, drafter = models
    g = torch.Generator().manual_seed(1)
    reqs = [target.new_request() for _ in range(2)]
    try:
        target.prefill(reqs, [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g) for n in (10, 4)])
        ctx = drafter.context(target, reqs, "last_cached")
        assert torch.equal(ctx.positions, target.seq_lens(reqs).long() - 1)
        assert ctx.window == {"sliding_attention": hf_tiny.WINDOW, "full_attention": None}
        tokens = torch.randint(0, hf_tiny.VOCAB, (2, 3), generator=g)
        hidden = torch.randn(2, 3, hf_tiny.HB, generator=g)
        last, proj = drafter.step(ctx, tokens, hidden)
        for b in range(2):
            for q in range(3):
                l1, p1 = drafter.step(ctx.select([b]), tokens[b:b + 1, q:q + 1], hidden[b:b + 1, q:q + 1])
                close(last[b, q], l1[0, 0])
                close(proj[b, q], p1[0, 0])
    finally:
        for r in reqs:
            target.release(r)


def test_top_tokens_follow_the_dense_logits(models):
    _, _, _, drafter = models
    g = torch.Generator().manual_seed(2)
    last = torch.randn(5, hf_tiny.HD, generator=g)
    logits = drafter.logits(last)
    top = drafter.top_tokens(last, 3)
    for t in range(5):
        # a stable descending sort of dense logits orders ties by ascending id
        expect = torch.sort(logits[t], descending=True, stable=True).indices[:3]
        assert top[t].tolist() == expect.tolist()


def test_head_checked_once_per_weights_and_call_shape(models, monkeypatch):
    """top_tokens goes through the head's public op the first time for its weights and (T, k), then
    through the implementation: same answers; a replaced LM head is checked again; a `last` that is
    not what the weights call for takes the checked op, which names it."""
    _, _, _, drafter = models
    drafter = copy.deepcopy(drafter)
    op = "centroid_logits" if drafter.config.use_ordered_embeddings else "dense_lm_head"
    public = getattr(g, op)
    calls = []
    monkeypatch.setattr(g, op, lambda *a, **kw: calls.append(kw.get("k")) or public(*a, **kw))
    last = torch.randn(3, hf_tiny.HD, generator=torch.Generator().manual_seed(4))
    first = [drafter.top_tokens(last, k) for k in (1, 2)]
    assert len(calls) == 2
    again = [drafter.top_tokens(last, k) for k in (1, 2)]
    assert len(calls) == 2, "a second call with the same weights and shape was checked again"
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    drafter.top_tokens(last[:2], 2)  # another call shape: checked once
    assert len(calls) == 3
    with pytest.raises(TypeError, match=f"{op}: "):
        drafter.top_tokens(last.double(), 2)
    with pytest.raises(ValueError, match=rf"{op}: .*hidden\.shape\[1\]"):
        drafter.top_tokens(torch.randn(3, hf_tiny.HD + 1), 2)
    head = drafter.lm_head_weight
    head.data = -head.data  # new values at a new address: checked again, and used
    flipped = drafter.top_tokens(last, 2)
    assert len(calls) == 6 and not torch.equal(flipped, first[1])


def test_max_branch_is_what_top_tokens_can_give():
    """A tree level's branching is the head's top-k: its candidates, at most 16 (E2B: 4096 candidates)."""
    from gemma4_mtp.drafter import random_drafter
    assert random_drafter("E2B", device="meta").max_branch == 16
    assert random_drafter("31B", device="meta").max_branch == 16
    small = random_drafter(dict(Hb=32, Hd=16, inter=32, Hq=2, Hkv_swa=1, Hkv_full=1, D_swa=64, D_full=64, window=8,
                                vocab=64, centroids=16, top_k=2), device="meta")
    assert small.max_branch == 8  # 2 clusters of 4 tokens


def test_synthetic_context_reads_as_the_query_position_says():
    """`synthetic_context` (the benchmarks' and launch counts' contexts) as `context` gives them: "next"
    queries one position later over sliding windows one entry wider (Hugging Face's assistant)."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context
    small = random_drafter(dict(Hb=32, Hd=16, inter=32, Hq=2, Hkv_swa=1, Hkv_full=1, D_swa=64, D_full=64, window=8,
                                vocab=64, centroids=16, top_k=2), dtype=torch.float32)
    last, nxt = (synthetic_context(small, 2, 20, dtype=torch.float32, query_position=qp)
                 for qp in ("last_cached", "next"))
    assert last.window == {"sliding_attention": 8, "full_attention": None}
    assert nxt.window == {"sliding_attention": 9, "full_attention": None}
    assert last.positions.tolist() == [19, 19] and nxt.positions.tolist() == [20, 20]
    assert torch.equal(last.seq_lens, nxt.seq_lens)
    with pytest.raises(ValueError, match="query_position"):
        synthetic_context(small, 1, 20, query_position="P+1")


@torch.no_grad()
@contextlib.contextmanager
def _one_request(target, drafter, seed):
    """(context, tokens [1, 2], hidden [1, 2, Hb]) of one prefilled request, released afterwards."""
    g = torch.Generator().manual_seed(seed)
    r = target.new_request()
    try:
        target.prefill([r], [torch.randint(0, hf_tiny.VOCAB, (9,), generator=g)])
        yield (drafter.context(target, [r]), torch.randint(0, hf_tiny.VOCAB, (1, 2), generator=g),
               torch.randn(1, 2, hf_tiny.HB, generator=g))
    finally:
        target.release(r)


def test_glue_checked_once_per_weights(models, monkeypatch):
    """A step's 13 glue calls (3 per layer + 1) are checked on the first step with the drafter's
    weights and run unchecked after it; a replaced weight is checked again (a wrong shape raises,
    naming it), and the positions, which come from outside, are checked on every step."""
    _, _, target, drafter = models
    drafter = copy.deepcopy(drafter)
    checks = []
    for op in ("rms_norm_gate_up", "rms_norm_linear", "rms_norm_q_rope"):
        module = importlib.import_module(f"gemma4_mtp_kernels.ops.{op}")  # the package attribute is the op
        original = module.check_prologue
        monkeypatch.setattr(module, "check_prologue",
                            lambda op, *a, _original=original, **k: checks.append(op) or _original(op, *a, **k))
    glue_calls = 3 * drafter.config.text.num_layers + 1
    with _one_request(target, drafter, 3) as (ctx, tokens, hidden):
        first = drafter.step(ctx, tokens, hidden)
        assert len(checks) == glue_calls
        second = drafter.step(ctx, tokens, hidden)
        assert len(checks) == glue_calls, "the second step checked its glue calls again"
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        with pytest.raises(TypeError, match="rms_norm_q_rope: positions"):
            drafter.step(dataclasses.replace(ctx, positions=ctx.positions.float()), tokens, hidden)
        with pytest.raises(ValueError, match="rms_norm_q_rope: positions"):
            drafter.step(dataclasses.replace(ctx, positions=ctx.positions.repeat(3)), tokens, hidden)

        down = drafter.layers[1].mlp.down_proj
        down.weight.data = down.weight.data * 2  # new values at a new address: checked again, and used
        third = drafter.step(ctx, tokens, hidden)
        assert len(checks) == 2 * glue_calls
        assert not torch.equal(third[1], second[1])
        # a replaced module, parameter or buffer is seen too (the step reads the modules' own dicts)
        layer = drafter.layers[1]
        layer.mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
        layer.mlp.down_proj.weight.data.copy_(down.weight.data)
        fourth = drafter.step(ctx, tokens, hidden)
        assert len(checks) == 3 * glue_calls
        assert torch.equal(fourth[1], third[1])
        layer.layer_scalar = layer.layer_scalar * 3  # a new buffer under the same name
        assert not torch.equal(drafter.step(ctx, tokens, hidden)[1], fourth[1])
        assert len(checks) == 4 * glue_calls
        layer.mlp.down_proj = torch.nn.Linear(down.in_features + 8, down.out_features, bias=False)
        with pytest.raises(ValueError, match="rms_norm_gate_up: down_weight"):
            drafter.step(ctx, tokens, hidden)


def test_unchecked_glue_resolves_with_the_shapes_the_ops_pass(models, monkeypatch):
    """The unchecked glue calls resolve their backend with the shape parameters the public ops pass
    (so backend="auto" follows verified.py's evidence per shape in both), once per shape."""
    import gemma4_mtp_kernels.ops as ops_pkg

    _, _, target, drafter = models
    drafter = copy.deepcopy(drafter)
    seen = {"checked": [], "unchecked": []}
    for op in ("rms_norm_gate_up", "rms_norm_linear", "rms_norm_q_rope"):
        module = importlib.import_module(f"gemma4_mtp_kernels.ops.{op}")
        real = module.resolve
        monkeypatch.setattr(module, "resolve", lambda *a, _real=real: seen["checked"].append(a[:1] + a[4:]) or _real(*a))
    real = ops_pkg.resolve
    monkeypatch.setattr(ops_pkg, "resolve", lambda *a, _real=real: seen["unchecked"].append(a[:1] + a[4:]) or _real(*a))
    with _one_request(target, drafter, 4) as (ctx, tokens, hidden):
        drafter.step(ctx, tokens, hidden)
        drafter.step(ctx, tokens, hidden)
        drafter.step(ctx, tokens, hidden)  # every shape resolved already: no resolve at all
    distinct = sorted({(op, tuple(sorted(shape.items()))) for op, shape in seen["checked"]})
    assert sorted((op, tuple(sorted(shape.items()))) for op, shape in seen["unchecked"]) == distinct
    assert {op for op, _ in distinct} == {"rms_norm_gate_up", "rms_norm_linear", "rms_norm_q_rope"}


def test_check_target_rejects_mismatches(models):
    _, _, target, drafter = models
    drafter.check_target(target)
    bad = copy.copy(drafter)
    bad.config = dataclasses.replace(drafter.config, backbone_hidden_size=32)
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        bad.check_target(target)
    spec = drafter.config.text.attention["sliding_attention"]
    wide = dataclasses.replace(drafter.config.text, attention={
        **drafter.config.text.attention, "sliding_attention": dataclasses.replace(spec, window=spec.window + 1)})
    bad.config = dataclasses.replace(drafter.config, text=wide)
    with pytest.raises(ValueError, match="sliding_window"):
        bad.check_target(target)


def test_backend_reaches_the_ops(models, tmp_path):
    """The drafter's backend knob goes to the ops: an explicitly requested backend that cannot serve
    CPU tensors raises instead of falling back to the reference."""
    _, hf_d, target, _ = models
    hf_d.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path, backend="cuda")
    r = target.new_request()
    try:
        target.prefill([r], [torch.tensor([3, 4, 5])])
        ctx = drafter.context(target, [r])
        with pytest.raises(BackendUnavailableError, match="fused_concat_down_proj"):
            drafter.step(ctx, torch.tensor([[6]]), torch.zeros(1, 1, hf_tiny.HB))
    finally:
        target.release(r)
