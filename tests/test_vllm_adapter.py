"""gemma4_mtp_kernels.adapters.vllm against tensors laid out exactly as vLLM lays them out.

vLLM cannot run here, so each layout is rebuilt from its definition in vLLM's source (cited at each
builder; vLLM 0.33.0 unless a commit is named) and written through vLLM's *logical* indexing, never
through the adapter's views. Oracles are written out in fp64 from the per-request K/V the test keeps
(attention), from the definition of the centroid head (top clusters, their tokens), and from vLLM's
greedy rejection rule (verify); sampling verification is compared with `tree_verify` called on a
tree the test builds node by node. Unused cache memory is NaN, and vLLM's null block (block 0, what
sliding layers' freed blocks point to) is NaN: nothing outside the attended range may be read.
"""
import pytest
import torch
from torch import nn

import gemma4_mtp_kernels as K
from gemma4_mtp_kernels.adapters import vllm as g4

BACKENDS = ["torch", "triton"]
NAN = float("nan")


# ---- vLLM's KV cache layouts -----------------------------------------------------------------------------

def build_cache(layout, num_blocks, block_size, H, D, dtype):
    """(kv_cache as vLLM hands it to one attention layer, write(block, slot, k [H, D], v [H, D])).

    "5d": TritonAttentionBackend.get_kv_cache_shape = (num_blocks, 2, block_size, num_kv_heads,
      head_size) (vllm/v1/attention/backends/triton_attn.py at vLLM commit 001ceb3e98e7), K at [:, 0],
      V at [:, 1] (its TritonAttentionImpl.forward: kv_cache.unbind(1)).
    "LBHNC" / "LBNHC" / "BLHNC": vLLM 0.33's logical page view [num_blocks, num_kv_heads, block_size,
      (head_size + head_size_v)] (vllm/v1/kv_cache_interface.py: compute_layer_kv_cache_shape_bytes,
      create_kv_cache_views), K in the first head_size entries of the content axis, V after
      (TritonAttentionImpl.forward: kv_cache.transpose(1, 2).split(head_size, dim=-1)), in the
      physical axis orders of vllm/v1/kv_cache_layout.py::KVCacheLayout: LBHNC identity, LBNHC tokens
      before heads, BLHNC blocks outermost across 2 layers (this is layer 1's view)."""
    if layout == "5d":
        kv = torch.full((num_blocks, 2, block_size, H, D), NAN, dtype=dtype)

        def write(blk, slot, k, v):
            kv[blk, 0, slot] = k
            kv[blk, 1, slot] = v
        return kv, write
    C = 2 * D
    if layout == "LBHNC":
        kv = torch.full((num_blocks, H, block_size, C), NAN, dtype=dtype)
    elif layout == "LBNHC":
        kv = torch.full((num_blocks, block_size, H, C), NAN, dtype=dtype).permute(0, 2, 1, 3)
    elif layout == "BLHNC":
        kv = torch.full((num_blocks, 2, H, block_size, C), NAN, dtype=dtype)[:, 1]
    else:
        raise AssertionError(layout)
    assert tuple(kv.shape) == (num_blocks, H, block_size, C)

    def write(blk, slot, k, v):
        kv[blk, :, slot, :D] = k
        kv[blk, :, slot, D:] = v
    return kv, write


