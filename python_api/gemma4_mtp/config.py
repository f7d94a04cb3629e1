"""Configs of the Gemma 4 text target and its MTP drafter, read from Hugging Face config.json dicts.

Every Gemma 4 text family is parsed: dense (31B), per-layer embeddings with KV-shared layers and
double-wide MLPs (E2B, E4B), MoE (26B-A4B). Anything the reference loop would silently get wrong
(other RoPE types, bidirectional attention, attention biases, other activations, inconsistent
PLE / KV-sharing / MoE fields) is rejected with a message that names the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")


class UnsupportedModelError(ValueError):
    """The checkpoint is a valid Gemma 4 variant that this reference loop does not implement."""


@dataclass(frozen=True)
class AttentionSpec:
    """Shape and position encoding of one attention type (all layers of the type share it)."""

    head_dim: int
    num_kv_heads: int
    rope_type: str
    rope_theta: float
    partial_rotary_factor: float
    rope_factor: float
    window: int | None  # None for full attention


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    attention: dict  # layer type -> AttentionSpec
    rms_norm_eps: float
    attention_k_eq_v: bool
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # per-layer embeddings (PLE): 0 = none
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    # the last num_kv_shared_layers layers compute no K/V: they attend the last non-shared layer of their type
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers of a target get 2 * intermediate_size
    # MoE: every layer runs a dense MLP and a routed expert block side by side
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def spec(self, layer: int) -> AttentionSpec:
        return self.attention[self.layer_types[layer]]

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_kv_shared(self, layer: int) -> bool:
        return layer >= self.first_kv_shared_layer

    def kv_layer_of(self, layer_type: str) -> int | None:
        """The layer whose K/V the layers of this type publish: the last non-KV-shared one (None if none).
        KV-shared layers of the type and a drafter's layers of the type attend its cache."""
        idx = [i for i, t in enumerate(self.layer_types[:self.first_kv_shared_layer]) if t == layer_type]
        return idx[-1] if idx else None

    def kv_source(self, layer: int) -> int:
        """The layer whose cached K/V `layer` attends: itself, or for a KV-shared layer kv_layer_of its type."""
        return self.kv_layer_of(self.layer_types[layer]) if self.is_kv_shared(layer) else layer

    def mlp_intermediate_size(self, layer: int) -> int:
        # as transformers 5.17: double width only on the KV-shared layers of a model that has non-shared ones
        wide = self.use_double_wide_mlp and 0 < self.first_kv_shared_layer <= layer
        return self.intermediate_size * (2 if wide else 1)


@dataclass(frozen=True)
class DrafterConfig:
    text: TextConfig  # the drafter's own layers (Hd, heads, layer types)
    backbone_hidden_size: int  # Hb, the target's hidden size
    use_ordered_embeddings: bool  # centroid head
    num_centroids: int
    centroid_top_k: int


def _fail(field: str, expected: str, got) -> None:
    raise UnsupportedModelError(f"config field {field!r}: expected {expected}, got {got!r}")


