"""The ops over vLLM's tensors, for a vLLM Gemma 4 MTP model file (views of vLLM's buffers, no copies
of the KV cache).

    from gemma4_mtp_kernels.adapters import vllm as g4

    out = g4.attention(q, kv_cache, md.block_table, md.seq_lens, num_heads=..., head_size=...,
                       sliding_window=...)                         # in Gemma4MTPAttention.forward
    tok = g4.centroid_top_tokens(h, masked_embedding, lm_head_weight)       # get_top_tokens
    logits = g4.centroid_compute_logits(h, masked_embedding, lm_head_weight)  # compute_logits
    res = g4.verify(draft_token_ids, num_draft_tokens, logits)       # greedy / rejection sampling

vLLM itself is not imported (it cannot run on the CPU machines this is tested on). Every layout fact
below was read in vLLM's source; the tests (tests/test_vllm_adapter.py) build tensors exactly so.
Files are vLLM 0.33.0's (the wheel) unless a commit is named.

KV cache of one attention layer (`Attention.kv_cache`, fetched by
`vllm/model_executor/layers/attention/attention.py::get_attention_context`). Gemma 4 runs the
TRITON_ATTN backend (its head dims differ per layer type; `vllm/v1/spec_decode/gemma4.py::
Gemma4Proposer._create_draft_vllm_config` carries that choice over to the drafter), whose layout is
one of:
- 4-D `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, K in the first head_size entries of
  the last dim and V in the next: the standard logical `[B, H, N, C]` page view
  (`vllm/v1/kv_cache_interface.py::create_kv_cache_views`, `compute_layer_kv_cache_shape_bytes`;
  `AttentionSpec.state_content_size_bytes` = (head_size + head_size_v) * dtype size), with any
  physical order of the blocks / heads / tokens axes (`vllm/v1/kv_cache_layout.py::KVCacheLayout`,
  e.g. LBHNC or LBNHC) and the content axis contiguous. `TritonAttentionImpl.forward`
  (`vllm/v1/attention/backends/triton_attn.py`) reads it as
  `kv_cache.transpose(1, 2).split(head_size, dim=-1)`. vLLM 0.33.0.
- 5-D `[num_blocks, 2, block_size, num_kv_heads, head_size]`: `TritonAttentionBackend.
  get_kv_cache_shape` before that standardisation (vLLM commit 001ceb3e98e7), read as
  `kv_cache.unbind(1)` in its `TritonAttentionImpl.forward`.
`kv_cache_views` returns K and V as `[num_blocks, block_size, num_kv_heads, head_size]` views of
either; `q_only_paged_attention` accepts any strides there but stride 1 in head_size. Quantized
caches (fp8, per-token-head int8/fp8/int4 with inline scales) are refused (`kv_cache` dtype).

Attention metadata (`TritonAttentionMetadata`, same file): `block_table [num_reqs, max_blocks]`
int32 and `seq_lens [num_reqs]` int32; for the drafter they are the *target's* (per KV-cache group:
sliding and full layers have their own block tables, `Gemma4Proposer.
build_per_group_and_layer_attn_metadata`), and they do not advance between draft steps
(`SpecDecodeBaseProposer.constant_draft_positions = True` in `Gemma4Proposer.__init__`:
"All draft steps predict from the same position (the last target-model position)").

Query-position convention, `QUERY_POSITION = "last_cached"`: every draft query of request b sits at
position P = seq_lens[b] - 1, the last position whose K/V is in the cache (its RoPE position:
`query_positions`), and attends keys [0, P], i.e. all seq_lens[b] cached entries; on a sliding layer
the last `sliding_window` of them (`TritonAttentionImpl.__init__` turns sliding_window W into
`(W - 1, 0)`: keys P - W + 1 .. P). Hugging Face's assistant instead sits at P + 1 and sees W + 1
sliding entries (see gemma4_mtp.hf). Drafts never attend drafts (the drafter writes no K/V), so
the first draft pass needs only the sampled position of each request (vLLM computes all scheduled
positions and keeps `hidden_states[token_indices_to_sample]`, `llm_base_proposer.py::propose`):
call `attention` with exactly `queries_per_request` rows per request, in request order.

Query rows: `Gemma4MTPAttention.forward` (`vllm/model_executor/models/gemma4_mtp.py`) hands
`self.attn(q, None, None)` a `[num_tokens, num_heads * head_size]` query after q_norm and RoPE, and
expects `[num_tokens, num_heads * head_size]` back. vLLM may pad num_tokens (CUDA graphs) past the
requests: rows beyond `num_reqs * queries_per_request` come back as zeros.

Centroid head (`Gemma4MTPMaskedEmbedder`, vllm/model_executor/models/gemma4_mtp.py): attributes
`centroids` (Linear hidden -> num_centroids), `token_ordering` ([vocab] long: cluster c owns
`token_ordering.view(num_centroids, -1)[c]`), `centroid_intermediate_top_k`, `vocab_size`;
`get_top_tokens` returns token ids [T]; `forward` (used by `Gemma4MTP.compute_logits`) returns
[T, vocab] in the hidden dtype with non-selected tokens at `torch.finfo(dtype).min`. The LM head
weight is `Gemma4MTP._get_full_lm_head_weight()` ([vocab, hidden], gathered over TP ranks); a
padded head (more rows than the vocab) is cut to the vocab here.

Verification (`vllm/v1/worker/gpu_model_runner.py::_calc_spec_decode_metadata`,
`vllm/v1/spec_decode/metadata.py::SpecDecodeMetadata`, `vllm/v1/sample/rejection_sampler.py`):
the target's `logits [num_draft_total + num_reqs, vocab]` hold, per request and in request order,
`num_draft_tokens[b] + 1` consecutive rows: row j is the distribution after the committed tokens
and the first j drafts (row 0 follows the last committed token, the last row is the bonus row);
`draft_token_ids [num_draft_total]` are the drafts, flattened in the same order;
`num_draft_tokens` is a host list; `temperature == 0` marks a greedy request (`GREEDY_TEMPERATURE`);
the output is `[num_reqs, max_spec_len + 1]` with accepted tokens, then the recovered or bonus token,
then `PLACEHOLDER_TOKEN_ID = -1`: exactly `VerifyResult.output_tokens` (int64 here, int32 there).
As a tree, request b is a chain: node 0 the committed token, node j draft j, node j's logits row j.

Not adapted: the pre-projection. vLLM's `Gemma4MultiTokenPredictor.embed_input_ids` multiplies the
bf16 embedding by an fp32 `normalizer` tensor (sqrt(backbone_hidden_size) unrounded), while
`fused_concat_down_proj` reproduces Hugging Face's Gemma embedding (scale rounded to the table dtype
first: 39.25 for sqrt(1536) in bf16), so the two differ in the last bit of about a quarter of the
embedding entries; and under tensor parallelism vLLM's embedding table is vocab-sharded.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .. import _checks as C
from .._types import VerifyResult
from ..ops import centroid_logits as _centroid_logits
from ..ops import q_only_paged_attention, tree_verify

QUERY_POSITION = "last_cached"


def kv_cache_views(kv_cache: torch.Tensor, *, head_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's vLLM cache as [num_blocks, block_size, num_kv_heads, head_size] views.

    4-D `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (vLLM 0.33, any physical axis order,
    content contiguous) or 5-D `[num_blocks, 2, block_size, num_kv_heads, head_size]` (earlier vLLM)."""
    op = "vllm.kv_cache_views"
    C.tensor(op, "kv_cache", kv_cache, dtypes=C.FLOAT_DTYPES)
    if head_size is not None:
        C.positive_int(op, "head_size", head_size)
    if kv_cache.dim() == 5:
        if kv_cache.shape[1] != 2:
            C.fail_value(op, "kv_cache", "[num_blocks, 2, block_size, num_kv_heads, head_size] when 5-d",
                         f"shape {tuple(kv_cache.shape)}")
        if head_size is not None and kv_cache.shape[4] != head_size:
            C.fail_value(op, "kv_cache", f"of head_size {head_size} (shape[4])", f"shape {tuple(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    elif kv_cache.dim() == 4:
        content = kv_cache.shape[3]
        D = content // 2 if head_size is None else head_size
        if content != 2 * D:
            C.fail_value(op, "kv_cache", f"[num_blocks, num_kv_heads, block_size, 2 * head_size = {2 * D}] when 4-d",
                         f"shape {tuple(kv_cache.shape)}")
        tokens_major = kv_cache.transpose(1, 2)
        k, v = tokens_major[..., :D], tokens_major[..., D:]
    else:
        C.fail_value(op, "kv_cache", "4-d (vLLM >= 0.33) or 5-d (earlier)", f"shape {tuple(kv_cache.shape)}")
    C.inner_contiguous(op, "kv_cache", k)
    return k, v


def query_positions(seq_lens: torch.Tensor) -> torch.Tensor:
    """RoPE position of every draft query of each request under vLLM's convention: seq_lens - 1 (int64)."""
    C.tensor("vllm.query_positions", "seq_lens", seq_lens, ndim=1, dtypes=C.INDEX_DTYPES)
    return seq_lens.long() - 1


def attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
              num_heads: int, head_size: int, sliding_window: int | None = None, queries_per_request: int = 1,
              backend: str = "auto") -> torch.Tensor:
    """Drafter attention over a vLLM layer cache, queries at the last cached position.

    query [num_tokens, num_heads * head_size] (or [num_tokens, num_heads, head_size]), rows grouped by
    request in request order, `queries_per_request` each (tree branches of one level share their
    keys); kv_cache as in `kv_cache_views`; block_table [num_reqs, max_blocks] int32 and seq_lens
    [num_reqs] int32 from the layer's attention metadata. Returns [num_tokens, num_heads * head_size]
    in query's dtype (rows past num_reqs * queries_per_request are zeros)."""
    op = "vllm.attention"
    C.tensor(op, "query", query, dtypes=C.FLOAT_DTYPES)
    C.positive_int(op, "num_heads", num_heads)
    C.positive_int(op, "head_size", head_size)
    C.positive_int(op, "queries_per_request", queries_per_request)
    C.tensor(op, "seq_lens", seq_lens, ndim=1)
    per_row = (num_heads * head_size,) if query.dim() == 2 else (num_heads, head_size)
    if query.dim() not in (2, 3) or tuple(query.shape[1:]) != per_row:
        C.fail_value(op, "query", f"[num_tokens, num_heads * head_size = {num_heads * head_size}] or "
                     f"[num_tokens, {num_heads}, {head_size}]", f"shape {tuple(query.shape)}")
    T = query.shape[0]
    rows = seq_lens.shape[0] * queries_per_request
    if T < rows:
        C.fail_value(op, "query", f"at least num_reqs * queries_per_request = {rows} rows (seq_lens has "
                     f"{seq_lens.shape[0]} requests)", f"shape {tuple(query.shape)}")
    k, v = kv_cache_views(kv_cache, head_size=head_size)
    q = query[:rows].reshape(seq_lens.shape[0], queries_per_request, num_heads, head_size)
    o = q_only_paged_attention(q, k, v, block_table, seq_lens, scale=1.0, window=sliding_window, backend=backend)
    o = o.reshape(rows, num_heads * head_size)
    if T == rows:
        return o
    out = query.new_zeros(T, num_heads * head_size)
    out[:rows] = o
    return out


