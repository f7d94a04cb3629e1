"""The Hugging Face implementation (transformers 5.17.0) as the external oracle for two ops (SPEC §6):
fused_concat_down_proj == Gemma4AssistantForCausalLM.pre_projection(cat(target embed_tokens(ids), h)),
centroid_logits == Gemma4AssistantMaskedEmbedder (dense with HF's fill value, and its argmax)."""
import math

import pytest
import torch

import gemma4_mtp_kernels as g

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

DTYPES = (torch.float32, torch.bfloat16)


def tiny_text_config(hidden_size, vocab_size, **overrides):
    """A 2-layer Gemma 4 text config (one sliding, one full layer) small enough for CPU tests."""
    cfg = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
               hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"])
    cfg.update(overrides)
    return Gemma4TextConfig(**cfg)


def tiny_target(Hb, vocab_size, dtype):
    torch.manual_seed(1)
    return Gemma4ForCausalLM(tiny_text_config(Hb, vocab_size)).to(dtype).eval()


def tiny_drafter(Hb, Hd, vocab_size, dtype, *, num_centroids=None, top_k=None, seed=2):
    """A Gemma4AssistantForCausalLM; with num_centroids, the ordered-embedding (centroid) head, whose
    token_ordering is a random permutation and whose weights are O(1) so that scores are well spread."""
    torch.manual_seed(seed)
    ordered = num_centroids is not None
    extra = dict(num_centroids=num_centroids, centroid_intermediate_top_k=top_k) if ordered else {}
    cfg = Gemma4AssistantConfig(text_config=tiny_text_config(Hd, vocab_size), backbone_hidden_size=Hb,
                                use_ordered_embeddings=ordered, **extra)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        model.pre_projection.weight.normal_(0, 1 / math.sqrt(2 * Hb))
        if ordered:
            model.masked_embedding.centroids.weight.normal_(0, 1 / math.sqrt(Hd))
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab_size))
            model.lm_head.weight.normal_(0, 1 / math.sqrt(Hd))
    return model.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_concat_down_proj_equals_hf_pre_projection(dtype):
    Hb, Hd, V, T = 1536, 64, 50, 9  # Hb of E2B: HF's bf16 embedding scale is 39.25, not sqrt(1536)
    target = tiny_target(Hb, V, dtype)
    drafter = tiny_drafter(Hb, Hd, V, dtype)
    embed = target.model.embed_tokens
    ids = torch.randint(0, V, (T,))
    h = torch.randn(T, Hb).to(dtype)
    with torch.no_grad():
        e_hf = embed(ids)
        y_hf = drafter.pre_projection(torch.cat([e_hf, h], dim=-1))
        y = g.fused_concat_down_proj(ids, embed.weight, h, drafter.pre_projection.weight,
                                     embed_scale=math.sqrt(Hb), backend="torch")
        # with weight = [I | 0] the op returns its scaled embedding rows: bitwise HF's, both roundings included
        eye = torch.cat([torch.eye(Hb), torch.zeros(Hb, Hb)], dim=1).to(dtype)
        e = g.fused_concat_down_proj(ids, embed.weight, h, eye, embed_scale=math.sqrt(Hb), backend="torch")
    assert torch.equal(e, e_hf)
    if dtype == torch.bfloat16:
        assert embed.embed_scale.to(dtype).item() == 39.25
    assert y.dtype == y_hf.dtype == dtype
    # both round one fp32-accumulated sum to the output dtype
    exact = torch.cat([e_hf, h], dim=-1).double() @ drafter.pre_projection.weight.double().T
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
    torch.testing.assert_close(y.double(), y_hf.double(), rtol=ulp, atol=1e-6)
    assert (y.double() - exact).abs().max() <= 1.01 * (y_hf.double() - exact).abs().max() + 1e-6


def well_separated_inputs(drafter, T, dtype, margin):
    """hidden rows whose top_k-th and (top_k+1)-th centroid scores differ by more than `margin` (relative),
    so that HF's torch.topk on dtype-rounded scores and our fp32 selection must pick the same clusters."""
    emb = drafter.masked_embedding
    k = emb.centroid_intermediate_top_k
    W = emb.centroids.weight.double()
    rows = []
    gen = torch.Generator().manual_seed(3)
    for _ in range(2000):
        h = torch.randn(1, W.shape[1], generator=gen).to(dtype)
        s = (h.double() @ W.T).sort(descending=True).values[0]
        if s[k - 1] - s[k] > margin * s.abs().max():
            rows.append(h)
            if len(rows) == T:
                return torch.cat(rows)
    raise AssertionError("could not build well separated inputs")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_centroid_logits_equals_hf_masked_embedder(dtype):
    Hb, Hd, C, M, top_k, T = 48, 64, 16, 8, 4, 6
    V = C * M
    drafter = tiny_drafter(Hb, Hd, V, dtype, num_centroids=C, top_k=top_k)
    emb = drafter.masked_embedding
    hidden = well_separated_inputs(drafter, T, dtype, margin=0.05)
    hf = emb(hidden.view(2, T // 2, Hd), drafter.lm_head.weight).reshape(T, V)
    args = (hidden, emb.centroids.weight, emb.token_ordering, drafter.lm_head.weight)
    ids, logits = g.centroid_logits(*args, top_k=top_k, output="sparse", backend="torch")
    fill = float(logits.min()) - 1.0  # HF fills with (min of all selected logits) - 1
    dense = g.centroid_logits(*args, top_k=top_k, output="dense", fill_value=fill, backend="torch")
    assert dense.dtype == torch.float32
    # HF rounds its logits (and its fill) to the model dtype; we keep fp32
    tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(dense, hf.float(), rtol=tol, atol=tol)
    candidates = torch.zeros(T, V, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.equal(hf.float() > hf.float().min(), candidates), "same candidate set as HF"

    token, best = g.centroid_logits(*args, top_k=top_k, output="argmax", backend="torch")
    hf_token = hf.argmax(dim=-1)
    for t in range(T):
        # a different token is only acceptable if HF's own (rounded) logits tie it with HF's choice
        assert token[t] == hf_token[t] or hf[t, token[t]] == hf[t, hf_token[t]], t
        assert abs(float(best[t]) - float(hf[t, token[t]])) <= tol * (1 + abs(float(best[t])))