def _rope(params: dict, layer_type: str) -> tuple[str, float, float, float]:
    if not isinstance(params, dict) or layer_type not in params or not isinstance(params[layer_type], dict):
        _fail("rope_parameters", f"a dict with an entry for {layer_type!r}", params)
    p = params[layer_type]
    rope_type = p.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        _fail(f"rope_parameters.{layer_type}.rope_type", f"one of {ROPE_TYPES}", rope_type)
    theta = float(p.get("rope_theta", 10_000.0))
    partial = float(p.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    factor = float(p.get("factor", 1.0)) if rope_type == "proportional" else 1.0
    return rope_type, theta, partial, factor


_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def parse_text_config(d: dict, *, drafter: bool = False) -> TextConfig:
    """A Gemma4TextConfig dict (model_type gemma4_text) as the reference loop needs it.

    Follows transformers 5.17's Gemma4TextConfig defaults and its per-layer overrides: full layers
    take `per_layer_config[i]` when present, else `global_head_dim` (default 512) and, for
    attention_k_eq_v models, `num_global_key_value_heads`.
    """
    def get(key, default=None):
        return d.get(key, default)

    if get("model_type", "gemma4_text") != "gemma4_text":
        _fail("model_type", "'gemma4_text'", get("model_type"))
    if get("use_bidirectional_attention") is not None:
        _fail("use_bidirectional_attention", "null (causal text attention)", get("use_bidirectional_attention"))
    if get("attention_bias", False):
        _fail("attention_bias", "false", get("attention_bias"))
    if get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        _fail("hidden_activation", "'gelu_pytorch_tanh'", get("hidden_activation"))
    num_layers = int(get("num_hidden_layers", 30))
    vocab = int(get("vocab_size", 262_144))
    ple = int(get("hidden_size_per_layer_input", 256) or 0)
    ple_vocab = int(get("vocab_size_per_layer_input", 262_144) or 0)
    moe = bool(get("enable_moe_block", False))
    double_wide = bool(get("use_double_wide_mlp", False))
    shared = int(get("num_kv_shared_layers", 0) or 0)
    if drafter:
        # the assistant's own rules (Gemma4AssistantConfig.validate_architecture)
        if ple:
            _fail("hidden_size_per_layer_input", "0 in a drafter", ple)
        if moe:
            _fail("enable_moe_block", "false in a drafter", moe)
        if double_wide:
            _fail("use_double_wide_mlp", "false in a drafter", double_wide)
        if shared not in (0, num_layers):
            _fail("num_kv_shared_layers", f"{num_layers} (every drafter layer reads the target's K/V)", shared)
        shared = num_layers
    else:
        if not 0 <= shared < num_layers:
            _fail("num_kv_shared_layers", f"an int in [0, {num_layers}) (a target computes K/V in its first layers)",
                  shared)
        if ple < 0:
            _fail("hidden_size_per_layer_input", "an int >= 0", ple)
        if ple and ple_vocab < vocab:
            # Hugging Face looks every token id up in the per-layer table: ids past it have no embedding
            _fail("vocab_size_per_layer_input", f">= vocab_size {vocab} (every token needs a per-layer embedding)",
                  ple_vocab)

    layer_types = get("layer_types")
    if layer_types is None:
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        _fail("layer_types", f"{num_layers} entries", layer_types)
    for t in layer_types:
        if t not in LAYER_TYPES:
            _fail("layer_types", f"entries in {LAYER_TYPES}", t)
    # transformers forces the last layer to full attention; do the same so both agree
    layer_types[-1] = FULL
    if not drafter:
        for t in set(layer_types[num_layers - shared:]):
            if t not in layer_types[:num_layers - shared]:
                _fail("num_kv_shared_layers", f"a value leaving a non-shared {t} layer for the shared ones to read",
                      shared)
    num_experts = top_k = moe_inter = 0
    if moe:
        num_experts = int(get("num_experts") or 0)
        top_k = int(get("top_k_experts") or 0)
        moe_inter = int(get("moe_intermediate_size") or 0)
        if num_experts < 1:
            _fail("num_experts", "an int >= 1 with enable_moe_block", get("num_experts"))
        if not 1 <= top_k <= num_experts:
            _fail("top_k_experts", f"an int in [1, num_experts={num_experts}]", get("top_k_experts"))
        if moe_inter < 1:
            _fail("moe_intermediate_size", "an int >= 1 with enable_moe_block", get("moe_intermediate_size"))

    k_eq_v = bool(get("attention_k_eq_v", False))
    head_dim = int(get("head_dim", 256))
    num_kv = int(get("num_key_value_heads", 4))
    full_head_dim, full_kv = int(get("global_head_dim", 512)), num_kv
    if k_eq_v and get("num_global_key_value_heads") is not None:
        full_kv = int(get("num_global_key_value_heads"))
    per_layer = get("per_layer_config") or {}
    full_overrides = {(int(k) if str(k).isdigit() else k): v for k, v in per_layer.items()}
    full_idx = [i for i, t in enumerate(layer_types) if t == FULL]
    sliding_idx = [i for i, t in enumerate(layer_types) if t == SLIDING]
    if per_layer:
        seen = {(int(full_overrides.get(i, {}).get("head_dim", head_dim)),
                 int(full_overrides.get(i, {}).get("num_key_value_heads", num_kv))) for i in full_idx}
        if len(seen) != 1:
            _fail("per_layer_config", "one head_dim / num_key_value_heads for all full layers", per_layer)
        full_head_dim, full_kv = seen.pop()
        for i in sliding_idx:
            if full_overrides.get(i):
                _fail("per_layer_config", "overrides for full-attention layers only", per_layer)

    rope_params = get("rope_parameters") or _DEFAULT_ROPE
    window = int(get("sliding_window", 512))
    attention = {}
    for t, hd, kv in ((SLIDING, head_dim, num_kv), (FULL, full_head_dim, full_kv)):
        if t not in layer_types:
            continue
        rope_type, theta, partial, factor = _rope(rope_params, t)
        attention[t] = AttentionSpec(hd, kv, rope_type, theta, partial, factor, window if t == SLIDING else None)

    eos = get("eos_token_id", 1)
    eos = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),))
    softcap = get("final_logit_softcapping")
    return TextConfig(
        vocab_size=vocab,
        hidden_size=int(get("hidden_size", 2304)),
        intermediate_size=int(get("intermediate_size", 9216)),
        num_layers=num_layers,
        num_heads=int(get("num_attention_heads", 8)),
        layer_types=tuple(layer_types),
        attention=attention,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        attention_k_eq_v=k_eq_v,
        final_logit_softcapping=None if softcap is None else float(softcap),
        tie_word_embeddings=bool(get("tie_word_embeddings", True)),
        eos_token_ids=eos,
        pad_token_id=get("pad_token_id", 0),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab if ple else 0,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        enable_moe_block=moe,
        num_experts=num_experts,
        top_k_experts=top_k,
        moe_intermediate_size=moe_inter,
    )


