"""Hugging Face assisted generation through gemma4_mtp_kernels: `accelerate(assistant_model)`.

    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM
    from gemma4_mtp.hf import accelerate

    target = AutoModelForCausalLM.from_pretrained("path/to/gemma-4-text")
    assistant = accelerate(Gemma4AssistantForCausalLM.from_pretrained("path/to/gemma-4-assistant"))
    out = target.generate(input_ids, assistant_model=assistant, max_new_tokens=64)   # unchanged call

`accelerate` replaces, on this one instance, the forward of the assistant (transformers 5.17,
`Gemma4AssistantForCausalLM.forward`) and of its attention modules; the class, the weights and every
other module stay Hugging Face's (norms, MLPs, rotary tables, post-projection, the dense LM head),
so `generate` still recognises the assistant and its candidate generator calls it as before: one
position per row, `inputs_embeds = cat(target_embedding(token), target_hidden)`, `shared_kv_states`
from the target, the target's padding mask, `position_ids`.

What runs through the ops:
- Pre-projection: `fused_concat_down_proj` over the two halves of `inputs_embeds`, seen as views
  (the embedding half as a T-row "table" indexed by arange(T) with scale 1.0, which reproduces it
  exactly; the hidden half as the hidden rows). This needs `inputs_embeds` flattenable to
  [T, 2 * Hb] without a copy, with stride 1 in its last dimension, which is what the candidate
  generator's `torch.cat` produces. Otherwise the plain `pre_projection` Linear runs instead.
- Attention: `q_only_paged_attention` over `shared_kv_states` as Hugging Face holds them
  ([B, Hkv, S, D] per layer type, contiguous or a sliced/permuted view, stride 1 in D), seen
  without a copy as a paged cache of one-entry pages (`as_strided`, one page per (row, position));
  the block table lists, per row, the entries the Hugging Face mask lets the query see, in order:
  full layers all S entries whose padding-mask bit is set; sliding layers the same among the last
  `sliding_window + 1` entries. (The assistant's mask is a *bidirectional* sliding window flipped
  onto the past, and its distance bound is inclusive, so a one-position query sees window + 1
  entries; see the README's note on window semantics.) The table and lengths are computed on the
  device from the mask, without a host sync. K/V of one layer type are paged once per forward and
  shared by every layer of that type.
- Centroid (masked) embedder, when `use_ordered_embeddings`: `centroid_logits(output="sparse")`,
  then Hugging Face's output contract: logits [B, T, V] in the hidden dtype, the selected tokens at
  their vocabulary ids, every other entry one below the smallest selected logit of the call
  (computed on the device; Hugging Face's `.item()` host sync is gone).

Exactness: on fp32 models the accelerated assistant drafts the tokens Hugging Face's drafts (the
tests check it token for token, and `generate` output against a recompute-everything greedy loop).
In bf16 both compute the same functions with different roundings (fp32 accumulation in the ops,
bf16 matmul outputs in Hugging Face), so near-ties in the centroid top-k or the argmax can break
differently; greedy `generate` output is still the target's own either way.

Not served (refused by `accelerate`, naming the field, with the model left untouched): layer types
other than sliding/full attention, layers that compute their own K/V, head dims outside
{64, 128, 256, 512}, a sliding layer without a positive `sliding_window`, a centroid head whose
`num_centroids` does not divide the vocabulary or whose `centroid_intermediate_top_k` is not in
[1, num_centroids], parameters in a dtype other than fp16/bf16/fp32. At call time: more than one
position per row (Hugging Face's candidate generator passes one), `output_attentions`.
The accelerated forward is for inference: it runs under `torch.no_grad()`.
"""
from __future__ import annotations

import functools
import types

import torch
from transformers import Gemma4AssistantForCausalLM
from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb
from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantOutput

import gemma4_mtp_kernels as K
from gemma4_mtp_kernels.ops.q_only_attention import SUPPORTED_HEAD_DIMS

