"""q_only_paged_attention vs gather + SDPA (the PyTorch composition), its torch.compile, and the
external paged decode kernels when they can be had: vLLM's Triton unified attention called as vLLM's
Triton backend calls it for decode (split-K scratch; `vllm_unified_splitk`) and, labelled apart for
Q > 1, non-causal with no scratch (its 2D path; `vllm_unified_2d`), from a stubbed copy of vLLM's
kernel file (benchmarks/vllm_anchor.py) or an installed vLLM; FlashInfer's batch decode; flash-attn's
kvcache kernel (head dim <= 256).

Floor: each request's attended K/V read once (roofline.attention). Every case uses one seq_len for
all requests so the composition needs no host sync.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import gemma4_mtp_kernels as gk

from . import roofline, vllm_anchor
from .common import Case, Missing, close, compiled, external, needs_cuda, ours

OP = "q_only_paged_attention"


def gather_sdpa(q, k_cache, v_cache, block_table, lo: int, hi: int, block_size: int):
    """Gather keys [lo, hi) of every request into contiguous K/V, then SDPA (scale 1, no mask)."""
    B = q.shape[0]
    first, last = lo // block_size, -(-hi // block_size)
    blocks = block_table[:, first:last]
    k = k_cache[blocks].flatten(1, 2)[:, lo - first * block_size: hi - first * block_size]
    v = v_cache[blocks].flatten(1, 2)[:, lo - first * block_size: hi - first * block_size]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(B, *q.shape[1:])


def _inputs(B, Q, Hq, Hkv, D, ctx, block_size):
    def make(device, dtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        nblk = -(-ctx // block_size)
        num_blocks = B * nblk + 1
        # blocks in a random order, as an engine's allocator leaves them
        perm = torch.randperm(num_blocks, generator=g, device=device)[: B * nblk].view(B, nblk).to(torch.int32)
        k = torch.randn(num_blocks, block_size, Hkv, D, generator=g, device=device).to(dtype)
        v = torch.randn(num_blocks, block_size, Hkv, D, generator=g, device=device).to(dtype)
        return {"q": (torch.randn(B, Q, Hq, D, generator=g, device=device) / math.sqrt(D)).to(dtype),
                "k_cache": k, "v_cache": v, "block_table": perm,
                "seq_lens": torch.full((B,), ctx, dtype=torch.int32, device=device)}
    return make


def cases(dry: bool) -> list[Case]:
    gather_c = compiled(gather_sdpa, dry)
    if dry:
        grid = [("E2B-tiny", 2, 1, 4, 1, 512, 40, None), ("E2B-tiny", 1, 3, 4, 1, 256, 40, 24),
                ("31B-tiny", 1, 1, 8, 2, 512, 33, None)]
    else:
        # B = 1 at long context (the targets) for every drafter first, then batches
        grid = []
        for name, d in roofline.DRAFTERS.items():
            grid += [(name, 1, 1, d["Hq"], d["Hkv_full"], d["D_full"], ctx, None) for ctx in (8192, 32768)]
            grid.append((name, 1, 1, d["Hq"], d["Hkv_swa"], d["D_swa"], 8192, d["window"]))
        for name in ("E2B", "31B"):
            d = roofline.DRAFTERS[name]
            grid += [(name, B, Q, d["Hq"], d["Hkv_full"], d["D_full"], 8192, None) for B, Q in ((8, 1), (1, 4), (32, 1))]
            grid.append((name, 8, 1, d["Hq"], d["Hkv_swa"], d["D_swa"], 8192, d["window"]))
        # Hugging Face's sliding window (the drafter's + 1: gemma4_mtp.hf, query_position="next")
        d = roofline.DRAFTERS["E2B"]
        grid.append(("E2B", 1, 1, d["Hq"], d["Hkv_swa"], d["D_swa"], 8192, d["window"] + 1))
    block_size = 16
    out = []
    for name, B, Q, Hq, Hkv, D, ctx, window in grid:
        lo = max(0, ctx - window) if window else 0

        def call(fn, i, backend, window=window):
            return fn(i["q"], i["k_cache"], i["v_cache"], i["block_table"], i["seq_lens"], scale=1.0, window=window,
                      backend=backend)

        def composition(fn, lo=lo, hi=ctx):
            return lambda i: (lambda: fn(i["q"], i["k_cache"], i["v_cache"], i["block_table"], lo, hi, block_size))

        baselines = {"torch_gather_sdpa": composition(gather_sdpa), "torch_gather_sdpa_compile": composition(gather_c),
                     "triton": ours(OP, "triton", call), "cuda": ours(OP, "cuda", call),
                     "vllm_unified_splitk": _vllm(window, ctx, split_k=True)}
        if Q > 1:  # there vLLM's only call computing this op's function (no window): its 2D path
            baselines["vllm_unified_2d"] = _vllm(window, ctx, split_k=False)
        baselines.update(flashinfer_decode=_flashinfer(window, ctx, block_size),
                         flash_attn_kvcache=_flash_attn(window, ctx, block_size))
        kind = "sliding" if window else "full"
        hf = window is not None and window != roofline.DRAFTERS.get(name, {}).get("window", window)
        out.append(Case(
            op=OP, label=f"{name} {kind} D={D} B={B} Q={Q} ctx={ctx}" + (f" window={window}" if hf else ""),
            params=dict(drafter=name, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, ctx=ctx, window=window, block_size=block_size),
            cost=roofline.attention(B, Q, Hq, Hkv, D, ctx, window=window, block_size=block_size),
            make_inputs=_inputs(B, Q, Hq, Hkv, D, ctx, block_size),
            reference=lambda i, call=call: call(gk.q_only_paged_attention, i, "torch"),
            baselines=baselines, default_compare=close, compare=_vllm_compare(Q, window)))
    return out


def _vllm_compare(Q: int, window) -> dict:
    """With Q > 1 vLLM computes another function than this op (checked against shifted references under
    the Triton interpreter when the anchor was written); its time is still the anchor's."""
    def differs(why):
        return lambda out, ref: {"ok": None, "detail": f"a different function: {why}"}
    if Q == 1:
        return {}
    cmp = {"vllm_unified_splitk": differs("causal over the Q queries, query i sees keys up to ctx - Q + i "
                                          "(vLLM's verify semantics)")}
    if window:
        cmp["vllm_unified_2d"] = differs("vLLM's window follows each query's position, query i sees keys from "
                                         "ctx - Q + i - window + 1")
    return cmp


