"""The embedded default model shipped in gemma4_mtp/assets (made by `python -m gemma4_mtp.train`).

Transformers 5.17.0 and our loaders read the same checkpoints and agree; on held-out corpus text
(standard-library files the training never saw) greedy speculative decoding reproduces the target's
own greedy decoding and reaches the acceptance bar of issue 7."""
import pytest
import torch

from gemma4_mtp import load_drafter, load_target, speculative_generate
from gemma4_mtp import train as T

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from hf_tiny import greedy_oracle  # noqa: E402  (needs transformers)
pytestmark = pytest.mark.filterwarnings("ignore")

PROMPT_LEN = 64
MIN_TOKENS_PER_FORWARD = 2.5  # issue 7's bar, at 4 greedy draft tokens


@pytest.fixture(scope="module")
def tokenizer():
    return T.load_tokenizer(T.ASSETS)


@pytest.fixture(scope="module")
def held_out(tokenizer):
    return T.held_out_stream(tokenizer)


@pytest.fixture(scope="module")
def hf_models():
    torch.set_num_threads(1)
    target = transformers.Gemma4ForCausalLM.from_pretrained(T.ASSETS / "target", dtype=torch.float32)
    drafter = transformers.Gemma4AssistantForCausalLM.from_pretrained(T.ASSETS / "drafter", dtype=torch.float32)
    return target.eval(), drafter.eval()


@pytest.fixture(scope="module")
def our_models():
    return load_target(T.ASSETS / "target"), load_drafter(T.ASSETS / "drafter", backend="torch")


def held_out_prompts(held_out, n):
    stride = held_out.numel() // n
    return [held_out[i * stride:i * stride + PROMPT_LEN] for i in range(n)]


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_assets_are_small_and_licensed():
    files = [p for p in T.ASSETS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25_000_000
    assert "Python Software Foundation" in (T.ASSETS / "NOTICE.md").read_text()


def test_checkpoints_have_the_training_script_architecture(hf_models):
    target, drafter = hf_models
    want = T.target_config()
    for key in ("vocab_size", "hidden_size", "layer_types", "sliding_window", "final_logit_softcapping",
                "num_attention_heads", "num_key_value_heads", "rope_parameters"):
        assert getattr(target.config, key) == getattr(want, key), key
    assert target.config.hidden_size_per_layer_input == 0 and not target.config.enable_moe_block
    assert target.config.num_kv_shared_layers == 0
    layers = target.model.layers
    assert {layers[i].self_attn.head_dim for i, t in enumerate(want.layer_types) if t == "full_attention"} == {128}
    assert {layers[i].self_attn.head_dim for i, t in enumerate(want.layer_types) if t != "full_attention"} == {64}
    cfg = drafter.config
    assert cfg.use_ordered_embeddings and cfg.text_config.vocab_size % cfg.num_centroids == 0
    ordering = drafter.masked_embedding.token_ordering
    assert torch.equal(ordering.sort().values, torch.arange(cfg.text_config.vocab_size))


def test_tokenizer_round_trips_held_out_text(tokenizer):
    text = T.read_text(T.corpus_files()[2][0])
    ids = tokenizer.encode(text).ids
    assert max(ids) < T.VOCAB_SIZE
    assert tokenizer.decode(ids) == text


@torch.no_grad()
def test_target_logits_match_transformers(hf_models, our_models, held_out):
    hf_target, _ = hf_models
    target, _ = our_models
    # longer than the sliding window, so the window is exercised
    prompt = held_out[1000:1000 + 2 * T.SLIDING_WINDOW + 7]
    ref = hf_target(prompt[None]).logits[0]
    req = target.new_request()
    try:
        ours = target.prefill([req], [prompt]).logits[0]
    finally:
        target.release(req)
    close(ours, ref)


@torch.no_grad()
def test_draft_steps_match_transformers(hf_models, our_models, held_out):
    """Our drafter over our paged cache against the HF assistant over HF's shared_kv_states, at HF's
    query position (P + 1), for three chained steps."""
    hf_target, hf_drafter = hf_models
    target, drafter = our_models
    prompt = held_out[5000:5000 + 2 * T.SLIDING_WINDOW + 3]
    req = target.new_request()
    try:
        pre = target.prefill([req], [prompt])
        out = hf_target(prompt[None], output_hidden_states=True, return_shared_kv_states=True)
        close(pre.hidden[0, -1], out.hidden_states[-1][0, -1])
        ctx = drafter.context(target, [req], "next")
        token = out.logits[0, -1].argmax().view(1, 1)
        hidden, hf_hidden = pre.hidden[:, -1:], out.hidden_states[-1][:, -1:]
        for _ in range(3):
            last, proj = drafter.step(ctx, token, hidden)
            o = hf_drafter(inputs_embeds=torch.cat([hf_target.model.embed_tokens(token), hf_hidden], dim=-1),
                           position_ids=torch.tensor([[len(prompt)]]), shared_kv_states=out.shared_kv_states)
            close(proj[0], o.last_hidden_state[0])
            ours = drafter.logits(last)[0, 0]
            ref = o.logits[0, 0]
            # HF fills the tokens outside the selected clusters with (min candidate logit - 1), ours with -inf
            candidates = torch.isfinite(ours)
            assert torch.equal(candidates, ref > ref.min())
            close(ours[candidates], ref[candidates])
            token = ref.argmax().view(1, 1)
            assert int(drafter.top_tokens(last, 1)[0, 0, 0]) == int(token)
            hidden, hf_hidden = proj, o.last_hidden_state
    finally:
        target.release(req)


@torch.no_grad()
def test_greedy_speculative_decoding_is_exact_and_accepts(hf_models, our_models, held_out):
    hf_target, _ = hf_models
    target, drafter = our_models
    prompts = held_out_prompts(held_out, 6)
    new = 48
    ids, stats = speculative_generate(target, drafter, prompts, max_new_tokens=new, num_draft_tokens=4,
                                      eos_token_id=None)
    # the oracle recomputes HF's forward over the whole sequence each step (no generate() cache path)
    for got, ref in zip(ids, greedy_oracle(hf_target, prompts, new)):
        assert torch.equal(got, ref)
    assert stats.tokens_per_target_forward >= MIN_TOKENS_PER_FORWARD, stats.tokens_per_target_forward


@pytest.mark.slow
def test_training_script_runs_end_to_end(tmp_path):
    """The script itself (few steps): every stage runs and writes checkpoints both loaders accept."""
    T.main(["--out", str(tmp_path), "--target-steps", "2", "--drafter-steps", "2", "--centroid-steps", "2"])
    target, drafter = load_target(tmp_path / "target"), load_drafter(tmp_path / "drafter", backend="torch")
    drafter.check_target(target)
    transformers.Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "drafter")
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "NOTICE.md").is_file()
