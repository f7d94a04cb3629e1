"""gemma4_mtp.hf.accelerate: Hugging Face assisted generation with the assistant's forward routed
through the ops.

Oracles: Hugging Face's own assistant forward (the un-accelerated copy of the same weights) for the
numbers and for every drafted token, and a greedy loop that recomputes Hugging Face's target forward
over the whole sequence for the generated text (`generate` drifts from the forward on sliding
targets when the prompt is longer than the window, issue 10). Prompts are longer than the window
(8), batch 1 for `generate` (what Hugging Face's assisted generation supports); direct forwards
also run batch 2, padding masks and non-contiguous K/V layouts.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

import gemma4_mtp_kernels as K
import hf_tiny
from gemma4_mtp.hf import accelerate

BACKENDS = ["torch", "triton"]
PROMPT_LEN, NEW_TOKENS = 19, 16
W = hf_tiny.WINDOW
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@torch.no_grad()
def recompute_greedy(model, prompt, n):
    """The prompt and its target-only greedy continuation, by recomputing Hugging Face's forward over
    the whole sequence (hf_tiny.greedy_oracle): the sequence generate() returns."""
    return torch.cat([prompt, hf_tiny.greedy_oracle(model, [prompt], n)[0]])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """(target, plain assistant) per drafter family: centroid head and dense head on the agreeing
    pair (drafts are mostly accepted), and a random centroid pair with 2 full-layer KV heads."""
    d = tmp_path_factory.mktemp("hf_accel")
    out = {}
    for name, ordered in (("centroid", True), ("dense", False)):
        out[name] = hf_tiny.build_agreeing_pair(d / f"{name}_t", d / f"{name}_d", seed=3, ordered=ordered)
    out["random_centroid"] = (hf_tiny.build_target(d / "rt", seed=21, k_eq_v=False, tie=False),
                              hf_tiny.build_drafter(d / "rd", seed=22, k_eq_v=False, ordered=True))
    return out


def _drafts_of(model, sink):
    """Record the token each assistant call drafts (what the candidate generator takes: the argmax
    of the logits) and its logits."""
    return model.register_forward_hook(lambda m, a, kw, o: sink.append((o.logits.argmax(-1).flatten().tolist(),
                                                                        o.logits.detach().clone())),
                                       with_kwargs=True)


def _counter(model, box):
    return model.register_forward_hook(lambda *a: box.__setitem__(0, box[0] + 1))


@pytest.mark.parametrize("family, backend", [
    (f, b) if (f, b) != ("random_centroid", "triton") else pytest.param(f, b, marks=pytest.mark.slow)
    for f in ("centroid", "dense", "random_centroid") for b in BACKENDS])
def test_generate_token_for_token(pairs, family, backend, one_thread):
    target, plain = pairs[family]
    plain = copy.deepcopy(plain)
    # 4 drafts a round, always (HF's default schedule starts at 20 and adapts): the interpreter's time
    plain.generation_config.num_assistant_tokens = 4
    plain.generation_config.num_assistant_tokens_schedule = "constant"
    fast = accelerate(copy.deepcopy(plain), backend=backend)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, hf_tiny.VOCAB, (PROMPT_LEN,), generator=g)
    ref = recompute_greedy(target, prompt, NEW_TOKENS)
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    runs = {}
    for name, assistant in (("plain", plain), ("fast", fast)):
        drafts, forwards = [], [0]
        hooks = [_drafts_of(assistant, drafts), _counter(target, forwards)]
        try:
            out = target.generate(prompt[None], assistant_model=assistant, **kw)[0]
        finally:
            for h in hooks:
                h.remove()
        runs[name] = out, drafts, forwards[0]
    assert torch.equal(runs["plain"][0], ref), "Hugging Face's own assisted generation left target-only greedy"
    assert torch.equal(runs["fast"][0], ref)
    plain_drafts, fast_drafts = runs["plain"][1], runs["fast"][1]
    assert len(plain_drafts) > NEW_TOKENS // 2
    assert [t for t, _ in fast_drafts] == [t for t, _ in plain_drafts]
    for (_, a), (_, b) in zip(fast_drafts, plain_drafts):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if family != "random_centroid":  # the agreeing pair: accepted drafts save target forwards (one per token without)
        assert runs["fast"][2] == runs["plain"][2] < NEW_TOKENS


# ---- direct forwards: layouts, masks, batch 2 ---------------------------------------------------------

def _kv_heads(model, layer_type):
    text = model.config.get_text_config()
    i = text.layer_types.index(layer_type)
    attn = model.model.layers[i].self_attn
    return text.num_attention_heads // attn.num_key_value_groups, attn.head_dim


def _kv(B, H, S, D, layout, g):
    """K or V [B, H, S, D] as Hugging Face may hand it over: contiguous, sliced along S from a
    longer cache (what the candidate generator does), or permuted from [B, S, H, D]."""
    if layout == "contiguous":
        return torch.randn(B, H, S, D, generator=g)
    if layout == "sliced":
        return torch.randn(B, H, S + 5, D, generator=g)[:, :, :S]
    if layout == "permuted":
        return torch.randn(B, S, H, D, generator=g).permute(0, 2, 1, 3)
    raise AssertionError(layout)


def _inputs(model, *, B, S_full, S_swa, layout="contiguous", mask=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hb = model.config.backbone_hidden_size
    shared = {}
    for lt, S in (("full_attention", S_full), ("sliding_attention", S_swa)):
        H, D = _kv_heads(model, lt)
        shared[lt] = (_kv(B, H, S, D, layout, g), _kv(B, H, S, D, layout, g))
    emb, hid = torch.randn(B, 1, Hb, generator=g), torch.randn(B, 1, Hb, generator=g)
    return dict(inputs_embeds=torch.cat([emb, hid], dim=-1), shared_kv_states=shared, attention_mask=mask,
                position_ids=torch.full((B, 1), S_full - 1), use_cache=False)


def _mask(B, L, holes):
    m = torch.ones(B, L, dtype=torch.long)
    for b, s in holes:
        m[b, s] = 0
    return m


CASES = {  # name: (B, S_full, S_swa, layout, holes of the padding mask or None)
    "window_cut": (1, 19, 15, "sliced", None),
    "window_plus_one": (1, 9, 9, "contiguous", None),
    "exactly_window": (1, 12, 8, "permuted", None),
    "shorter_than_window": (1, 5, 5, "contiguous", None),
    "batch2_sliced": (2, 17, 11, "sliced", None),
    "batch2_permuted_mask": (2, 14, 12, "permuted", [(0, 0), (0, 1), (0, 2), (1, 9), (1, 12)]),
    "left_padding": (1, 16, 10, "contiguous", [(0, 0), (0, 1), (0, 2), (0, 3)]),
    "mask_all_ones": (1, 13, 13, "sliced", []),
}


@pytest.fixture(scope="module")
def assistants(pairs):
    return {"centroid": pairs["centroid"][1], "dense": pairs["dense"][1], "random_centroid": pairs["random_centroid"][1]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", ["random_centroid", "dense"])
def test_forward_matches_hugging_face(assistants, family, case, backend, one_thread):
    plain = assistants[family]
    fast = accelerate(copy.deepcopy(plain), backend=backend)
    B, S_full, S_swa, layout, holes = CASES[case]
    mask = None if holes is None else _mask(B, S_full, holes)
    inp = _inputs(plain, B=B, S_full=S_full, S_swa=S_swa, layout=layout, mask=mask, seed=len(case))
    with torch.no_grad():
        want = plain(**inp)
    got = fast(**inp)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-4, atol=1e-4)
    assert got.logits.dtype == want.logits.dtype and got.logits.shape == want.logits.shape
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    top2 = want.logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3
    assert torch.equal(got.logits.argmax(-1)[clear], want.logits.argmax(-1)[clear])


@pytest.mark.parametrize("backend", BACKENDS)
def test_attends_hf_window_plus_one_and_the_mask(assistants, backend, one_thread):
    """Independent of Hugging Face: the sliding layers read exactly the last window + 1 entries and
    the full layers every entry, minus masked ones. Entries outside are NaN-poisoned (never read);
    changing the oldest in-window entry changes the answer."""
    fast = accelerate(copy.deepcopy(assistants["random_centroid"]), backend=backend)
    S_full, S_swa, hole = 19, 15, 16  # hole: a masked position, inside the sliding window
    mask = _mask(1, S_full, [(0, hole)])
    inp = _inputs(fast, B=1, S_full=S_full, S_swa=S_swa, layout="sliced", mask=mask, seed=7)
    base = fast(**inp)
    k_swa, v_swa = inp["shared_kv_states"]["sliding_attention"]
    k_full, v_full = inp["shared_kv_states"]["full_attention"]
    first = S_swa - (W + 1)
    with torch.no_grad():
        for t in (k_swa, v_swa):
            t[:, :, :first] = float("nan")
            t[:, :, hole - (S_full - S_swa)] = float("nan")
        for t in (k_full, v_full):
            t[:, :, hole] = float("nan")
    poisoned = fast(**inp)
    assert torch.equal(poisoned.logits, base.logits) and torch.equal(poisoned.last_hidden_state, base.last_hidden_state)
    with torch.no_grad():
        k_swa[:, :, first] += 3.0
    moved = fast(**inp)
    assert not torch.allclose(moved.last_hidden_state, base.last_hidden_state, rtol=1e-3, atol=1e-3)


def test_kv_is_read_in_place_and_preprojection_is_fused(assistants, monkeypatch):
    """The attention op receives views of Hugging Face's K/V storage (no copy), and the
    pre-projection goes through fused_concat_down_proj when inputs_embeds is a plain concat, through
    the Linear when its halves cannot be viewed as rows (same numbers either way)."""
    real_attn, real_proj = K.q_only_paged_attention, K.fused_concat_down_proj
    seen, fused = [], [0]

    def attn_spy(q, k_cache, v_cache, *a, **kw):
        seen.append((k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()))
        return real_attn(q, k_cache, v_cache, *a, **kw)

    def proj_spy(*a, **kw):
        fused[0] += 1
        return real_proj(*a, **kw)

    monkeypatch.setattr(K, "q_only_paged_attention", attn_spy)
    monkeypatch.setattr(K, "fused_concat_down_proj", proj_spy)
    plain = assistants["dense"]
    fast = accelerate(copy.deepcopy(plain), backend="torch")
    inp = _inputs(plain, B=1, S_full=19, S_swa=15, layout="permuted")
    got = fast(**inp)
    storages = {lt: (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
                for lt, (k, v) in inp["shared_kv_states"].items()}
    types_ = plain.config.get_text_config().layer_types
    assert seen == [storages[lt] for lt in types_]
    assert fused[0] == 1
    wide = torch.randn(1, 1, 2 * inp["inputs_embeds"].shape[-1])
    wide[..., ::2] = inp["inputs_embeds"]
    strided = dict(inp, inputs_embeds=wide[..., ::2])  # stride 2 in the last dimension
    assert strided["inputs_embeds"].stride(-1) == 2
    again = fast(**strided)
    assert fused[0] == 1
    torch.testing.assert_close(again.logits, got.logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        want = plain(**inp)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)


# ---- refusals -------------------------------------------------------------------------------------------

def _assistant(*, ordered=False, num_centroids=16, top_k=4, **text_kw):
    text = dict(vocab_size=hf_tiny.VOCAB, hidden_size=hf_tiny.HD, intermediate_size=2 * hf_tiny.HD,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
                sliding_window=W, layer_types=list(hf_tiny.DRAFTER_LAYERS), hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0)
    text.update(text_kw)
    cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=hf_tiny.HB,
                                use_ordered_embeddings=ordered, num_centroids=num_centroids,
                                centroid_intermediate_top_k=top_k)
    cfg._attn_implementation = "eager"
    return Gemma4AssistantForCausalLM(cfg).eval()


def _untouched(model):
    mods = [model] + [layer.self_attn for layer in getattr(getattr(model, "model", None), "layers", [])]
    return all("forward" not in vars(m) for m in mods) and not hasattr(model, "gemma4_mtp_backend")


REFUSALS = {
    "head_dim": (lambda: _assistant(head_dim=96), ValueError, "text_config.head_dim"),
    "global_head_dim": (lambda: _assistant(global_head_dim=96), ValueError, "text_config.global_head_dim"),
    "top_k": (lambda: _assistant(ordered=True, num_centroids=16, top_k=32), ValueError, "centroid_intermediate_top_k"),
    "num_centroids": (lambda: _assistant(ordered=True, num_centroids=24, top_k=4), ValueError, "num_centroids"),
    "dtype": (lambda: _assistant().double(), ValueError, "dtype"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refuses_what_it_cannot_serve_and_leaves_the_model(name):
    build, exc, field = REFUSALS[name]
    model = build()
    with pytest.raises(exc, match=field):
        accelerate(model)
    assert _untouched(model)


def test_refuses_other_models_and_backends(pairs):
    target, plain = pairs["dense"]
    with pytest.raises(TypeError, match="assistant_model"):
        accelerate(target)
    assert _untouched(target)
    model = copy.deepcopy(plain)
    with pytest.raises(ValueError, match="backend"):
        accelerate(model, backend="fastest")
    assert _untouched(model)


def test_call_time_errors_name_the_argument(assistants):
    plain = assistants["dense"]
    fast = accelerate(copy.deepcopy(plain), backend="torch")
    inp = _inputs(plain, B=1, S_full=12, S_swa=9)
    two = dict(inp, inputs_embeds=inp["inputs_embeds"].expand(1, 2, -1).contiguous(),
               position_ids=torch.tensor([[10, 11]]))
    with pytest.raises(ValueError, match="inputs_embeds"):
        fast(**two)
    with pytest.raises(ValueError, match="shared_kv_states"):
        fast(**dict(inp, shared_kv_states={"sliding_attention": inp["shared_kv_states"]["sliding_attention"]}))
    with pytest.raises(ValueError, match="output_attentions"):
        fast(**inp, output_attentions=True)
    with pytest.raises(ValueError, match="attention_mask"):
        fast(**dict(inp, attention_mask=torch.ones(1, 5, dtype=torch.long)))
    x = plain.pre_projection(inp["inputs_embeds"])
    with pytest.raises(TypeError, match="accelerated assistant"):
        fast.model(inputs_embeds=x, shared_kv_states=inp["shared_kv_states"], position_ids=inp["position_ids"])


def test_return_dict_false_gives_hugging_faces_tuple(assistants):
    plain = assistants["centroid"]
    fast = accelerate(copy.deepcopy(plain), backend="torch")
    inp = _inputs(plain, B=1, S_full=12, S_swa=9)
    out = fast(**inp, return_dict=False)
    with torch.no_grad():
        want = plain(**inp, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(want)
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ---- the benchmark's CPU dry mode, and the GPU path ----------------------------------------------------------

@pytest.mark.slow
def test_benchmark_dry_run(tmp_path):
    out = tmp_path / "hf.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [ROOT, os.path.join(ROOT, "python_api"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_hf_assisted", "--dry-run", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["reference"] == "recompute greedy"
    assert {r["assistant"] for r in res["runs"]} == {"target_only", "hf_assistant", "accelerated_torch",
                                                     "accelerated_triton"}
    for r in res["runs"]:
        assert r["status"] == "ok", r
        assert r["matches_reference"] is True, r["assistant"]
        assert "tokens_per_s" not in r  # no timings in a dry run
        assert (r["assistant_calls"] > 0) == (r["assistant"] != "target_only")
    assert [r["status"] for r in res["assistant_forward"]] == ["ok"] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_generate_on_cuda(pairs, backend):
    from gemma4_mtp_kernels import BackendUnavailableError
    target, plain = (copy.deepcopy(m).cuda() for m in pairs["centroid"])
    try:
        fast = accelerate(copy.deepcopy(plain), backend=backend)
        prompt = torch.randint(3, hf_tiny.VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).cuda()
        kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        want = target.generate(prompt[None], assistant_model=plain, **kw)
        got = target.generate(prompt[None], assistant_model=fast, **kw)
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    assert torch.equal(got, want)
    assert torch.equal(want[0].cpu(), recompute_greedy(pairs["centroid"][0], prompt.cpu(), NEW_TOKENS))