# How vLLM's TritonAttention backend (vllm/v1/attention/backends/triton_attn.py) sets up decode: below
# seq_threshold_3D = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads requests, `unified_attention` runs its split-K
# ("3D") kernel over NUM_PAR_SOFTMAX_SEGMENTS segments of the key range plus a reduction, in fp32 scratch
# the metadata builder allocates once for min(threshold, max_num_seqs) requests of up to
# 1 + num_speculative_tokens (at most MAX_3D_QUERY_LEN) queries each. Without the scratch it runs the 2D
# kernel, one program per (query block, KV head) over the whole key range: 10-25x slower at B = 1.
VLLM_MIN_LAUNCH_GRID_SIZE_2D = 128
VLLM_NUM_PAR_SOFTMAX_SEGMENTS = 16
VLLM_MAX_3D_QUERY_LEN = 8  # triton_unified_attention.MAX_3D_QUERY_LEN in vLLM 0.33 (read from the module if it has it)


def vllm_call(mod, q, k_cache, v_cache, block_table, seq_lens, *, ctx: int, window, split_k: bool, probe: bool = True):
    """(run, how) for vLLM's `unified_attention` on our inputs, called as vLLM's Triton backend calls
    it for a decode / verify batch (split_k=True) or with no split-K scratch (split_k=False: its 2D
    path, which vLLM runs for prefill and for batches above the threshold, not for small decode).

    split_k: causal=True as vLLM's decode metadata has it. With Q = 1 that is this op's function;
    with Q > 1 query i of a request sees keys up to ctx - Q + i (vLLM's verify semantics, a different
    function from this op's, whose Q queries all see the same keys). split_k=False: causal=False, which
    is this op's function for every Q (and forces the 2D path for Q > 1).

    probe: run once with the scratch poisoned to record which path vLLM took ("path" in `how`)."""
    B, Q, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    q2 = q.reshape(B * Q, Hq, D)
    out = torch.empty_like(q2)
    cu_q = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=q.device)
    win = (window - 1, 0) if window else (-1, -1)
    how = {"function": "unified_attention", "causal": split_k, "window_size": list(win), "block_size": k_cache.shape[1],
           "softcap": 0, "descales": None}
    kw = {}
    if split_k:
        threshold = VLLM_MIN_LAUNCH_GRID_SIZE_2D // Hkv
        max_q_3d = min(Q, getattr(mod, "MAX_3D_QUERY_LEN", VLLM_MAX_3D_QUERY_LEN))
        rows = threshold * max_q_3d  # vLLM's max_num_seqs (256 by default) is above every threshold here
        segs = VLLM_NUM_PAR_SOFTMAX_SEGMENTS
        d_pad = 1 << (D - 1).bit_length()
        kw = dict(seq_threshold_3D=threshold, num_par_softmax_segments=segs,
                  softmax_segm_output=torch.empty(rows, Hq, segs, d_pad, dtype=torch.float32, device=q.device),
                  softmax_segm_max=torch.empty(rows, Hq, segs, dtype=torch.float32, device=q.device),
                  softmax_segm_expsum=torch.empty(rows, Hq, segs, dtype=torch.float32, device=q.device))
        how.update(seq_threshold_3D=threshold, num_par_softmax_segments=segs, scratch_rows=rows,
                   scratch="softmax_segm_output [rows, Hq, 16, next_pow2(D)], softmax_segm_max / softmax_segm_expsum "
                           "[rows, Hq, 16], fp32, as TritonAttentionMetadataBuilder allocates them",
                   note="vLLM snaps seq_threshold_3D to the nearest CUDA-graph capture size; 128 // Hkv is one "
                        "of its default sizes for Hkv = 1, 2, 4, 8, 16")

    def run():
        mod.unified_attention(q=q2, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=Q,
                              seqused_k=seq_lens, max_seqlen_k=ctx, softmax_scale=1.0, causal=split_k,
                              window_size=win, block_table=block_table, softcap=0, q_descale=None,
                              k_descale=None, v_descale=None, **kw)
        return out.view(B, Q, Hq, D)

    if split_k and probe:
        # which kernel vLLM chose, seen rather than inferred: only the 3D path writes the scratch
        kw["softmax_segm_max"].fill_(float("nan"))
        run()
        how["path"] = "2d" if bool(torch.isnan(kw["softmax_segm_max"][: B * Q]).all()) else "3d (split-K)"
    elif not split_k:
        how["path"] = "2d"
    return run, how


