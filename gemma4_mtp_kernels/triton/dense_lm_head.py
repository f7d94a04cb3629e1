"""Triton `dense_lm_head`: the 262144 x 1024 LM head of the 26B / 31B drafters read once, in its own
dtype, with the top-k fused in (no fp32 copy of the head, no [T, V] logits, no sort over V).

Design. The cost is the head (512 MiB in bf16); T <= 64 tokens ride along.
1. `_head_kernel`, grid (P, T / BLOCK_T): program p streams a contiguous chunk of whole BLOCK_V-row
   tiles (P ~ 2 programs per SM), acc[BLOCK_V, BLOCK_T] = W_tile @ h_tile^T in fp32 through tl.dot.
   "dense" stores the fp32 tile; "topk" keeps a running top-KP list per token in registers (KP = k
   rounded up to a power of two) and publishes it: [P * KP, T] int64. Ranking is on int32 keys
   (order-preserving fp32 bits, -0.0 as +0.0, every NaN as the one above +inf, so a NaN ranks first as
   in torch's sort), packed with the id into one int64 that orders as the ranking (ties to the lower
   id), so one max reduction finds a column's best and its id. A tile enters the list by passes that
   each move every column's best remaining row into its list's worst slot while it beats it
   (`merge_topk`): as many passes as rows the tile admits, plus one, so after the first tiles mostly
   one; k = 1 is a plain max. No sort.
2. In the same launch, the last program of each token block to publish (a counter per block, left
   zero again: gemma4_mtp_kernels._counters) merges the P * KP published candidates of its tokens the
   same way, 2048 per tile (`MERGE_ELEMENTS`), and writes ids (int64) and logits (fp32) best first.
Expected on H100/H200: 31B / 26B head 537 MB -> ~128 us at 4.2 TB/s; the tl.dot tile pipeline
(3 stages of 128 x 64 bf16) should reach ~85-90% (~145-150 us) at T <= 16 (measured 2026-12-04: 133 us
at k = 1). The selection: ~1 reduction per 128-row tile at k = 1, ~4 at k = 8 (random logits: ~30
passes over a program's 8 tiles); the last program's merge of k = 8 ~45 passes over 16 tiles (it took
4096 dependent reductions before, 567 us in all). The unfused path it replaces (fp32 copy of the head,
fp32 GEMV, full sort) took ~640 us.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._counters import zeroed_counters
from ._common import (cdiv, device_helper, dot_precision, interpreting, last_to_arrive, mma, num_sms, pdl_args,
                      pow2_at_least, wait_for_inputs)

MAX_ID = tl.constexpr(2147483647)  # ids are below 2^31: the packed key's low half is id ^ MAX_ID
EMPTY_P = tl.constexpr(-9223372036854775808)  # below every packed key: the key -2^31 (below every number's
# and NaN's) with the id MAX_ID


@device_helper
def to_key(x):
    """Order-preserving int32 key of fp32 scores: -0.0 ties with +0.0, NaN ranks above +inf."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 2143289344, bits)  # 0x7FC00000, the positive quiet NaN
    return tl.where(bits < 0, bits ^ 2147483647, bits)


@device_helper
def from_key(key):
    return tl.where(key < 0, key ^ 2147483647, key).to(tl.float32, bitcast=True)


@device_helper
def pack(key, ids):
    """(key, id) as one int64 that orders as the ranking does: the key's 32 bits above, id ^ MAX_ID
    (= MAX_ID - id) below (a lower id ranks higher among equal keys), so one max reduction finds a
    column's best and its id."""
    return (key.to(tl.int64) << 32) | (ids ^ MAX_ID).to(tl.int64)


@device_helper
def merge_topk(run, cand, KP: tl.constexpr):
    """The top KP of each column of the union of run [KP, C] (an unordered list of packed keys, EMPTY_P
    pads) and cand [R, C] (packed, distinct within a column but for EMPTY_P), unordered. Each pass moves
    every column's best remaining candidate into its list's worst slot where it beats it, and stops when
    no column's can: one [R, C] max reduction per pass, as many passes as the most candidates one column
    admits, plus one. (A pass per rank, KP of them whatever entered, with a key and an id reduction each,
    made the last program's merge of k = 8 over 2048 candidates 4096 dependent reductions: 567 us on the
    H200 for a 128 us head, where k = 1 took 133.)"""
    best = tl.max(cand, axis=0)
    if KP == 1:  # one slot: the better of the two, no pass to repeat
        return tl.maximum(run, best[None, :])
    slot = tl.arange(0, KP)[:, None]
    worst = tl.min(run, axis=0)
    while tl.max((best > worst).to(tl.int32), axis=0) > 0:
        # padding slots are equal: the lowest one takes it
        at = tl.min(tl.where(run == worst[None, :], slot, KP), axis=0)
        run = tl.where((slot == at[None, :]) & (best > worst)[None, :], best[None, :], run)
        cand = tl.where(cand == best[None, :], EMPTY_P, cand)
        best = tl.max(cand, axis=0)
        worst = tl.min(run, axis=0)
    return run


