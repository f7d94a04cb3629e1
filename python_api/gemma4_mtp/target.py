"""Gemma 4 text target of every family, with a paged K/V cache and tree verification (SPEC §5).

Requests are identified by integers. For each request the target holds `length` committed
positions in its caches (one paged cache per attention type, each with its own allocator and block
tables). A forward pass takes a token tree per request whose node 0 is the pending token at position
`length` (sampled but not yet run through the target); node i sits at position length + depth(i),
its K/V is written to the scratch slot length + i, and it attends the committed prefix and its own
ancestors (plus itself), limited to the sliding window on sliding layers. `commit` then moves the
accepted path's K/V to contiguous positions and releases what is no longer needed.

Families (numerically as transformers 5.17's Gemma4TextModel): dense (31B); per-layer embeddings
(PLE) and KV-shared layers, whose K/V is the last non-shared layer's of their type, so the caches
hold the non-shared layers only (E2B, E4B; E2B also doubles the MLP of its KV-shared layers); a
routed expert block beside the dense MLP of every layer (26B-A4B).

The attention itself is plain torch (this is the reference loop); the cache is paged like an
engine's, so the drafter reads it through `q_only_paged_attention` exactly as it would read vLLM's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gemma4_mtp_kernels._checks import values_checkable

from .config import FULL, TextConfig
from .kv_cache import PagedKVCache
from .layers import MLP, RMSNorm, apply_rope, rms_norm, rope_inv_freq
from .transfer import tensor_to, to_device


class TargetAttention(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        spec = config.spec(layer)
        H, Hq, D = config.hidden_size, config.num_heads, spec.head_dim
        self.head_dim, self.num_heads, self.num_kv_heads = D, Hq, spec.num_kv_heads
        # a KV-shared layer has no K/V weights: it attends the K/V of config.kv_source(layer)
        self.kv_shared = config.is_kv_shared(layer)
        self.q_proj = nn.Linear(H, Hq * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        if not self.kv_shared:
            self.k_proj = nn.Linear(H, spec.num_kv_heads * D, bias=False)
            # attention_k_eq_v: full layers take V from the (unnormalised) K projection
            k_eq_v = config.attention_k_eq_v and config.layer_types[layer] == FULL
            self.v_proj = None if k_eq_v else nn.Linear(H, spec.num_kv_heads * D, bias=False)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)


class Router(nn.Module):
    """The MoE router: the top_k_experts experts of each token and their weights, as Hugging Face
    routes: softmax in fp32 over all experts, top-k, renormalised to sum 1, times per_expert_scale."""

    def __init__(self, config: TextConfig):
        super().__init__()
        H, E = config.hidden_size, config.num_experts
        self.eps, self.top_k, self.root_scale = config.rms_norm_eps, config.top_k_experts, H ** -0.5
        self.proj = nn.Linear(H, E, bias=False)
        self.scale = nn.Parameter(torch.ones(H))
        self.per_expert_scale = nn.Parameter(torch.ones(E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32 (or wider), expert ids [T, k] int64)."""
        h = rms_norm(x, None, self.eps) * self.scale * self.root_scale
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, k=self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Experts(nn.Module):
    """num_experts gated MLPs stored as 3-D tensors (Hugging Face's layout: gate rows, then up rows)."""

    def __init__(self, config: TextConfig):
        super().__init__()
        E, H, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; each expert runs once over all the tokens routed to it; a token's outputs are
        summed in ascending expert order."""
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            tok, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, self.down_proj[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out


class TargetDecoderLayer(nn.Module):
    """A Gemma 4 text decoder layer of any family; the owner decides how `attention` attends.

    forward(x, attention, per_layer_input): attention(normed x) returns the attention output after
    o_proj; per_layer_input [T, hidden_size_per_layer_input] is this layer's slice of the PLE."""

    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = TargetAttention(config, layer)
        self.mlp = MLP(H, config.mlp_intermediate_size(layer))
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = config.enable_moe_block
        if self.moe:
            self.router = Router(config)
            self.experts = Experts(config)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.ple = config.hidden_size_per_layer_input > 0
        if self.ple:
            P = config.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)

    def forward(self, x, attention, per_layer_input=None):
        x = x + self.post_attention_layernorm(attention(self.input_layernorm(x)))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            # the experts see the same residual stream as the dense MLP (and the router), not its output
            routed = self.experts(self.pre_feedforward_layernorm_2(x), *self.router(x))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


@dataclass
class TargetOutput:
    """logits [B, N, V] fp32 (after the final softcap) and final normed hidden states [B, N, H];
    rows past a request's node count are zero."""

    logits: torch.Tensor
    hidden: torch.Tensor