def _centroid_args(op, hidden_states, masked_embedding, lm_head_weight):
    for attr in ("centroids", "token_ordering", "centroid_intermediate_top_k"):
        if not hasattr(masked_embedding, attr):
            C.fail_type(op, "masked_embedding", f"vLLM's Gemma4MTPMaskedEmbedder (it has no {attr!r})",
                        type(masked_embedding).__name__)
    C.tensor(op, "lm_head_weight", lm_head_weight, ndim=2)
    V = masked_embedding.token_ordering.shape[0]
    if lm_head_weight.shape[0] < V:
        C.fail_value(op, "lm_head_weight", f"at least vocab = {V} rows", f"shape {tuple(lm_head_weight.shape)}")
    return (hidden_states, masked_embedding.centroids.weight, masked_embedding.token_ordering, lm_head_weight[:V],
            masked_embedding.centroid_intermediate_top_k)


def centroid_top_tokens(hidden_states: torch.Tensor, masked_embedding, lm_head_weight: torch.Tensor, *,
                        backend: str = "auto") -> torch.Tensor:
    """`Gemma4MTPMaskedEmbedder.get_top_tokens`: the best token of the top clusters, [T] int64."""
    h, cw, order, head, k = _centroid_args("vllm.centroid_top_tokens", hidden_states, masked_embedding, lm_head_weight)
    return _centroid_logits(h, cw, order, head, top_k=k, output="argmax", backend=backend)[0]