@triton.jit(do_not_specialize=["T", "tiles_per_prog"])
def _head_kernel(h_ptr, w_ptr, out_ptr, list_ptr, cnt_ptr, out_id_ptr, out_val_ptr, T, V, Hd, top_k,
                 tiles_per_prog, s_h, s_w, s_out,
                 DENSE: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
                 USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    p = tl.program_id(0)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    h_rows = h_ptr + tok.to(tl.int64)[None, :] * s_h
    run = tl.full((KP, BLOCK_T), EMPTY_P, tl.int64)
    tile_lo = p * tiles_per_prog
    tile_hi = tl.minimum(tile_lo + tiles_per_prog, tl.cdiv(V, BLOCK_V))
    for tile in range(tile_lo, tile_hi):
        v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        v_mask = v < V
        w_rows = w_ptr + v.to(tl.int64)[:, None] * s_w
        acc = tl.zeros((BLOCK_V, BLOCK_T), dtype=tl.float32)
        for k0 in range(0, Hd, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < Hd
            w = tl.load(w_rows + k[None, :], mask=v_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(h_rows + k[:, None], mask=k_mask[:, None] & tok_mask[None, :], other=0.0)
            acc = mma(w, x, acc, PREC, INTERP)
        if DENSE:
            tl.store(out_ptr + tok.to(tl.int64)[None, :] * s_out + v[:, None], acc,
                     mask=v_mask[:, None] & tok_mask[None, :])
        else:
            cand = tl.where(v_mask[:, None], pack(to_key(acc), v[:, None]), EMPTY_P)
            run = merge_topk(run, cand, KP)
    if not DENSE:
        dst = (p * KP + tl.arange(0, KP))[:, None] * T + tok[None, :]
        tl.store(list_ptr + dst, run, mask=tok_mask[None, :])
        # the last program of this token block to publish merges every program's list (bar.sync orders
        # the program's stores before the release; the loads after the acquire are .cg, from L2) and
        # leaves the counter zero for the next launch
        if last_to_arrive(cnt_ptr + tl.program_id(1), tl.num_programs(0)):
            n_cand = tl.num_programs(0) * KP
            top = tl.full((KP, BLOCK_T), EMPTY_P, tl.int64)
            for c0 in range(0, n_cand, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                c_mask = (c < n_cand)[:, None] & tok_mask[None, :]
                top = merge_topk(top, tl.load(list_ptr + c[:, None] * T + tok[None, :], mask=c_mask, other=EMPTY_P,
                                              cache_modifier=".cg"), KP)
            # best first: the list's largest KP times (its padding, EMPTY_P, comes last)
            for i in tl.static_range(KP):
                best = tl.max(top, axis=0)
                top = tl.where(top == best[None, :], EMPTY_P, top)
                out_at = tok.to(tl.int64) * top_k + i
                out_mask = tok_mask & (i < top_k)
                tl.store(out_id_ptr + out_at, (best & MAX_ID) ^ MAX_ID, mask=out_mask)
                tl.store(out_val_ptr + out_at, from_key((best >> 32).to(tl.int32)), mask=out_mask)
            tl.store(cnt_ptr + tl.program_id(1), 0)


BLOCK_K = 64
# The last program's merge reads the published lists (P * KP candidates per token) in [MERGE_ELEMENTS /
# BLOCK_T, BLOCK_T] tiles: 16 int64 values a thread at 4 warps; 2048 candidates (k = 8) in 16 tiles.
MERGE_ELEMENTS = 2048


def launch_config(T: int, V: int, sms: int, KP: int = 1) -> dict:
    """~2 programs per SM along V, each a run of whole BLOCK_V-row tiles; 128-row tiles up to 16
    tokens, 64 rows and 8 warps above (the [BLOCK_V, BLOCK_T] accumulator and its packed keys stay in
    registers). Register caps from the sm_80 / sm_90 compiles: without one, ptxas fit the dense and
    small-k launches in 64-96 registers by saving predicates to the stack (8 bytes per thread); the
    wider lists (k = 16, or k > 2 over more than 16 tokens) are left uncapped."""
    block_t = min(64, pow2_at_least(T, 16))
    block_v = 128 if block_t <= 16 else 64
    tiles = cdiv(V, block_v)
    per_prog = cdiv(tiles, min(tiles, 2 * sms))
    return dict(BLOCK_V=block_v, BLOCK_T=block_t, BLOCK_K=BLOCK_K, tiles_per_prog=per_prog,
                programs=cdiv(tiles, per_prog), num_warps=4 if block_t <= 16 else 8, num_stages=3,
                maxnreg=(168 if KP <= 8 else None) if block_t <= 16 else (128 if KP <= 2 else None))


def dense_lm_head(hidden, lm_head, *, output="topk", k=1):
    T, Hd = hidden.shape
    V = lm_head.shape[0]
    dev = hidden.device
    dense = output == "dense"
    if dense:
        out = torch.empty(T, V, dtype=torch.float32, device=dev)
    else:
        out_ids = torch.empty(T, k, dtype=torch.int64, device=dev)
        out_vals = torch.empty(T, k, dtype=torch.float32, device=dev)
    if T == 0:
        return out if dense else (out_ids, out_vals)
    KP = pow2_at_least(k, 1) if not dense else 1
    cfg = launch_config(T, V, num_sms(dev), KP)
    P, TB = cfg["programs"], cdiv(T, cfg["BLOCK_T"])
    lists = counters = None
    if not dense:
        lists = torch.empty(P * KP, T, dtype=torch.int64, device=dev)
        counters = zeroed_counters(dev, TB, "triton.dense_lm_head")
    _head_kernel[(P, TB)](
        hidden, lm_head, out if dense else None, lists, counters, None if dense else out_ids,
        None if dense else out_vals, T, V, Hd, k, cfg["tiles_per_prog"], hidden.stride(0), lm_head.stride(0), V,
        DENSE=dense, KP=KP, BLOCK_V=cfg["BLOCK_V"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
        BLOCK_C=MERGE_ELEMENTS // cfg["BLOCK_T"], PREC=dot_precision(hidden.dtype),
        INTERP=interpreting(dev), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
        **pdl_args(dev))
    return out if dense else (out_ids, out_vals)