def _tree_structure(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [N] int64, ancestor-or-self mask [N, N] bool) of a tree in topological order."""
    n = len(parents)
    depth = torch.zeros(n, dtype=torch.long)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if i == 0:
            if p != -1:
                raise ValueError(f"parents: node 0 must be the root (parent -1), got {p}")
        elif not 0 <= p < i:
            raise ValueError(f"parents: node {i} needs a parent in [0, {i}), got {p}")
        else:
            depth[i] = depth[p] + 1
            anc[i] = anc[p]
        anc[i, i] = True
    return depth, anc


def _rounded(x: float, dtype: torch.dtype) -> float:
    """x rounded to dtype, as a host number: multiplying by it rounds once, like multiplying by a
    dtype scalar tensor, and needs no host-to-device copy (none may happen under graph capture)."""
    return float(torch.tensor(x, dtype=dtype))


def _masked_attention(q, k, v, allowed):
    """q [B, N, Hq, D], k / v [B, S, Hkv, D] (GQA groups of Hq / Hkv heads), allowed [B, N, S] ->
    [B, N, Hq * D] fp32. Scale 1 (q_norm / k_norm scale). A key no query may see can hold anything
    (NaN of a never written slot, a padding node's junk): its value is zeroed, its score masked; a
    query with no key (padding) gets zeros."""
    B, N, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    v = torch.where(allowed.any(dim=1)[:, :, None, None], v.float(), 0.0)  # masked scores are replaced
    s = torch.einsum("bnkgd,bskd->bkgns", q.float().view(B, N, Hkv, Hq // Hkv, D), k.float())
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    # a row with no key is all -inf (softmax NaN): zeros; a NaN key a query may see still poisons it
    p = torch.softmax(s, dim=-1).masked_fill(~allowed.any(dim=-1)[:, None, None, :, None], 0.0)
    return torch.einsum("bkgns,bskd->bnkgd", p, v).reshape(B, N, Hq * D)


class Gemma4Target(nn.Module):
    """A Gemma 4 text model (Gemma4ForCausalLM weights) with paged caches and tree verification."""

    def __init__(self, config: TextConfig, *, num_blocks: int = 1024, block_size: int = 16):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        P = config.hidden_size_per_layer_input
        if P:
            # per-layer embeddings, all layers packed side by side: [V_ple, num_layers * P]
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, config.num_layers * P)
            self.per_layer_model_projection = nn.Linear(H, config.num_layers * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps)
        self.layers = nn.ModuleList(TargetDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(H, V, bias=False)
        for t, spec in config.attention.items():
            self.register_buffer(f"{t}_inv_freq", rope_inv_freq(spec), persistent=False)
        self.num_blocks, self.block_size = num_blocks, block_size
        # layer -> its slot in its type's cache: the caches hold the non-KV-shared layers, in order;
        # a KV-shared layer reads the slot of its source layer
        self._slot = {}
        own = range(config.first_kv_shared_layer)
        for t in config.attention:
            for j, i in enumerate(i for i in own if config.layer_types[i] == t):
                self._slot[i] = j
        for i in range(config.first_kv_shared_layer, config.num_layers):
            self._slot[i] = self._slot[config.kv_source(i)]
        self.caches: dict[str, PagedKVCache] = {}
        self.lengths: dict[int, int] = {}
        # the graphs.TargetGraphs the decode loop replays this target's forwards with (made on first use)
        self.graph_runner = None
        self._next_request = 0

    # ---- weights -----------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        # the scale is rounded to the table dtype first, as Gemma's scaled embedding does
        return w[token_ids.long()] * _rounded(self.config.embed_scale, w.dtype)

    def per_layer_inputs(self, token_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE [T, num_layers, P] of tokens [T] whose scaled embeddings are embeds [T, H]: (context +
        identity) / sqrt(2), identity being the per-layer table row scaled by sqrt(P), context the
        embedding projected, scaled by 1/sqrt(H) and RMS-normed per layer; rounded as Hugging Face does."""
        cfg = self.config
        T, L, P = token_ids.shape[0], cfg.num_layers, cfg.hidden_size_per_layer_input
        w = self.embed_tokens_per_layer.weight
        identity = w[token_ids.long()] * _rounded(math.sqrt(P), w.dtype)
        context = self.per_layer_model_projection(embeds) * cfg.hidden_size ** -0.5
        context = self.per_layer_projection_norm(context.view(T, L, P))
        return (context + identity.view(T, L, P)) * 2.0 ** -0.5

    # ---- requests and cache ------------------------------------------------------------------

    def _ensure_caches(self) -> None:
        if self.caches:
            return
        for t, spec in self.config.attention.items():
            n = sum(lt == t for lt in self.config.layer_types[:self.config.first_kv_shared_layer])
            self.caches[t] = PagedKVCache(n, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                          dtype=self.dtype, device=self.device, window=spec.window)

    def new_request(self) -> int:
        self._ensure_caches()
        req = self._next_request
        self._next_request += 1
        for c in self.caches.values():
            c.add_request(req)
        self.lengths[req] = 0
        return req

    def release(self, req: int) -> None:
        for c in self.caches.values():
            c.remove_request(req)
        del self.lengths[req]

    def kv_cache(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) [num_blocks, block_size, Hkv, D] of the last non-KV-shared layer of this type
        (the K/V the KV-shared layers of the type attend too): what a drafter layer of that type attends."""
        self._ensure_caches()
        layer = self.config.kv_layer_of(layer_type)
        if layer is None:
            raise ValueError(f"the target has no {layer_type} layer")
        c = self.caches[layer_type]
        return c.k[self._slot[layer]], c.v[self._slot[layer]]

    def block_tables(self, reqs: list[int], device=None) -> dict[str, torch.Tensor]:
        """Per attention type, the requests' block tables on `device` (default the target's)."""
        return {t: c.block_table(reqs, device) for t, c in self.caches.items()}

    def seq_lens(self, reqs: list[int], device=None) -> torch.Tensor:
        return tensor_to([self.lengths[r] for r in reqs], torch.int32, self.device if device is None else device)

    # ---- forward -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward_tree(self, reqs: list[int], tokens, parents: list[list[int]], *,
                     last_only: bool = False) -> TargetOutput:
        """Run the token tree of each request (node 0 = pending token) and write its K/V to scratch slots.

        tokens: per request a 1-D tensor of its nodes' ids, or one [B, >= nodes] tensor whose row b
        begins with request b's (a draft round's output, left on the device); see prepare_trees.
        last_only: return only each request's last node (a long prompt needs no [T, V] logits)."""
        dev = self.device
        ids, trees, counts = self.prepare_trees(reqs, tokens, parents)
        ids = to_device(ids, dev)
        trees = [(depth, to_device(anc, dev)) for depth, anc in trees]
        pos = torch.cat([self.lengths[r] + to_device(depth, dev) for r, (depth, _) in zip(reqs, trees)])
        hidden = self._layers(ids, pos, lambda i, q, k, v: self._attend(i, q, k, v, pos, reqs, counts, trees))
        if last_only:
            ends = tensor_to(counts, torch.long, dev).cumsum(0) - 1
            hidden, counts = hidden[ends], [1] * len(counts)
        logits = self._logits(hidden)
        B, N = len(reqs), max(counts)
        out_logits = torch.zeros(B, N, self.config.vocab_size, dtype=torch.float32, device=dev)
        out_hidden = torch.zeros(B, N, self.config.hidden_size, dtype=hidden.dtype, device=dev)
        for b, (lg, hd) in enumerate(zip(logits.split(counts), hidden.split(counts))):
            out_logits[b, :len(lg)] = lg
            out_hidden[b, :len(hd)] = hd
        return TargetOutput(out_logits, out_hidden)

    def prepare_trees(self, reqs, tokens, parents):
        """Check the trees and reserve their scratch slots: (ids [T] int64 on the tokens' device, per
        request (depth [n], ancestor-or-self mask [n, n]) on the host, node counts).

        tokens: per request a 1-D tensor (or list) of its nodes' ids, or one [B, >= nodes] tensor whose
        row b begins with request b's. The ids are checked against the vocabulary where
        gemma4_mtp_kernels checks values (CPU tensors; CUDA tensors with value checks on): elsewhere
        the check would be a device-to-host read, which a draft round's tokens on the GPU must not
        cost (they are the drafter head's own ids)."""
        if not (len(reqs) == len(tokens) == len(parents)):
            raise ValueError("reqs, tokens and parents need one entry per request")
        counts = [len(p) for p in parents]
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 2 or tokens.shape[1] < max(counts, default=0):
                raise ValueError(f"tokens: expected a [B, >= {max(counts, default=0)}] tensor of node ids, got "
                                 f"shape {tuple(tokens.shape)}")
            rows = [tokens[b, :n] for b, n in enumerate(counts)]
        else:
            rows = [torch.as_tensor(t).reshape(-1) for t in tokens]
        ids = torch.cat(rows).long()
        if values_checkable(ids) and bool(((ids < 0) | (ids >= self.config.vocab_size)).any()):
            raise ValueError(f"tokens: ids must be in [0, {self.config.vocab_size})")
        trees = []
        for r, row, par in zip(reqs, rows, parents):
            if len(row) != len(par) or len(row) == 0:
                raise ValueError(f"request {r}: tokens and parents need the same non-zero length")
            trees.append(_tree_structure(list(par)))
            for c in self.caches.values():
                c.reserve(r, self.lengths[r] + len(row))
        return ids, trees, counts

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        """The final normed hidden states [T, H] of tokens ids [T] at positions pos [T];
        attend(layer, q, k, v) writes k / v (None on a KV-shared layer) where it keeps K/V and
        returns the attention output [T, Hq * D] before o_proj."""
        cfg = self.config
        x = self.embed(ids)
        ple = self.per_layer_inputs(ids, x) if cfg.hidden_size_per_layer_input else None
        for i, layer in enumerate(self.layers):
            x = layer(x, lambda h, i=i: self.layers[i].self_attn.o_proj(attend(i, *self._qkv(i, h, pos))),
                      None if ple is None else ple[:, i])
        return self.norm(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.lm_head_weight.T
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _qkv(self, i, h, pos):
        """q [T, Hq, D] (normed, rotated), k and v [T, Hkv, D] (None on a KV-shared layer)."""
        attn = self.layers[i].self_attn
        inv_freq = getattr(self, f"{self.config.layer_types[i]}_inv_freq")
        T, D = h.shape[0], attn.head_dim
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(T, -1, D)), pos, inv_freq)
        if attn.kv_shared:
            # the source layer (an earlier one) already wrote this forward's K/V to the shared slot
            return q, None, None
        k_raw = attn.k_proj(h).view(T, -1, D)
        v_raw = k_raw if attn.v_proj is None else attn.v_proj(h).view(T, -1, D)
        k = apply_rope(attn.k_norm(k_raw), pos, inv_freq)
        return q, k, rms_norm(v_raw, None, self.config.rms_norm_eps)

    def _attend(self, i, q, k, v, pos, reqs, counts, trees):
        """Each request's nodes over its committed prefix (gathered through its block table) and its
        ancestors, one request at a time."""
        layer_type = self.config.layer_types[i]
        window = self.config.attention[layer_type].window
        cache, slot = self.caches[layer_type], self._slot[i]
        dev = q.device
        kv = [(None, None)] * len(reqs) if k is None else list(zip(k.split(counts), v.split(counts)))
        outs = []
        for b, (r, qb, (kb, vb), pb) in enumerate(zip(reqs, q.split(counts), kv, pos.split(counts))):
            L, n = self.lengths[r], counts[b]
            depth, anc = trees[b]
            if kb is not None:
                cache.write(slot, r, range(L, L + n), kb, vb)
            lo = 0 if window is None else max(0, L - window + 1)
            keys_k, keys_v = cache.read(slot, r, range(lo, L + n))
            key_pos = torch.cat([torch.arange(lo, L, device=dev), pb])
            allowed = torch.cat([torch.ones(n, L - lo, dtype=torch.bool, device=dev), anc], dim=1)
            if window is not None:
                allowed &= key_pos[None, :] > pb[:, None] - window
            outs.append(_masked_attention(qb[None], keys_k[None], keys_v[None], allowed[None])[0])
        return torch.cat(outs).to(q.dtype)

    @torch.no_grad()
    def forward_static(self, ids, depth, anc, counts, lengths, tables) -> TargetOutput:
        """forward_tree over fixed-shape device tensors, without a host read: what a CUDA graph
        captures (graphs.TargetGraphs owns the buffers and reserves the blocks).

        ids, depth [B, N] int64; anc [B, N, N] bool; counts, lengths [B] int64 (a padding row has
        count 0); tables {attention type: [B, W] int32 block table, -1 for no block}. Each request's
        blocks must cover lengths + counts. Nodes past a request's count write their K/V to the
        caches' trash block and get zero outputs, as forward_tree's padding."""
        B, N = ids.shape
        dev = ids.device
        node = torch.arange(N, device=dev)
        valid = node[None, :] < counts[:, None]  # [B, N]
        pos = lengths[:, None] + depth  # [B, N]
        where = {}  # per attention type: (write index [B * N], key index [B, S], allowed [B, N, S])
        for t, cache in self.caches.items():
            table = tables[t].long()
            bs, W = cache.block_size, table.shape[1]
            slot = lengths[:, None] + node[None, :]
            blk = table.gather(1, (slot // bs).clamp(max=W - 1))
            write = torch.where(valid & (blk >= 0), blk * bs + slot % bs, cache.trash * bs)
            j = torch.arange(W * bs, device=dev)
            kblk = table[:, j // bs]  # [B, S]
            read = torch.where(kblk >= 0, kblk * bs + j % bs, cache.trash * bs)
            # key j: a committed position (j < length), or the scratch slot of node j - length
            rel = j[None, :] - lengths[:, None]  # [B, S]
            is_node = (rel >= 0) & (rel < counts[:, None])
            relc = rel.clamp(0, N - 1)
            key_pos = torch.where(is_node, lengths[:, None] + depth.gather(1, relc), j[None, :])
            anc_key = anc.gather(2, relc[:, None, :].expand(B, N, -1))  # [B, N, S]
            allowed = ((rel < 0)[:, None, :] | (is_node[:, None, :] & anc_key)) & (kblk >= 0)[:, None, :]
            if cache.window is not None:
                allowed &= key_pos[:, None, :] > pos[:, :, None] - cache.window
            where[t] = (write.view(-1), read, allowed & valid[:, :, None])

        def attend(i, q, k, v):
            layer_type = self.config.layer_types[i]
            cache, slot = self.caches[layer_type], self._slot[i]
            write, read, allowed = where[layer_type]
            kc = cache.k_all[slot].view(-1, *cache.k_all.shape[-2:])
            vc = cache.v_all[slot].view(-1, *cache.v_all.shape[-2:])
            if k is not None:
                kc.index_copy_(0, write, k.to(kc.dtype))
                vc.index_copy_(0, write, v.to(vc.dtype))
            o = _masked_attention(q.view(B, N, *q.shape[1:]), kc[read], vc[read], allowed)
            return o.reshape(B * N, -1).to(q.dtype)

        hidden = self._layers(ids.view(-1), pos.view(-1), attend).view(B, N, -1)
        logits = self._logits(hidden)
        return TargetOutput(logits * valid[:, :, None], hidden * valid[:, :, None])

    # ---- commit ------------------------------------------------------------------------------

    def commit(self, req: int, accepted_nodes: list[int]) -> None:
        """Keep the root and the accepted path (node indices, root excluded, in depth order): their K/V
        move to positions length .. length + len(accepted_nodes); rejected slots are dropped."""
        self.commit_many([(req, accepted_nodes)])

    def commit_many(self, accepted: list[tuple[int, list[int]]]) -> None:
        """`commit` for each (request, accepted_nodes) of a round, their K/V moves batched: one copy of
        the slot ids to the device, and a gather and a scatter per cache, however many requests move
        (a tree's accepted path usually skips nodes, so its K/V moves; a chain's is a prefix and never
        does). Every path is checked before any request changes."""
        for _, nodes in accepted:
            for d, node in enumerate(nodes, start=1):
                if node < d:
                    raise ValueError(f"accepted_nodes: node {node} cannot sit at depth {d}")
        moves = []
        for req, nodes in accepted:
            L = self.lengths[req]
            pairs = [(L + node, L + d) for d, node in enumerate(nodes, start=1) if node != d]
            if pairs:
                moves.append((req, [src for src, _ in pairs], [dst for _, dst in pairs]))
        if moves:
            caches = list(self.caches.values())
            host = [c.move_slots(moves) for c in caches]
            slots = to_device(torch.cat(host, dim=1), self.device).split([h.shape[1] for h in host], dim=1)
            for c, s in zip(caches, slots):
                c.move(s)
        for req, nodes in accepted:
            new_len = self.lengths[req] + 1 + len(nodes)
            self.lengths[req] = new_len
            for c in self.caches.values():
                # the next root attends the last window - 1 entries; a drafter with Hugging Face's query
                # convention reads window + 1 (see Gemma4MTPDrafter.context), so that many stay
                c.trim(req, new_len, keep_from=0 if c.window is None else new_len - c.window - 1)

    @torch.no_grad()
    def prefill(self, reqs: list[int], prompts: list[torch.Tensor], *, last_only: bool = False) -> TargetOutput:
        """Run and commit whole prompts (each request must be empty); returns the prompts' outputs
        (with last_only, just each prompt's last position: [B, 1, ...])."""
        for r, p in zip(reqs, prompts):
            if self.lengths[r] != 0:
                raise ValueError(f"request {r} already holds {self.lengths[r]} positions")
            if len(p) == 0:
                raise ValueError("prompt_ids: every prompt needs at least one token")
        parents = [[-1] + list(range(len(p) - 1)) for p in prompts]
        out = self.forward_tree(reqs, prompts, parents, last_only=last_only)
        for r, p in zip(reqs, prompts):
            # the prompt's last token is committed too: its K/V is in the cache, nothing is pending
            self.commit(r, list(range(1, len(p))))
        return out