def centroid_compute_logits(hidden_states: torch.Tensor, masked_embedding, lm_head_weight: torch.Tensor, *,
                            backend: str = "auto") -> torch.Tensor:
    """`Gemma4MTPMaskedEmbedder.forward`: [T, vocab] in hidden_states' dtype, the candidates' logits
    at their ids and torch.finfo(dtype).min elsewhere."""
    h, cw, order, head, k = _centroid_args("vllm.centroid_compute_logits", hidden_states, masked_embedding,
                                           lm_head_weight)
    C.tensor("vllm.centroid_compute_logits", "hidden_states", h, dtypes=C.FLOAT_DTYPES)
    fill = float(torch.finfo(h.dtype).min)
    return _centroid_logits(h, cw, order, head, top_k=k, output="dense", fill_value=fill, backend=backend).to(h.dtype)


def verify(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int], logits: torch.Tensor, *,
           temperature=None, uniforms: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None,
           backend: str = "auto") -> VerifyResult:
    """tree_verify over vLLM's spec-decode rows (chains, one per request).

    draft_token_ids [num_draft_total]; num_draft_tokens a host list (SpecDecodeMetadata); logits
    [num_draft_total + num_reqs, vocab] in vLLM's row order (see the module docstring);
    temperature None, a float or [num_reqs] fp32 (0 = greedy); uniforms [num_reqs, max_spec_len + 1, 2]
    in the chain's node order (node j: [0] decides draft j + 1, [1] draws the recovered / bonus token);
    draft_probs [num_draft_total, vocab] (row of draft j = the distribution it was drawn from) or None
    for deterministic drafts. With the same number of drafts in every request, the logits
    are viewed, not copied (draft_probs get one appended leaf row: a copy); ragged requests gather
    the rows into [num_reqs, N, vocab].
    output_tokens is vLLM's [num_reqs, max_spec_len + 1] output (int64, -1 = placeholder)."""
    op = "vllm.verify"
    counts = list(num_draft_tokens)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
        C.fail_value(op, "num_draft_tokens", "a non-empty list of ints >= 0", counts)
    C.tensor(op, "draft_token_ids", draft_token_ids, ndim=1, dtypes=C.INDEX_DTYPES)
    C.tensor(op, "logits", logits, ndim=2, dtypes=C.FLOAT_DTYPES)
    B, total, N = len(counts), sum(counts), max(counts) + 1
    if draft_token_ids.shape[0] != total:
        C.fail_value(op, "draft_token_ids", f"of length sum(num_draft_tokens) = {total}",
                     f"shape {tuple(draft_token_ids.shape)}")
    if logits.shape[0] != total + B:
        C.fail_value(op, "logits", f"of {total + B} rows (drafts + one bonus row per request)",
                     f"shape {tuple(logits.shape)}")
    if draft_probs is not None:
        C.tensor(op, "draft_probs", draft_probs, ndim=2, dtypes=C.FLOAT_DTYPES)
        if tuple(draft_probs.shape) != (total, logits.shape[1]):
            C.fail_value(op, "draft_probs", f"of shape (num_draft_total, vocab) = {(total, logits.shape[1])}",
                         f"shape {tuple(draft_probs.shape)}")
    dev = logits.device
    parents = torch.arange(-1, N - 1, dtype=torch.int32, device=dev).expand(B, N).clone()
    root = torch.zeros(B, 1, dtype=draft_token_ids.dtype, device=dev)  # node 0's token is never read
    if all(n == N - 1 for n in counts):
        target = logits.reshape(B, N, -1)  # a view of vLLM's contiguous rows
        tokens = torch.cat([root, draft_token_ids.view(B, N - 1)], dim=1)
        probs = None
        if draft_probs is not None:  # node j holds the distribution draft j + 1 came from; the leaf's is unused
            probs = torch.cat([draft_probs.view(B, N - 1, -1), draft_probs.new_zeros(B, 1, draft_probs.shape[1])], 1)
    else:  # ragged (then some request has drafts: total > 0); padding nodes get parent -1
        j = torch.arange(N)[None, :]
        width = torch.tensor(counts)[:, None]
        first = torch.tensor(list(itertools.accumulate(counts, initial=0))[:-1])[:, None]
        parents[(j > width).to(dev)] = -1
        target = logits[(first + torch.arange(B)[:, None] + torch.minimum(j, width)).to(dev)]
        drafted = ((j >= 1) & (j <= width)).to(dev)
        tokens = torch.where(drafted, draft_token_ids[(first + j - 1).clamp(0, total - 1).to(dev)], 0)
        probs = None
        if draft_probs is not None:
            has_q = (j < width).to(dev)[..., None]
            probs = torch.where(has_q, draft_probs[(first + j).clamp(max=total - 1).to(dev)], 0.0)
    return tree_verify(tokens.contiguous(), parents, target, temperature=temperature, uniforms=uniforms,
                       draft_probs=probs, backend=backend)
