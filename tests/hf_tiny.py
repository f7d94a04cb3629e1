"""Tiny random Hugging Face Gemma 4 targets and assistants, saved with save_pretrained (the oracle side),
and the greedy decoding oracle over Hugging Face's forward.

Head dims are 64 (sliding) and 128 (full), the smallest pair the ops support that keeps the real
1:2 ratio; GQA on sliding layers; attention_k_eq_v and the centroid head are switches. FAMILIES
holds one tiny target per Gemma 4 family, with the family's structural features (not its sizes,
which live in gemma4_mtp_kernels/drafter_shapes.py).
"""
from __future__ import annotations

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

VOCAB = 128
HB = 64  # target hidden
HD = 32  # drafter hidden
WINDOW = 8
S, F = "sliding_attention", "full_attention"
TARGET_LAYERS = [S, F, S, F]
DRAFTER_LAYERS = [S, S, S, F]

FAMILIES = {
    # PLE; the last 3 of 6 layers KV-shared: they read layers 1 (sliding) and 2 (full), which are not
    # the last layers of their types; double-wide MLPs on the shared layers; one KV head (MQA)
    "E2B": dict(layers=[S, S, F, S, S, F], kv_heads=1, ple=16, kv_shared=3, double_wide=True, k_eq_v=False,
                ordered=True),  # ordered: the drafter's centroid head
    # PLE; the last 2 of 5 layers KV-shared (sources: layer 2 sliding, layer 1 full); 2 KV heads
    "E4B": dict(layers=[S, F, S, S, F], kv_heads=2, ple=16, kv_shared=2, k_eq_v=False, ordered=True),
    # a dense MLP and 4 routed experts (top 2) side by side in every layer; attention_k_eq_v
    "26B-A4B": dict(layers=TARGET_LAYERS, kv_heads=2, k_eq_v=True, ordered=False,
                    moe=dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    # dense; attention_k_eq_v with one global KV head
    "31B": dict(layers=TARGET_LAYERS, kv_heads=2, k_eq_v=True, ordered=False),
}


def _text_config(*, hidden, layers, k_eq_v, softcap=None, tie=True, vocab=VOCAB, kv_heads=2, ple=0, kv_shared=0,
                 double_wide=False, moe=None):
    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1 if k_eq_v else None, attention_k_eq_v=k_eq_v, sliding_window=WINDOW,
        layer_types=list(layers), hidden_size_per_layer_input=ple, vocab_size_per_layer_input=vocab if ple else 0,
        num_kv_shared_layers=kv_shared, use_double_wide_mlp=double_wide, enable_moe_block=moe is not None,
        **(moe or {}),
        final_logit_softcapping=softcap, tie_word_embeddings=tie, eos_token_id=1, pad_token_id=0, bos_token_id=2)


def family_text_config(family, *, softcap=30.0, tie=True):
    f = FAMILIES[family]
    return _text_config(hidden=HB, layers=f["layers"], k_eq_v=f["k_eq_v"], softcap=softcap, tie=tie,
                        kv_heads=f["kv_heads"], ple=f.get("ple", 0), kv_shared=f.get("kv_shared", 0),
                        double_wide=f.get("double_wide", False), moe=f.get("moe"))


@torch.no_grad()
def _randomize(model, g):
    """O(1) activations everywhere (HF's 0.02 init makes every logit nearly equal), norm weights and
    layer scalars away from 1 so that a misplaced one shows."""
    for name, p in model.named_parameters():
        if (p.dim() == 1 and "norm" in name) or name.endswith("router.scale"):  # every norm weight, _1 / _2 too
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith("per_expert_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith("router.proj.weight"):
            # unit-variance router logits: clear top-k choices, not near-ties that rounding could flip
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.dim() >= 2:  # linears [out, in] and the experts' [E, out, in]
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if "embed" not in name else 1.0))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))


def build_target(path, *, seed=0, k_eq_v=True, softcap=30.0, tie=True, family=None):
    """A random Gemma4ForCausalLM: the 4-layer dense target, or FAMILIES[family] (which sets k_eq_v)."""
    g = torch.Generator().manual_seed(seed)
    if family is None:
        cfg = _text_config(hidden=HB, layers=TARGET_LAYERS, k_eq_v=k_eq_v, softcap=softcap, tie=tie)
    else:
        cfg = family_text_config(family, softcap=softcap, tie=tie)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval()
    _randomize(model, g)
    model.save_pretrained(path)
    return model


def build_drafter(path, *, seed=1, k_eq_v=True, ordered=False, num_centroids=16, top_k=4, kv_heads=2):
    """kv_heads (and k_eq_v): the target's, which HF's assistant uses to group its query heads."""
    g = torch.Generator().manual_seed(seed)
    text = _text_config(hidden=HD, layers=DRAFTER_LAYERS, k_eq_v=k_eq_v, kv_heads=kv_heads)
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=HB, use_ordered_embeddings=ordered,
                                num_centroids=num_centroids, centroid_intermediate_top_k=top_k)
    cfg._attn_implementation = "eager"
    model = Gemma4AssistantForCausalLM(cfg).eval()
    _randomize(model, g)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=g))
    model.save_pretrained(path)
    return model


