"""The Gemma 4 MTP drafter (Gemma4AssistantForCausalLM weights), run through the gemma4_mtp_kernels ops.

It has no K/V of its own: each layer computes Q only and attends the target's cache with
`q_only_paged_attention` (sliding layers read the target's last sliding layer, the full layer its
last full layer). Its input is `fused_concat_down_proj(E_target[token] * sqrt(Hb), h)`, h being the
target's final hidden state on the first step and the drafter's `post_projection` output after.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import gemma4_mtp_kernels as K

from .config import DrafterConfig, TextConfig
from .layers import DecoderLayer, RMSNorm, apply_rope, rope_inv_freq

QUERY_POSITIONS = ("last_cached", "next")


class DrafterAttention(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        D = config.spec(layer).head_dim
        self.head_dim, self.num_heads = D, config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * D, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.o_proj = nn.Linear(config.num_heads * D, config.hidden_size, bias=False)


@dataclass
class DraftContext:
    """What a draft round reads from the target, per request (rows of B).

    k_cache / v_cache / block_table / window: per attention type; seq_lens [B] int32 cache entries;
    positions [B] int64 RoPE position of every draft query of the round; embed_table [V, Hb] the
    target's input embedding with its scale sqrt(Hb)."""

    k_cache: dict
    v_cache: dict
    block_table: dict
    window: dict
    seq_lens: torch.Tensor
    positions: torch.Tensor
    embed_table: torch.Tensor
    embed_scale: float

    def select(self, rows: list[int]) -> "DraftContext":
        idx = torch.tensor(rows, dtype=torch.long, device=self.seq_lens.device)
        return DraftContext(self.k_cache, self.v_cache, {t: bt[idx] for t, bt in self.block_table.items()},
                            self.window, self.seq_lens[idx], self.positions[idx], self.embed_table,
                            self.embed_scale)


