"""q_only_paged_attention vs gather + SDPA (the PyTorch composition), its torch.compile, and the
external paged decode kernels when importable: vLLM's Triton unified attention, FlashInfer's batch
decode, flash-attn's kvcache kernel (head dim <= 256).

Floor: each request's attended K/V read once (roofline.attention). Every case uses one seq_len for
all requests so the composition needs no host sync.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import gemma4_mtp_kernels as gk

from . import roofline
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
                     "vllm_triton_unified": _vllm(window, ctx), "flashinfer_decode": _flashinfer(window, ctx, block_size),
                     "flash_attn_kvcache": _flash_attn(window, ctx, block_size)}
        kind = "sliding" if window else "full"
        out.append(Case(
            op=OP, label=f"{name} {kind} D={D} B={B} Q={Q} ctx={ctx}",
            params=dict(drafter=name, B=B, Q=Q, Hq=Hq, Hkv=Hkv, D=D, ctx=ctx, window=window, block_size=block_size),
            cost=roofline.attention(B, Q, Hq, Hkv, D, ctx, window=window, block_size=block_size),
            make_inputs=_inputs(B, Q, Hq, Hkv, D, ctx, block_size),
            reference=lambda i, call=call: call(gk.q_only_paged_attention, i, "torch"),
            baselines=baselines, default_compare=close))
    return out


def _vllm(window, ctx):
    def factory(i):
        needs_cuda(i, "vLLM's unified attention")
        fn = None
        for mod in ("vllm.v1.attention.ops.triton_unified_attention", "vllm.attention.ops.triton_unified_attention"):
            try:
                fn = external(mod, "unified_attention")
                break
            except Missing as e:
                reason = str(e)
        if fn is None:
            raise Missing(reason)
        q = i["q"]
        B, Q, Hq, D = q.shape
        q2 = q.reshape(B * Q, Hq, D)
        out = torch.empty_like(q2)
        cu_q = torch.arange(0, B * Q + 1, Q, dtype=torch.int32, device=q.device)
        win = (window - 1, 0) if window else (-1, -1)
        # every query of a request attends the same keys: non-causal

        def run():
            fn(q=q2, k=i["k_cache"], v=i["v_cache"], out=out, cu_seqlens_q=cu_q, max_seqlen_q=Q,
               seqused_k=i["seq_lens"], max_seqlen_k=ctx, softmax_scale=1.0, causal=False, window_size=win,
               block_table=i["block_table"], softcap=0, q_descale=None, k_descale=None, v_descale=None)
            return out.view(B, Q, Hq, D)
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
