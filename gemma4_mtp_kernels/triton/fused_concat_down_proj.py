"""Triton `fused_concat_down_proj` (SPEC §4.1).

Design. y[T, Hd] = W[Hd, 2Hb] @ concat(e, h)[T, 2Hb]^T is a skinny GEMM whose cost is the weight
(Hd * 2Hb elements, 1.5 MiB for E2B up to 21 MiB for 31B in bf16); the T <= 64 activations are tiny.
- Grid (Hd / BLOCK_N, T / BLOCK_T, SPLIT_K). A program owns BLOCK_N weight rows and all T tokens of
  its T tile (BLOCK_T = T rounded up to 16..64), so each weight row is read once per call when
  T <= 64 (the hot case); the output tile is acc[BLOCK_N, BLOCK_T] = W_tile @ x_tile^T via tl.dot.
- Both halves of W are reduced in two loops over the same K range: the embedding half against the
  gathered rows embed_table[token_ids] (scaled by the table-dtype-rounded scale and rounded back to
  the table dtype in registers, as Gemma's scaled embedding does), the hidden half against hidden.
  Neither the concat nor the gathered rows ever touch memory.
- Split-K: E2B/E4B (Hd 256) give only Hd / BLOCK_N = 8 row tiles, far from filling 132 SMs, so each
  half's K blocks are divided among SPLIT_K programs. SPLIT_K is capped so that the fp32 partials
  (written and read back: 8 * SPLIT_K * T * Hd bytes) stay under ~1/4 of the weight bytes
  (SPLIT_K <= Hb / (8 T)). Each program writes its partial tile to an fp32 workspace; the last program
  of a tile to finish (a per-tile counter, gemma4_mtp_kernels._counters: left zero, no memset) sums the
  tile's partials in split order, so the result is deterministic and the output fully written, in the
  same launch (the first GPU run had a second reduce launch: ~1.5 us of a 9 us E2B call). fp32 atomics
  would need a zeroed output and give run-to-run differences. SPLIT_K = 1 writes the output directly.
- Token ids are not range-checked on the GPU (that would sync); an id outside [0, V) loads NaN
  instead of its embedding row, so its output row is NaN: never an out-of-bounds read, never a
  plausible wrong number.
Expected on H100/H200: the weight stream dominates (Hd * 2Hb * 2 bytes, plus T * 2Hb * 2 bytes of
activations read from L2 per row tile). At T = 1..16 the MMA work is negligible, so with >= 2
programs per SM and 64-wide K tiles this should reach ~70-80% of copy bandwidth for 26B/31B
(11-21 MiB); E2B/E4B (1.5-2.5 MiB, < 1 us of traffic) are bound by launch latency rather than bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._counters import zeroed_counters
from . import tuned
from ._common import (cast, cdiv, dot_precision, interpreting, last_to_arrive, mma, num_sms, pdl_args, pow2_at_least,
                      prefetch_weight_rows, split_epilogue, sum_splits, wait_for_inputs)


# T is not specialised: Triton turns an integer argument equal to 1 into a constant, and `T.to(...)` of a
# constant does not compile (every T = 1 split-K launch failed the recorded-launch compile check).
@triton.jit(do_not_specialize=["T", "kb_per_split", "split_k"])
def _down_proj_kernel(tok_ptr, emb_ptr, hid_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr,
                      T, V, Hb, Hd, kb_per_split, split_k, scale,
                      stride_emb, stride_hid, stride_w, stride_t,
                      BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      SPLIT_LOADS: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < Hd
    kb_lo = pid_s * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, tl.cdiv(Hb, BLOCK_K))
    # both halves of the rows: the embedding's columns [0, Hb), the hidden state's [Hb, 2 Hb)
    k_hi = tl.minimum(kb_hi * BLOCK_K, Hb)
    prefetch_weight_rows(w_ptr, n, n_mask, stride_w, kb_lo * BLOCK_K, k_hi, USE_PDL)
    prefetch_weight_rows(w_ptr + Hb, n, n_mask, stride_w, kb_lo * BLOCK_K, k_hi, USE_PDL)
    wait_for_inputs(USE_PDL)
    # torch.compile's launcher passes a Python float as an fp64 scalar: the kernel's math stays fp32
    scale = tl.cast(scale, tl.float32)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    tok = tl.load(tok_ptr + t, mask=t_mask, other=0).to(tl.int64)
    tok_ok = (tok >= 0) & (tok < V)
    tok = tl.where(tok_ok, tok, 0)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    emb_rows = emb_ptr + tok[None, :] * stride_emb
    hid_rows = hid_ptr + t.to(tl.int64)[None, :] * stride_hid
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = k < Hb
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        e = tl.load(emb_rows + k[:, None], mask=k_mask[:, None] & t_mask[None, :], other=0.0)
        # Gemma rounds the scaled embedding to the table dtype before the projection
        e = cast(tl.where(tok_ok[None, :], e.to(tl.float32) * scale, float("nan")), w.dtype, INTERP)
        acc = mma(w, e, acc, PREC, INTERP)
    for kb in range(kb_lo, kb_hi):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = k < Hb
        w = tl.load(w_rows + Hb + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        h = tl.load(hid_rows + k[:, None], mask=k_mask[:, None] & t_mask[None, :], other=0.0)
        acc = mma(w, h, acc, PREC, INTERP)
    tile_mask = n_mask[:, None] & t_mask[None, :]
    at = t.to(tl.int64)[None, :] * stride_t + n[:, None]
    if SPLIT:
        numel = T.to(tl.int64) * Hd
        tl.store(part_ptr + pid_s * numel + at, acc, mask=tile_mask)
        # the tile's last program to finish sums the partials in split order (deterministic; .cg loads)
        tile = pid_t * tl.num_programs(0) + pid_n
        if last_to_arrive(cnt_ptr + tile, split_k):
            total = sum_splits(part_ptr + at, numel, split_k, tile_mask, BLOCK_N, BLOCK_T, SPLIT_LOADS)
            tl.store(out_ptr + at, cast(total, out_ptr.dtype.element_ty, INTERP), mask=tile_mask)
            tl.store(cnt_ptr + tile, 0)
    else:
        tl.store(out_ptr + at, cast(acc, out_ptr.dtype.element_ty, INTERP), mask=tile_mask)


BLOCK_K = 64


def launch_config(T: int, Hb: int, Hd: int, sms: int, *, block_n: int | None = None, block_k: int = BLOCK_K,
                  split_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> dict:
    """Tile sizes and split count for a call (also used by the AOT compile check). The keywords replace
    one choice each, as `rms_norm_linear.launch_config`'s do."""
    block_t = min(64, pow2_at_least(T, 16))
    block_n = block_n or (32 if Hd <= 512 else 64)
    tiles = cdiv(Hd, block_n) * cdiv(T, block_t)
    nkb = cdiv(Hb, block_k)
    if split_k is None:
        split_k = min(cdiv(2 * sms, tiles), nkb, Hb // (8 * max(T, 1)))
    kb_per_split = max(1, cdiv(nkb, max(1, split_k)))
    split = max(1, cdiv(nkb, kb_per_split))  # Hb = 0: one program per tile writes zeros
    return dict(BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_K=block_k, split_k=split, kb_per_split=kb_per_split,
                num_warps=num_warps, num_stages=num_stages, **split_epilogue(split, block_n, block_t, num_warps))


def fused_concat_down_proj(token_ids, embed_table, hidden, weight, *, embed_scale, out=None):
    T, Hb = hidden.shape
    Hd = weight.shape[0]
    if out is None:
        out = torch.empty(T, Hd, dtype=hidden.dtype, device=hidden.device)
    if T == 0 or Hd == 0:
        return out
    scale = float(torch.tensor(embed_scale, dtype=embed_table.dtype).float())
    cfg = launch_config(T, Hb, Hd, num_sms(hidden.device),
                        **tuned.overrides("fused_concat_down_proj", hidden.device, T=T, N=Hd, K=weight.shape[1]))
    split = cfg["split_k"]
    grid = (cdiv(Hd, cfg["BLOCK_N"]), cdiv(T, cfg["BLOCK_T"]), split)
    part = cnt = None
    if split > 1:
        part = torch.empty(split, T, Hd, dtype=torch.float32, device=hidden.device)
        cnt = zeroed_counters(hidden.device, grid[0] * grid[1], "triton.fused_concat_down_proj")
    _down_proj_kernel[grid](
        token_ids, embed_table, hidden, weight, out, part, cnt,
        T, embed_table.shape[0], Hb, Hd, cfg["kb_per_split"], split, scale,
        embed_table.stride(0), hidden.stride(0), weight.stride(0), Hd,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], SPLIT=split > 1,
        SPLIT_LOADS=cfg["SPLIT_LOADS"], PREC=dot_precision(weight.dtype), INTERP=interpreting(hidden.device),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
        **pdl_args(hidden.device, weights=True))
    return out