class Gemma4MTPDrafter(nn.Module):
    """Draft steps over a borrowed target cache. `backend` goes to every gemma4_mtp_kernels op."""

    def __init__(self, config: DrafterConfig, *, backend: str = "auto"):
        super().__init__()
        t = config.text
        self.config, self.backend = config, backend
        Hb, Hd, V = config.backbone_hidden_size, t.hidden_size, t.vocab_size
        self.pre_projection = nn.Linear(2 * Hb, Hd, bias=False)
        self.post_projection = nn.Linear(Hd, Hb, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(t, DrafterAttention(t, i)) for i in range(t.num_layers))
        self.norm = RMSNorm(Hd, t.rms_norm_eps)
        self.embed_tokens = nn.Embedding(V, Hd)  # the LM head when tied; inputs come from the target's table
        self.lm_head = None if t.tie_word_embeddings else nn.Linear(Hd, V, bias=False)
        if config.use_ordered_embeddings:
            self.centroids = nn.Linear(Hd, config.num_centroids, bias=False)
            self.register_buffer("token_ordering", torch.arange(V))
        for lt, spec in t.attention.items():
            self.register_buffer(f"{lt}_inv_freq", rope_inv_freq(spec), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ---- binding to a target -----------------------------------------------------------------

    def check_target(self, target) -> None:
        """Raise ValueError when this drafter cannot read `target`'s cache and embeddings."""
        dc, tc = self.config.text, target.config
        if self.config.backbone_hidden_size != tc.hidden_size:
            raise ValueError(f"drafter backbone_hidden_size {self.config.backbone_hidden_size} != target hidden_size "
                             f"{tc.hidden_size}")
        if dc.vocab_size != tc.vocab_size:
            raise ValueError(f"drafter vocab_size {dc.vocab_size} != target vocab_size {tc.vocab_size}")
        for lt in set(dc.layer_types):
            # what target.kv_cache(lt) returns: the last non-KV-shared layer of the type
            if tc.kv_layer_of(lt) is None:
                raise ValueError(f"the drafter has {lt} layers but the target has none to read")
            d, s = dc.attention[lt], tc.attention[lt]
            if d.head_dim != s.head_dim or dc.num_heads % s.num_kv_heads:
                raise ValueError(f"{lt}: drafter head_dim {d.head_dim} with {dc.num_heads} heads cannot read the "
                                 f"target's head_dim {s.head_dim} with {s.num_kv_heads} KV heads")
            if d.window is not None and d.window > s.window:
                # the target keeps sliding_window + 1 entries (see Gemma4Target.commit)
                raise ValueError(f"{lt}: drafter sliding_window {d.window} exceeds the target's {s.window}, whose "
                                 "cache no longer holds the older entries")
        if self.pre_projection.weight.dtype != target.dtype:
            raise ValueError(f"drafter dtype {self.pre_projection.weight.dtype} != target dtype {target.dtype}")

    def context(self, target, reqs: list[int], query_position: str = "last_cached") -> DraftContext:
        """The drafter's view of `reqs` in `target`, whose caches hold positions [0, P] (P + 1 = length).

        "last_cached" (vLLM, SGLang): queries at P; a sliding layer attends the last `sliding_window`
        entries, as the target's own query at P would. "next" (Hugging Face): queries at P + 1, and a
        sliding layer attends the last `sliding_window + 1` entries, because HF's assistant masks the
        shared K/V with a bidirectional window whose distance bound is inclusive."""
        if query_position not in QUERY_POSITIONS:
            raise ValueError(f"query_position: expected one of {QUERY_POSITIONS}, got {query_position!r}")
        types = set(self.config.text.layer_types)
        kv = {t: target.kv_cache(t) for t in types}
        tables = target.block_tables(reqs)
        lengths = target.seq_lens(reqs)
        extra = 1 if query_position == "next" else 0
        windows = {t: None if s.window is None else s.window + extra
                   for t, s in self.config.text.attention.items()}
        return DraftContext({t: kv[t][0] for t in types}, {t: kv[t][1] for t in types},
                            {t: tables[t] for t in types}, windows, lengths,
                            lengths.long() - 1 + extra, target.embed_tokens.weight, target.config.embed_scale)

    # ---- one draft step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [B, Q], hidden [B, Q, Hb] -> (final normed hidden [B, Q, Hd], post_projection [B, Q, Hb]).

        The Q queries of a request (tree branches of one level) share one attention call."""
        B, Q = token_ids.shape
        Hb = self.config.backbone_hidden_size
        x = K.fused_concat_down_proj(token_ids.reshape(-1), ctx.embed_table, hidden.reshape(B * Q, Hb),
                                     self.pre_projection.weight, embed_scale=ctx.embed_scale, backend=self.backend)
        pos = ctx.positions.repeat_interleave(Q)
        for i, layer in enumerate(self.layers):
            x = layer(x, lambda h, i=i: self._attention(i, h, pos, ctx, B, Q))
        last = self.norm(x)
        return last.view(B, Q, -1), self.post_projection(last).view(B, Q, Hb)

    def _attention(self, i, h, pos, ctx, B, Q):
        t = self.config.text
        lt = t.layer_types[i]
        attn = self.layers[i].self_attn
        D = attn.head_dim
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(B * Q, -1, D)), pos, getattr(self, f"{lt}_inv_freq"))
        o = K.q_only_paged_attention(q.reshape(B, Q, -1, D).contiguous(), ctx.k_cache[lt], ctx.v_cache[lt],
                                     ctx.block_table[lt], ctx.seq_lens, scale=1.0, window=ctx.window[lt],
                                     backend=self.backend)
        return attn.o_proj(o.reshape(B * Q, -1))

    # ---- LM head -----------------------------------------------------------------------------

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """Dense fp32 logits [..., V]; with the centroid head, tokens outside the selected clusters get -inf."""
        flat = last.reshape(-1, last.shape[-1])
        if self.config.use_ordered_embeddings:
            out = K.centroid_logits(flat, self.centroids.weight, self.token_ordering, self.lm_head_weight,
                                    top_k=self.config.centroid_top_k, output="dense", backend=self.backend)
        else:
            out = flat.float() @ self.lm_head_weight.float().T
        return out.view(*last.shape[:-1], -1)

    def top_tokens(self, last: torch.Tensor, k: int) -> torch.Tensor:
        """The k highest-scoring tokens [..., k] (int64), best first, ties to the lower id."""
        flat = last.reshape(-1, last.shape[-1])
        if k == 1 and self.config.use_ordered_embeddings:
            tok, _ = K.centroid_logits(flat, self.centroids.weight, self.token_ordering, self.lm_head_weight,
                                       top_k=self.config.centroid_top_k, output="argmax", backend=self.backend)
            return tok.view(*last.shape[:-1], 1)
        if self.config.use_ordered_embeddings:
            ids, scores = K.centroid_logits(flat, self.centroids.weight, self.token_ordering, self.lm_head_weight,
                                            top_k=self.config.centroid_top_k, output="sparse", backend=self.backend)
        else:
            scores = flat.float() @ self.lm_head_weight.float().T
            ids = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
        by_id = torch.argsort(ids, dim=1, stable=True)
        ids, scores = ids.gather(1, by_id), scores.gather(1, by_id)
        best = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
        return ids.gather(1, best).view(*last.shape[:-1], k)