def fill_requests(layout, seq_lens, *, block_size, H, D, window, dtype, g):
    """Requests' K/V written into a vLLM cache through permuted block tables. Block 0 is vLLM's null
    block (vllm/v1/core/block_pool.py: the first block popped, `is_null`); a sliding layer's blocks
    wholly before the window are replaced by it (single_type_kv_cache_manager.py, SlidingWindowManager
    remove_skipped_blocks), and table columns past a request's blocks hold 0 too."""
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens) + 1
    num_blocks = 1 + sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    kv, write = build_cache(layout, num_blocks, block_size, H, D, dtype)
    ids = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for r, n in enumerate(seq_lens):
        k = torch.randn(n, H, D, generator=g).to(dtype)
        v = torch.randn(n, H, D, generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        first_kept = 0 if window is None else max(0, n - window) // block_size
        for col in range((n + block_size - 1) // block_size):
            blk = ids.pop()
            if col < first_kept:
                continue  # freed: the table points at the null block
            table[r, col] = blk
            for slot in range(block_size):
                p = col * block_size + slot
                if p < n:
                    write(blk, slot, k[p], v[p])
    return kv, table, torch.tensor(seq_lens, dtype=torch.int32), keys, values


def oracle_attention(q, keys, values, seq_lens, window):
    """q [num_reqs, Q, Hq, D]; keys/values per request [n, H, D]; fp64, keys [n - window, n)."""
    B, Q, Hq, D = q.shape
    out = torch.zeros(B, Q, Hq, D, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        lo = 0 if window is None else max(0, n - window)
        if n <= lo:
            continue
        k, v = keys[b][lo:n].double(), values[b][lo:n].double()
        g = Hq // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,nhd->qhn", q[b].double(), k)
        out[b] = torch.einsum("qhn,nhd->qhd", torch.softmax(s, dim=-1), v)
    return out


ATTN_CASES = [  # (layout, H, Hq, D, window, Q)
    ("5d", 2, 4, 64, None, 1),
    ("5d", 1, 4, 128, 13, 1),
    ("LBHNC", 2, 4, 64, None, 2),
    ("LBHNC", 2, 4, 64, 13, 1),
    ("LBNHC", 1, 4, 128, None, 1),
    ("LBNHC", 2, 4, 64, 5, 2),
    ("BLHNC", 2, 4, 64, 13, 1),
    ("BLHNC", 1, 4, 128, None, 2),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_over_vllm_layouts(case, backend, one_thread):
    layout, H, Hq, D, window, Q = case
    bs = 16  # TRITON_ATTN block sizes are multiples of 16 (TritonAttentionBackend.supports_block_size)
    g = torch.Generator().manual_seed(len(layout) * 7 + D + (window or 0) + Q)
    lens = [1, bs - 1, bs + 1, 3 * bs + 5, 0]
    kv, table, seq_lens, keys, values = fill_requests(layout, lens, block_size=bs, H=H, D=D, window=window,
                                                      dtype=torch.float32, g=g)
    B = len(lens)
    q = torch.randn(B * Q, Hq * D, generator=g)  # what Gemma4MTPAttention passes self.attn: [tokens, heads * D]
    out = g4.attention(q, kv, table, seq_lens, num_heads=Hq, head_size=D, sliding_window=window,
                       queries_per_request=Q, backend=backend)
    assert out.shape == (B * Q, Hq * D) and out.dtype == q.dtype
    want = oracle_attention(q.view(B, Q, Hq, D), keys, values, seq_lens, window).view(B * Q, Hq * D)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_bf16_and_padded_token_rows(backend, one_thread):
    """bf16 within twice the bf16 reference's own error; vLLM's CUDA-graph padding rows come back 0."""
    g = torch.Generator().manual_seed(3)
    kv, table, seq_lens, keys, values = fill_requests("LBNHC", [40, 7], block_size=16, H=2, D=64, window=None,
                                                      dtype=torch.bfloat16, g=g)
    q = torch.randn(5, 4, 64, generator=g).to(torch.bfloat16)  # 2 requests, 3 padding rows; [tokens, heads, D]
    out = g4.attention(q, kv, table, seq_lens, num_heads=4, head_size=64, backend=backend)
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16
    assert torch.equal(out[2:], torch.zeros(3, 256, dtype=torch.bfloat16))
    want = oracle_attention(q[:2].view(2, 1, 4, 64), keys, values, seq_lens, None).view(2, 256)
    ref = g4.attention(q, kv, table, seq_lens, num_heads=4, head_size=64, backend="torch")
    bound = 2 * (ref[:2].double() - want).abs().max().item() + 1e-2
    assert (out[:2].double() - want).abs().max().item() <= bound


def test_cache_views_are_views_and_bad_caches_are_refused():
    for layout in ("5d", "LBHNC", "LBNHC", "BLHNC"):
        kv, _ = build_cache(layout, 4, 16, 2, 64, torch.float32)
        k, v = g4.kv_cache_views(kv, head_size=64)
        assert k.shape == v.shape == (4, 16, 2, 64)
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
        assert k.stride(-1) == 1 and v.stride(-1) == 1
    with pytest.raises(ValueError, match="kv_cache"):
        g4.kv_cache_views(torch.zeros(4, 3, 16, 2, 64))
    with pytest.raises(ValueError, match="kv_cache"):
        g4.kv_cache_views(torch.zeros(4, 2, 16, 130), head_size=64)
    with pytest.raises(ValueError, match="kv_cache"):
        g4.kv_cache_views(torch.zeros(4, 2, 16, 2, 128), head_size=64)
    with pytest.raises(ValueError, match="kv_cache"):
        g4.kv_cache_views(torch.zeros(4, 16, 2, 64, 1, 1))
    with pytest.raises(TypeError, match="kv_cache"):
        g4.kv_cache_views(torch.zeros(4, 2, 16, 128, dtype=torch.float8_e4m3fn))
    kv, table, seq_lens, _, _ = fill_requests("5d", [5], block_size=16, H=2, D=64, window=None, dtype=torch.float32,
                                              g=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="query"):
        g4.attention(torch.zeros(1, 250), kv, table, seq_lens, num_heads=4, head_size=64)
    with pytest.raises(ValueError, match="query"):
        g4.attention(torch.zeros(1, 256), kv, table, seq_lens, num_heads=4, head_size=64, queries_per_request=2)


def test_query_positions_last_cached():
    assert g4.QUERY_POSITION == "last_cached"
    pos = g4.query_positions(torch.tensor([1, 17, 4096], dtype=torch.int32))
    assert pos.dtype == torch.int64 and pos.tolist() == [0, 16, 4095]


# ---- centroid head -------------------------------------------------------------------------------------

class MaskedEmbedderLayout(nn.Module):
    """The attributes of vLLM's Gemma4MTPMaskedEmbedder (vllm/model_executor/models/gemma4_mtp.py,
    __init__): centroids Linear(hidden, num_centroids), token_ordering [vocab] long buffer,
    centroid_intermediate_top_k, vocab_size. Weights only: no forward of its own here."""

    def __init__(self, hidden, vocab, num_centroids, top_k, g):
        super().__init__()
        self.vocab_size, self.num_centroids, self.centroid_intermediate_top_k = vocab, num_centroids, top_k
        self.centroids = nn.Linear(hidden, num_centroids, bias=False)
        with torch.no_grad():
            self.centroids.weight.copy_(torch.randn(num_centroids, hidden, generator=g))
        self.register_buffer("token_ordering", torch.randperm(vocab, generator=g))


def oracle_centroid(h, me, head):
    """fp64: top clusters by h . centroid, their tokens (token_ordering.view(C, -1)[c]), scores."""
    cl = (h.double() @ me.centroids.weight.double().T).topk(me.centroid_intermediate_top_k, dim=-1).indices
    cand = me.token_ordering.view(me.num_centroids, -1)[cl].flatten(1)  # [T, K]
    scores = torch.einsum("td,tkd->tk", h.double(), head.double()[cand])
    return cand, scores


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_centroid_head_over_vllm_token_ordering(dtype, backend, one_thread):
    g = torch.Generator().manual_seed(11)
    Hd, V, Cn, k, T = 32, 512, 32, 4, 5
    me = MaskedEmbedderLayout(Hd, V, Cn, k, g).to(dtype)
    head = torch.randn(V + 64, Hd, generator=g).to(dtype)  # ParallelLMHead pads its rows; the pad is cut
    head[V:] = NAN
    h = torch.randn(T, Hd, generator=g).to(dtype)
    cand, scores = oracle_centroid(h, me, head[:V])
    top = g4.centroid_top_tokens(h, me, head, backend=backend)
    assert top.dtype == torch.int64 and top.shape == (T,)
    best = scores.topk(2, dim=-1)
    clear = (best.values[:, 0] - best.values[:, 1]) > (1e-3 if dtype == torch.float32 else 0.25)
    want = cand.gather(1, best.indices[:, :1]).squeeze(1)
    assert clear.any() and torch.equal(top[clear], want[clear])
    dense = g4.centroid_compute_logits(h, me, head, backend=backend)
    assert dense.shape == (T, V) and dense.dtype == dtype
    chosen = torch.zeros(T, V, dtype=torch.bool).scatter_(1, cand, True)
    assert torch.all(dense[~chosen] == torch.finfo(dtype).min)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(dense.gather(1, cand).double(), scores, rtol=tol, atol=tol)


def test_centroid_head_refuses_a_non_embedder_and_a_short_head():
    g = torch.Generator().manual_seed(0)
    me = MaskedEmbedderLayout(16, 64, 8, 2, g)
    h = torch.randn(2, 16)
    with pytest.raises(TypeError, match="masked_embedding"):
        g4.centroid_top_tokens(h, nn.Linear(16, 8), torch.randn(64, 16))
    with pytest.raises(ValueError, match="lm_head_weight"):
        g4.centroid_compute_logits(h, me, torch.randn(60, 16))


# ---- verification over vLLM's spec-decode rows ---------------------------------------------------------------

def vllm_rows(num_draft_tokens, V, g, agree):
    """logits [num_draft_total + num_reqs, V] in vLLM's row order (gpu_model_runner.py,
    _calc_spec_decode_metadata: per request num_draft + 1 consecutive rows, the bonus row last) and
    draft_token_ids [num_draft_total] (SpecDecodeMetadata.draft_token_ids). `agree(b, j)` says whether
    draft j of request b is the target's argmax at its row."""
    logits = torch.randn(sum(num_draft_tokens) + len(num_draft_tokens), V, generator=g)
    drafts, row = [], 0
    for b, n in enumerate(num_draft_tokens):
        for j in range(n):
            best = int(logits[row + j].argmax())
            drafts.append(best if agree(b, j) else (best + 1) % V)
        row += n + 1
    return logits, torch.tensor(drafts, dtype=torch.int64)


def vllm_greedy(num_draft_tokens, logits, drafts):
    """vLLM's greedy rejection (rejection_sampler.py): accept while the draft is the target's argmax;
    at the first mismatch emit the argmax (recovered token); if all are accepted, the bonus row's
    argmax. Rows of [num_reqs, max_spec_len + 1], PLACEHOLDER_TOKEN_ID = -1."""
    N = max(num_draft_tokens) + 1
    out = torch.full((len(num_draft_tokens), N), -1, dtype=torch.int64)
    row = d = 0
    for b, n in enumerate(num_draft_tokens):
        toks = []
        for j in range(n + 1):
            t = int(logits[row + j].argmax())
            toks.append(t)
            if j == n or t != int(drafts[d + j]):
                break
        out[b, :len(toks)] = torch.tensor(toks)
        row += n + 1
        d += n
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("counts", [[3, 0, 2, 1], [2, 2, 2], [0, 4]], ids=str)
def test_verify_greedy_is_vllms_rejection(counts, backend):
    g = torch.Generator().manual_seed(sum(counts))
    logits, drafts = vllm_rows(counts, 50, g, agree=lambda b, j: (b + j) % 3 != 2)
    res = g4.verify(drafts, counts, logits, backend=backend)
    want = vllm_greedy(counts, logits, drafts)
    assert torch.equal(res.output_tokens, want)
    assert res.accept_len.tolist() == [int((row >= 0).sum()) - 1 for row in want]


def tree_of(counts, logits, drafts, draft_probs):
    """The chains as tree_verify's arguments, built node by node (node 0 = committed token, node j =
    draft j with logits row j; node j's draft distribution = the one draft j + 1 came from)."""
    B, N, V = len(counts), max(counts) + 1, logits.shape[1]
    tokens = torch.zeros(B, N, dtype=torch.int64)
    parents = torch.full((B, N), -1, dtype=torch.int32)
    target = torch.zeros(B, N, V)
    probs = torch.zeros(B, N, V)
    row = d = 0
    for b, n in enumerate(counts):
        for j in range(n + 1):
            target[b, j] = logits[row + j]
            if j:
                tokens[b, j], parents[b, j] = drafts[d + j - 1], j - 1
            if j < n and draft_probs is not None:
                probs[b, j] = draft_probs[d + j]
        row += n + 1
        d += n
    return tokens, parents, target, probs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 2, 1, 4, 2, 3, 1, 2, 4], [2, 2, 2, 2, 2, 2]], ids=str)
def test_verify_sampling_matches_tree_verify_on_the_same_chains(counts, with_q, backend):
    g = torch.Generator().manual_seed(5 + sum(counts))
    V = 40
    logits, drafts = vllm_rows(counts, V, g, agree=lambda b, j: j % 2 == 0)
    total, B, N = sum(counts), len(counts), max(counts) + 1
    # peaked draft distributions, so that a misplaced row flips acceptance decisions
    draft_probs = torch.softmax(4 * torch.randn(total, V, generator=g), -1) if with_q else None
    temperature = 0.5 + torch.rand(B, generator=g)
    temperature[1] = 0.0  # a greedy request among sampling ones
    uniforms = torch.rand(B, N, 2, generator=g)
    res = g4.verify(drafts, counts, logits, temperature=temperature, uniforms=uniforms, draft_probs=draft_probs,
                    backend=backend)
    tokens, parents, target, probs = tree_of(counts, logits, drafts, draft_probs)
    want = K.tree_verify(tokens, parents, target, temperature=temperature, uniforms=uniforms,
                         draft_probs=probs if with_q else None, backend="torch")
    for a, b in zip(res, want):
        assert torch.equal(a, b)


def test_verify_views_uniform_logits_and_names_bad_arguments():
    g = torch.Generator().manual_seed(1)
    logits, drafts = vllm_rows([2, 2], 30, g, agree=lambda b, j: True)
    seen = []
    real = K.tree_verify

    def spy(tokens, parents, target, **kw):
        seen.append(target)
        return real(tokens, parents, target, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(g4, "tree_verify", spy)
    try:
        g4.verify(drafts, [2, 2], logits, backend="torch")
    finally:
        mp.undo()
    assert seen[0].data_ptr() == logits.data_ptr() and seen[0].shape == (2, 3, 30)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        g4.verify(drafts, [2, -2], logits)
    with pytest.raises(ValueError, match="draft_token_ids"):
        g4.verify(drafts[:3], [2, 2], logits)
    with pytest.raises(ValueError, match="logits"):
        g4.verify(drafts, [2, 2], logits[:5])
    with pytest.raises(ValueError, match="draft_probs"):
        g4.verify(drafts, [2, 2], logits, temperature=1.0, uniforms=torch.rand(2, 3, 2),
                  draft_probs=torch.rand(3, 30))

