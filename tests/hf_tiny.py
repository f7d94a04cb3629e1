"""Tiny random Hugging Face Gemma 4 targets and assistants, saved with save_pretrained (the oracle side).

Head dims are 64 (sliding) and 128 (full), the smallest pair the ops support that keeps the real
1:2 ratio; GQA on sliding layers; attention_k_eq_v and the centroid head are switches.
"""
from __future__ import annotations

import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

VOCAB = 128
HB = 64  # target hidden
HD = 32  # drafter hidden
WINDOW = 8
TARGET_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
DRAFTER_LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def _text_config(*, hidden, layers, k_eq_v, softcap=None, tie=True, vocab=VOCAB):
    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
        num_global_key_value_heads=1 if k_eq_v else None, attention_k_eq_v=k_eq_v, sliding_window=WINDOW,
        layer_types=list(layers), hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        final_logit_softcapping=softcap, tie_word_embeddings=tie, eos_token_id=1, pad_token_id=0, bos_token_id=2)


@torch.no_grad()
def _randomize(model, g):
    """O(1) activations everywhere (HF's 0.02 init makes every logit nearly equal), norm weights and
    layer scalars away from 1 so that a misplaced one shows."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5 if "embed" not in name else 1.0))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))


def build_target(path, *, seed=0, k_eq_v=True, softcap=30.0, tie=True):
    g = torch.Generator().manual_seed(seed)
    cfg = _text_config(hidden=HB, layers=TARGET_LAYERS, k_eq_v=k_eq_v, softcap=softcap, tie=tie)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval()
    _randomize(model, g)
    model.save_pretrained(path)
    return model


def build_drafter(path, *, seed=1, k_eq_v=True, ordered=False, num_centroids=16, top_k=4):
    g = torch.Generator().manual_seed(seed)
    text = _text_config(hidden=HD, layers=DRAFTER_LAYERS, k_eq_v=k_eq_v)
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
def build_agreeing_pair(target_path, drafter_path, *, seed=0, ordered=False, noise=0.5):
    """A target whose greedy next token is one of two functions of the current token, pi(t) or
    sigma(t) = pi(t + 1), the context deciding which; and a drafter wired to the same two choices, so
    its top-2 usually holds the target's pick and its top-1 matches about half the time.

    Target: the residual stream is dominated by the scaled embedding E[t] (the attention and MLP
    branches are scaled by `noise` through their post-norm weights, so context still tips the
    balance); its untied LM head row v is E[pi^-1(v)] + E[sigma^-1(v)]. Drafter: pre_projection copies
    the first HD coordinates of E[t]; its LM head rows are those coordinates of the same two rows.
    """
    g = torch.Generator().manual_seed(seed)
    target = build_target(target_path, seed=seed, k_eq_v=True, tie=False)
    drafter = build_drafter(drafter_path, seed=seed + 1, k_eq_v=True, ordered=ordered)
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