@torch.no_grad()
def build_agreeing_pair(target_path, drafter_path, *, seed=0, ordered=False, noise=0.5, family=None):
    """A target whose greedy next token is one of two functions of the current token, pi(t) or
    sigma(t) = pi(t + 1), the context deciding which; and a drafter wired to the same two choices, so
    its top-2 usually holds the target's pick and its top-1 matches about half the time.

    Target: the residual stream is dominated by the scaled embedding E[t] (the attention and MLP
    branches are scaled by `noise` through their post-norm weights, so context still tips the
    balance); its untied LM head row v is E[pi^-1(v)] + E[sigma^-1(v)]. Drafter: pre_projection copies
    the first HD coordinates of E[t]; its LM head rows are those coordinates of the same two rows.
    With a family, every branch into the residual stream (per-layer embeddings included) is scaled
    by `noise`. (With the centroid head, ordered=True, the right clusters are often not selected:
    acceptance drops to ~0.2.)
    """
    g = torch.Generator().manual_seed(seed)
    target = build_target(target_path, seed=seed, k_eq_v=True, tie=False, family=family)
    fam = FAMILIES.get(family, dict(k_eq_v=True, kv_heads=2))
    drafter = build_drafter(drafter_path, seed=seed + 1, k_eq_v=fam["k_eq_v"], ordered=ordered,
                            kv_heads=fam["kv_heads"])
    V = VOCAB
    pi = torch.randperm(V, generator=g)
    sigma = pi[(torch.arange(V) + 1) % V]
    pi_inv, sigma_inv = torch.argsort(pi), torch.argsort(sigma)
    E = torch.randn(V, HB, generator=g)
    target.model.embed_tokens.weight.copy_(E)
    target.lm_head.weight.copy_(E[pi_inv] + E[sigma_inv])
    for layer in target.model.layers:
        layer.post_attention_layernorm.weight.mul_(noise)
        layer.post_feedforward_layernorm.weight.mul_(noise)
        if target.config.hidden_size_per_layer_input:
            layer.post_per_layer_input_norm.weight.mul_(noise)
        layer.layer_scalar.fill_(1.0)
    target.model.norm.weight.fill_(1.0)
    target.save_pretrained(target_path)

    pre = torch.zeros(HD, 2 * HB)
    pre[:, :HD] = torch.eye(HD)
    drafter.pre_projection.weight.copy_(pre)
    for layer in drafter.model.layers:
        layer.post_attention_layernorm.weight.mul_(noise)
        layer.post_feedforward_layernorm.weight.mul_(noise)
        layer.layer_scalar.fill_(1.0)
    drafter.model.norm.weight.fill_(1.0)
    head = E[pi_inv, :HD] + E[sigma_inv, :HD]
    drafter.model.embed_tokens.weight.copy_(head)
    if ordered:
        clusters = drafter.masked_embedding.token_ordering.view(drafter.config.num_centroids, -1)
        drafter.masked_embedding.centroids.weight.copy_(head[clusters].sum(1))
    drafter.save_pretrained(drafter_path)
    return target, drafter


@torch.no_grad()
def greedy_oracle(hf, prompts, max_new, eos=None):
    """Greedy continuations [max_new or up to the first eos] of each prompt, by recomputing Hugging
    Face's forward over the whole sequence (no KV cache) at every step: argmax of the last logits, ties
    to the lowest id. Unlike generate(), nothing here depends on HF's cache handling (generate can
    drift from the forward on sliding-window targets once the sequence outgrows the window).
    Prompts of equal length run as one batch."""
    out = [None] * len(prompts)
    by_len = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for n, idx in by_len.items():
        ids = torch.stack([torch.as_tensor(prompts[i]).long() for i in idx])
        for _ in range(max_new):
            nxt = hf(ids, use_cache=False).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if eos is not None and bool((ids[:, n:] == eos).any(1).all()):
                break
        for row, i in enumerate(idx):
            gen = ids[row, n:]
            if eos is not None and bool((gen == eos).any()):
                gen = gen[:int((gen == eos).nonzero()[0]) + 1]
            out[i] = gen
    return out


@torch.no_grad()
def exact_distribution(hf, prompt, steps, temperature, floor=1e-6):
    """P(continuation) of `steps` tokens after `prompt` from the HF target's own logits (its forward over
    the whole sequence, no cache), over the continuations above `floor`."""
    seqs = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for s, p in seqs.items():
            ids = torch.cat([prompt, torch.tensor(s, dtype=torch.long)])
            probs = torch.softmax(hf(ids[None], use_cache=False).logits[0, -1].double() / temperature, -1)
            for v in torch.nonzero(probs * p > floor).flatten().tolist():
                grown[s + (v,)] = p * float(probs[v])
        seqs = grown
    return seqs


def check_distribution(samples, exact):
    """Chi-square of sampled continuations (tuples) against `exact_distribution`: every continuation
    expected at least 5 times is a bin, everything rarer one more bin."""
    from collections import Counter

    from scipy.stats import chisquare

    n = len(samples)
    counts = Counter(samples)
    frequent = [s for s, p in exact.items() if p * n >= 5]
    expected = [exact[s] * n for s in frequent] + [n - sum(exact[s] * n for s in frequent)]
    observed = [counts.get(s, 0) for s in frequent] + [n - sum(counts.get(s, 0) for s in frequent)]
    assert len(frequent) >= 4, "too few frequent continuations for the test to mean anything"
    assert chisquare(observed, expected).pvalue > 1e-3