def _vllm(window, ctx, split_k: bool):
    probed = {}

    def factory(i):
        try:
            mod, prov = vllm_anchor.load()
        except LookupError as e:
            raise Missing(str(e)) from None
        run, how = vllm_call(mod, i["q"], i["k_cache"], i["v_cache"], i["block_table"], i["seq_lens"], ctx=ctx,
                             window=window, split_k=split_k, probe=not probed)  # one probe per case
        probed.update(how if not probed else {})
        run.provenance = {**prov, "call": dict(probed)}
        return run
    return factory


def _flashinfer(window, ctx, block_size):
    def factory(i):
        needs_cuda(i, "FlashInfer")
        fi = external("flashinfer")
        q = i["q"]
        B, Q, Hq, D = q.shape
        Hkv = i["k_cache"].shape[2]
        nblk = i["block_table"].shape[1]
        # the decode kernel takes one query per entry: a request's Q queries become Q entries sharing its pages
        table = i["block_table"].repeat_interleave(Q, dim=0)
        indptr = torch.arange(0, B * Q + 1, dtype=torch.int32, device=q.device) * nblk
        last = torch.full((B * Q,), ctx - (nblk - 1) * block_size, dtype=torch.int32, device=q.device)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, table.flatten(), last, Hq, Hkv, D, block_size, pos_encoding_mode="NONE",
               window_left=(window - 1) if window else -1, sm_scale=1.0, q_data_type=q.dtype, kv_data_type=q.dtype)
        q2 = q.reshape(B * Q, Hq, D)
        return lambda: w.run(q2, (i["k_cache"], i["v_cache"])).view(B, Q, Hq, D)
    return factory


def _flash_attn(window, ctx, block_size):
    def factory(i):
        needs_cuda(i, "flash-attn")
        fn = external("flash_attn", "flash_attn_with_kvcache")
        q = i["q"]
        B, Q, Hq, D = q.shape
        if D > 256:
            raise Missing(f"flash-attn supports head dim <= 256, this case has {D}")
        # its paged mode needs pages of 256 entries: the same K/V re-laid in 256-entry pages
        page = 256
        n = -(-ctx // page) * page
        k = _contiguous_kv(i["k_cache"], i["block_table"], ctx, block_size, n)
        v = _contiguous_kv(i["v_cache"], i["block_table"], ctx, block_size, n)
        Hkv = k.shape[-2]
        k, v = k.view(-1, page, Hkv, D), v.view(-1, page, Hkv, D)
        table = torch.arange(k.shape[0], dtype=torch.int32, device=q.device).view(B, -1)
        win = (window - 1, 0) if window else (-1, -1)
        return lambda: fn(q, k, v, cache_seqlens=i["seq_lens"], block_table=table, softmax_scale=1.0, causal=False,
                          window_size=win)
    return factory


def _contiguous_kv(cache, block_table, ctx, block_size, padded):
    """The first `ctx` entries of each request, contiguous, zero-padded to `padded` entries."""
    B = block_table.shape[0]
    x = cache[block_table].flatten(1, 2)[:, :ctx]
    return torch.cat([x, x.new_zeros(B, padded - ctx, *x.shape[2:])], dim=1).contiguous()