SLIDING, FULL = "sliding_attention", "full_attention"
BACKENDS = ("auto", "torch", "triton", "cuda")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def accelerate(assistant_model, *, backend: str = "auto"):
    """Route `assistant_model`'s forward through gemma4_mtp_kernels (in place); returns the model.

    Raises TypeError / ValueError naming the argument or config field it cannot serve, before
    changing anything. Calling it again switches the backend."""
    if not isinstance(assistant_model, Gemma4AssistantForCausalLM):
        raise TypeError("accelerate: assistant_model must be a transformers Gemma4AssistantForCausalLM, got "
                        f"{type(assistant_model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"accelerate: backend must be one of {BACKENDS}, got {backend!r}")
    _check_servable(assistant_model)
    assistant_model.forward = types.MethodType(functools.partial(_forward, backend=backend), assistant_model)
    for layer in assistant_model.model.layers:
        attn = layer.self_attn
        attn.forward = functools.partial(_attention, attn, backend=backend)
    assistant_model.gemma4_mtp_backend = backend
    return assistant_model


def _refuse(field: str, expected: str, got) -> None:
    raise ValueError(f"accelerate: {field} must be {expected}, got {got}")


def _check_servable(model) -> None:
    cfg = model.config
    text = cfg.get_text_config()
    types_ = list(text.layer_types)
    for i, lt in enumerate(types_):
        if lt not in (SLIDING, FULL):
            _refuse("text_config.layer_types", f"'{SLIDING}' or '{FULL}' in every layer", f"{lt!r} at layer {i}")
        attn = model.model.layers[i].self_attn
        if not attn.is_kv_shared_layer:
            _refuse("text_config.num_kv_shared_layers", f"num_hidden_layers = {len(types_)} (every layer reads "
                    "the target's K/V)", text.num_kv_shared_layers)
        if attn.head_dim not in SUPPORTED_HEAD_DIMS:
            # full layers take theirs from global_head_dim, through per_layer_config
            field = f"text_config.global_head_dim (per_layer_config[{i}].head_dim)" if lt == FULL \
                else "text_config.head_dim"
            _refuse(field, f"one of {SUPPORTED_HEAD_DIMS} (layer {i}, {lt})", attn.head_dim)
    if SLIDING in types_ and not (isinstance(text.sliding_window, int) and text.sliding_window >= 1):
        _refuse("text_config.sliding_window", "a positive int (the assistant has sliding layers)", text.sliding_window)
    if cfg.use_ordered_embeddings:
        V, C, k = text.vocab_size, cfg.num_centroids, cfg.centroid_intermediate_top_k
        if not (isinstance(C, int) and C >= 1 and V % C == 0):
            _refuse("num_centroids", f"a positive divisor of vocab_size = {V}", C)
        if not (isinstance(k, int) and 1 <= k <= C):
            _refuse("centroid_intermediate_top_k", f"in [1, num_centroids = {C}]", k)
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        _refuse("dtype", f"one of {DTYPES} for every parameter", sorted(map(str, dtypes)))


# ---- the forward ---------------------------------------------------------------------------------

def _forward(self, input_ids=None, inputs_embeds=None, position_ids=None, attention_mask=None,
             shared_kv_states=None, use_cache=None, *, backend, **kwargs):
    """Gemma4AssistantForCausalLM.forward's contract, through the ops (input_ids and use_cache are
    ignored, as Hugging Face ignores them)."""
    if inputs_embeds is None or shared_kv_states is None:
        raise ValueError("gemma4_mtp.hf: inputs_embeds and shared_kv_states cannot be None")
    if kwargs.get("output_attentions"):
        raise ValueError("gemma4_mtp.hf: output_attentions is not supported by the accelerated assistant "
                         "(the attention kernel does not materialise attention weights)")
    return_dict = kwargs.pop("return_dict", None)
    text = self.config.get_text_config()
    Hb = self.config.backbone_hidden_size
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != 2 * Hb:
        raise ValueError(f"gemma4_mtp.hf: inputs_embeds must be [B, 1, 2 * backbone_hidden_size = {2 * Hb}], got "
                         f"shape {tuple(inputs_embeds.shape)}")
    if inputs_embeds.shape[1] != 1:
        raise ValueError("gemma4_mtp.hf: inputs_embeds must hold one position per row (what assisted generation "
                         f"passes), got shape {tuple(inputs_embeds.shape)}")
    source = inputs_embeds.device
    device = self.pre_projection.weight.device
    inputs_embeds = inputs_embeds.to(device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    with torch.no_grad():
        x = _pre_project(self, inputs_embeds, backend)
        paged = {lt: _paged_kv(shared_kv_states, lt, x.shape[0], attention_mask, text, device)
                 for lt in set(text.layer_types)}
        outputs = self.model(input_ids=None, inputs_embeds=x, attention_mask={lt: None for lt in (SLIDING, FULL)},
                             position_ids=position_ids, shared_kv_states=paged, use_cache=False, **kwargs)
        last = outputs.last_hidden_state
        projected = self.post_projection(last)
        logits = _centroid_head(self, last, backend) if self.config.use_ordered_embeddings else self.lm_head(last)
    out = Gemma4AssistantOutput(last_hidden_state=projected.to(source), logits=logits.to(source),
                                hidden_states=outputs.hidden_states, attentions=None)
    return out if return_dict is not False else out.to_tuple()


def _pre_project(model, inputs_embeds, backend):
    """fused_concat_down_proj over views of the two halves of [B, T, 2 * Hb], or the plain Linear when
    they cannot be viewed as [T, Hb] rows with stride 1 (see the module docstring)."""
    B, T, two_hb = inputs_embeds.shape
    Hb = two_hb // 2
    try:
        flat = inputs_embeds.view(B * T, two_hb)
    except RuntimeError:  # not flattenable without a copy
        flat = None
    if flat is None or flat.stride(-1) != 1:
        return model.pre_projection(inputs_embeds)
    rows = torch.arange(B * T, device=flat.device)
    y = K.fused_concat_down_proj(rows, flat[:, :Hb], flat[:, Hb:], model.pre_projection.weight, embed_scale=1.0,
                                 backend=backend)
    return y.view(B, T, -1)


class _PagedKV:
    """One layer type's shared K/V as a paged cache: k/v [entries, 1, Hkv, D] views, a block table
    [B, n] int32 of entry ids and seq_lens [B] int32 (the entries each row attends, in order)."""

    __slots__ = ("k_cache", "v_cache", "block_table", "seq_lens")

    def __init__(self, k_cache, v_cache, block_table, seq_lens):
        self.k_cache, self.v_cache, self.block_table, self.seq_lens = k_cache, v_cache, block_table, seq_lens


def _entry_view(x: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """[B, H, S, D] (stride 1 in D) -> ([entries, 1, H, D] view of the same memory, entry ids per row).

    Entry e sits at storage offset + e * es, row b's position s is entry b * per_row + s; this needs
    the row stride to be a multiple of the position stride, true for every layout Hugging Face makes
    (contiguous, sliced along S, or permuted from [B, S, H, D])."""
    B, H, S, D = x.shape
    sb, sh, ss, sd = x.stride()
    if D > 1 and sd != 1:
        raise ValueError(f"gemma4_mtp.hf: {what} must have stride 1 in head_dim, got strides {x.stride()}")
    es = ss if S > 1 else (sb if B > 1 else 1)
    if es <= 0 or (B > 1 and sb % es):
        raise ValueError(f"gemma4_mtp.hf: {what} must have a positive position stride dividing its batch stride "
                         f"(to be paged without a copy), got strides {x.stride()}")
    per_row = sb // es if B > 1 else 0
    view = x.as_strided(((B - 1) * per_row + S, 1, H, D), (es, es, sh, 1), x.storage_offset())
    return view, per_row


def _paged_kv(shared_kv_states, lt, B, attention_mask, text, device) -> _PagedKV:
    what = f"shared_kv_states[{lt!r}]"
    if lt not in shared_kv_states:
        raise ValueError(f"gemma4_mtp.hf: shared_kv_states must hold {lt!r} (the assistant has such layers), got keys "
                         f"{sorted(shared_kv_states)}")
    k, v = (t.to(device) for t in shared_kv_states[lt])
    if k.dim() != 4 or tuple(v.shape) != tuple(k.shape) or k.shape[0] != B:
        raise ValueError(f"gemma4_mtp.hf: {what} must be (K, V) of one shape [B = {B}, Hkv, S, D], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    S = k.shape[2]
    kv, k_row = _entry_view(k, what + "[0]")
    vv, v_row = _entry_view(v, what + "[1]")
    if k_row != v_row and B > 1:
        raise ValueError(f"gemma4_mtp.hf: {what}: K and V must share one layout to share a block table, got strides "
                         f"{k.stride()} and {v.stride()}")
    # Hugging Face: full layers see every entry; sliding layers the last sliding_window + 1 (inclusive
    # bidirectional window, flipped onto the past). The padding mask is the target's, cut to the full
    # layers' length, its last S entries aligned with the sliding K/V.
    lo = max(0, S - (text.sliding_window + 1)) if lt == SLIDING else 0
    base = torch.arange(B, device=device, dtype=torch.int32)[:, None] * k_row + lo
    if attention_mask is None:
        table = (base + torch.arange(S - lo, device=device, dtype=torch.int32)).contiguous()
        lens = torch.full((B,), S - lo, dtype=torch.int32, device=device)
        return _PagedKV(kv, vv, table, lens)
    full_len = shared_kv_states[FULL][0].shape[2] if FULL in shared_kv_states else S
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < full_len:
        raise ValueError(f"gemma4_mtp.hf: attention_mask must be [B = {B}, >= {full_len}] (the target's "
                         f"padding mask), got shape {tuple(attention_mask.shape)}")
    if S > full_len:
        raise ValueError(f"gemma4_mtp.hf: {what} holds {S} positions, more than the full layers' {full_len}: the "
                         "padding mask cannot be aligned with it")
    seen = attention_mask[:, :full_len][:, full_len - S + lo:] != 0
    order = torch.argsort((~seen).to(torch.int32), dim=1, stable=True)  # attended entries first, in order
    table = (base + order.to(torch.int32)).contiguous()
    lens = seen.sum(dim=1, dtype=torch.int32)
    return _PagedKV(kv, vv, table, lens)


def _attention(attn, hidden_states, position_embeddings, attention_mask=None, shared_kv_states=None, *, backend,
               **kwargs):
    """Gemma4TextAttention.forward for a KV-shared layer: Q (q_proj, q_norm, RoPE as Hugging Face does
    them), then q_only_paged_attention over the paged view of the target's K/V."""
    paged = (shared_kv_states or {}).get(attn.layer_type)
    if not isinstance(paged, _PagedKV):
        raise TypeError("gemma4_mtp.hf: this attention module belongs to an accelerated assistant; call the "
                        "assistant itself (its forward pages the target's K/V), not its inner model")
    B, T = hidden_states.shape[:2]
    cos, sin = position_embeddings
    q = attn.q_norm(attn.q_proj(hidden_states).view(B, T, -1, attn.head_dim))
    q = apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim=2)
    o = K.q_only_paged_attention(q.contiguous(), paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens,
                                 scale=attn.scaling, backend=backend)
    return attn.o_proj(o.reshape(B, T, -1)), None


def _centroid_head(model, last, backend):
    """Gemma4AssistantMaskedEmbedder's contract: [B, T, V] in last.dtype, the selected clusters' tokens
    at their ids, the rest one below the smallest selected logit."""
    me = model.masked_embedding
    B, T, Hd = last.shape
    V = me.vocab_size
    ids, logits = K.centroid_logits(last.reshape(B * T, Hd), me.centroids.weight, me.token_ordering,
                                    model.lm_head.weight, top_k=me.centroid_intermediate_top_k, output="sparse",
                                    backend=backend)
    fill = (logits.min() - 1.0).to(last.dtype)
    out = fill.expand(B * T, V).contiguous()
    return out.scatter_(1, ids, logits.to(last.dtype)).view(B, T, V)