def parse_target_config(d: dict) -> tuple[TextConfig, str]:
    """(text config, weight-name prefix) of a Gemma4ForCausalLM or Gemma4ForConditionalGeneration config."""
    model_type = d.get("model_type")
    if model_type == "gemma4":
        text = d.get("text_config")
        if not isinstance(text, dict):
            _fail("text_config", "a dict", text)
        # the multimodal model ties its LM head by its own (top-level) flag, not the text config's
        tie = bool(d.get("tie_word_embeddings", True))
        return replace(parse_text_config(text), tie_word_embeddings=tie), "model.language_model."
    if model_type not in (None, "gemma4_text"):
        _fail("model_type", "'gemma4_text' or 'gemma4'", model_type)
    return parse_text_config(d), "model."


def parse_drafter_config(d: dict) -> DrafterConfig:
    if d.get("model_type") != "gemma4_assistant":
        _fail("model_type", "'gemma4_assistant'", d.get("model_type"))
    text_dict = d.get("text_config")
    if not isinstance(text_dict, dict):
        _fail("text_config", "a dict", text_dict)
    text = parse_text_config(text_dict, drafter=True)
    ordered = bool(d.get("use_ordered_embeddings", False))
    num_centroids = int(d.get("num_centroids", 2048))
    top_k = int(d.get("centroid_intermediate_top_k", 32))
    if ordered and (text.vocab_size % num_centroids or not 0 < top_k <= num_centroids):
        _fail("num_centroids / centroid_intermediate_top_k",
              f"num_centroids dividing vocab_size {text.vocab_size} and 0 < top_k <= num_centroids",
              (num_centroids, top_k))
    return DrafterConfig(text, int(d.get("backbone_hidden_size", 1536)), ordered, num_centroids, top_k)
