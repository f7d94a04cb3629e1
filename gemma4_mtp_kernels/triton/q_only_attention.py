"""Triton `q_only_paged_attention` (SPEC §4.2): split-KV flash decoding over a borrowed paged cache.

Design. The op is a pure K/V stream: every attended cache entry is read once, the queries are tiny.
- Grid (B * Hkv, SPLITS, row tiles). A program owns one request b, one KV head and a contiguous key
  range of that request. Its rows are all Q queries x (Hq / Hkv) query heads that share the KV head
  (row r -> query r // G, head kvh * G + r % G), padded to BLOCK_M = 16..64 rows, so one K/V tile
  feeds every row through tl.dot and each K/V byte is read once per call. More row tiles (K/V read
  again per tile) only when Q * G > 64, or > 32 at D 512 where a [64, 512] fp32 accumulator spills
  (e.g. a 31B full layer with 8 tree branches: 64 rows, 2 tiles).
- Keys are walked in tiles of BLOCK_N tokens. Each token's address is computed from the block table
  (page = pos // block_size, slot = pos % block_size) with the cache's own strides, so any
  block_size and all four engine layouts (NHD, vLLM [nb, 2, ...], FlashAttention [2, nb, ...], HND
  views) work without copies. Only D has to be contiguous; a K/V row is D contiguous elements.
  A program reads the table entries of its range a segment (up to 64 pages) at a time, before the
  segment's tiles, and finds each key's block in registers: no load inside the tile loop feeds the
  K/V addresses, which is what lets Triton's pipeliner overlap the tiles (see the loop).
- The walk starts at the first in-window token (pos >= seq_len - window): table entries of blocks
  wholly outside the window are never loaded. Table entries are loaded only for positions the call
  attends. A block id outside [0, num_blocks), or a seq_len past the table's capacity (possible
  on the GPU, where they are not validated to avoid a sync), is never dereferenced: those keys
  score NaN, so the affected rows come out NaN.
- Online softmax in fp32 on exp2 (scores pre-multiplied by log2 e), softcap as
  softcap * tanh(s / softcap) before it; P is cast to the cache dtype for the P @ V tl.dot.
- Split-KV: SPLITS is picked on the host from the SM count and an upper bound of the attended length
  (block_table columns * block_size, capped by window), with no device sync, so it is CUDA-graph
  safe: as many splits as keep the grid within ONE wave of resident programs (programs per SM
  estimated from the tiles' shared memory), never a second, nearly empty wave (the first GPU run
  lost 1.5-2x there: 31B at B = 1 had 264 programs for 132 slots). Each program then cuts its
  request's actual attended range into SPLITS chunks of whole key tiles, at least 2 tiles each, so
  an over-wide block table (engines size it for the longest possible request) costs nothing, and
  short requests leave trailing splits empty (the merge skips their partials).
  With SPLITS > 1 each program writes its normalised partial output and its lse (fp32), and they
  are merged (out = sum_s exp(lse_s - lse) o_s); with SPLITS = 1 the main kernel writes out/lse
  directly. Small groups (a row tile's partials <= 32 KiB and <= 64 (row, split) pairs: the sliding
  layers of every drafter step, most calls at large batch) are merged by the tile's last program to
  finish (a per-tile counter, as the glue's split-K: bar.sync, one atom.acq_rel.gpu, partials read
  back with .cg, the counter reset by the merging program), which saves the dependent merge launch;
  a count just above what it takes is cut to it where each split gets at most one key tile more
  (fit_in_kernel_merge: Hugging Face's 513-key sliding window). Large groups (long full layers at
  small batch: E2B at B = 1 and 8K has 128 splits) go to a merge kernel that reads the partials as
  [32 splits, 128-column] tiles (more than 32 splits: [256, 16]), one program per (row, columns),
  each tile's lse and partials in one load wave after one for the row's largest lse: 2 dependent
  steps at 128 splits (the first version looped over the splits one by one, ~15 us of the 26 us
  measured for E2B at B = 1; the second took 12: 4 for the largest lse, then per 32 splits the lse
  and, masked by them, the partials). Every program writes its partial and lse, an empty split 0
  and -inf, so the merges read them without a mask from the lse.
- One compile serves every batch size and table width: the integer sizes (split count, table
  width, window, block size, head counts) are not specialised by Triton's JIT (do_not_specialize),
  and no tile size follows them; only the strides keep Triton's divisibility-by-16 specialisation,
  which the vectorised K/V and output accesses need.
  seq_len 0 (or an empty split) leaves l = 0: partial output 0 with lse -inf, final output 0.
- sm_90: both kernels are launched with programmatic dependent launch (`_common.pdl_args`, as every
  kernel of a drafter step): the merge kernel is scheduled while the main grid runs and waits for it
  in griddepcontrol.wait, which hides most of its launch latency (not the dependency: the in-kernel
  merge removes that too); the main kernel waits the same way for whatever kernel ran before it.
- The in-kernel merge's counters (one per (request, KV head, row tile)) are the cached ones of
  `gemma4_mtp_kernels._counters` (one buffer per stream for eager calls: calls on concurrent streams
  do not share them).
Expected on H200 (bf16): see benchmarks/README.md, "Attention, round 2".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuned
from ._common import (cast, cdiv, device_helper, dot_precision, interpreting, last_to_arrive, mma, num_sms, pdl_args,
                      pow2_at_least, wait_for_inputs)
from .._counters import zeroed_counters

LOG2E = 1.4426950408889634


# Not specialised (one compile for every batch size, table width and split count): the sizes, the table's
# row stride (a segment of its entries is one masked load) and the lse strides (one scalar store per row).
@triton.jit(do_not_specialize=["window", "num_blocks", "block_size", "max_blocks", "seg", "splits", "rows", "G",
                               "Hkv", "st_b", "sl_b", "sl_q", "sl_h", "sl_s", "fl_b", "fl_q", "fl_h"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, fin_ptr, flse_ptr, cnt_ptr,
                 scale_log2, softcap, window, num_blocks, block_size, max_blocks, seg, splits, rows, G, Hkv,
                 sq_b, sq_q, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, st_b,
                 so_b, so_q, so_h, so_s, sl_b, sl_q, sl_h, sl_s, fo_b, fo_q, fo_h, fl_b, fl_q, fl_h,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                 PAGES: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_LSE: tl.constexpr,
                 PARTIAL: tl.constexpr, MERGE: tl.constexpr, MERGE_MR: tl.constexpr, MERGE_MS: tl.constexpr,
                 MERGE_LSE: tl.constexpr,
                 PREC: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    # torch.compile's launcher passes a Python float as an fp64 scalar: the kernel's math stays fp32
    scale_log2, softcap = tl.cast(scale_log2, tl.float32), tl.cast(softcap, tl.float32)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    kvh = pid_bh % Hkv
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < rows
    qi = r // G
    head = kvh * G + r % G
    d = tl.arange(0, D)

    seq_len = tl.load(lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # this request's own range, cut into `splits` whole-tile chunks of at least MIN_CHUNK keys
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len - start, splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + qi[:, None] * sq_q + head[:, None] * sq_h + d[None, :],
                mask=r_mask[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    table_row = table_ptr + b.to(tl.int64) * st_b
    k_head = k_ptr + kvh.to(tl.int64) * sk_h
    v_head = v_ptr + kvh.to(tl.int64) * sv_h
    # The range in segments of `seg` keys (at most PAGES table entries): a segment's entries are loaded
    # before its tiles, so the K/V addresses come from registers and Triton's pipeliner overlaps tile
    # i + 1's loads with tile i's math. Looked up inside the tile loop, the entry load made the sm_90
    # SASS (Triton 3.6 and 3.8) wait for every copy in flight at the top of each tile (DEPBAR.LE SB0,
    # 0x0): no tile's K/V copies overlapped another tile's math (benchmarks/README.md, "Attention's K/V
    # tiles pipelined past the block table").
    for s0 in range(lo, hi, seg):
        s1 = tl.minimum(s0 + seg, hi)
        p0 = s0 // block_size
        pg = p0 + tl.arange(0, PAGES)
        # pages past the table (an unchecked seq_len) must not be read: they load as -1, a bad block
        tbl = tl.load(table_row + pg, mask=(pg <= (s1 - 1) // block_size) & (pg < max_blocks), other=-1)
        for n0 in range(s0, s1, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            p_mask = pos < s1
            blk = tl.gather(tbl, tl.minimum(pos // block_size - p0, PAGES - 1), 0).to(tl.int64)
            bad = p_mask & ((blk < 0) | (blk >= num_blocks))
            ld_mask = p_mask & ~bad
            slot = (pos % block_size).to(tl.int64)
            k = tl.load(k_head + blk[:, None] * sk_b + slot[:, None] * sk_s + d[None, :], mask=ld_mask[:, None],
                        other=0.0)
            v = tl.load(v_head + blk[:, None] * sv_b + slot[:, None] * sv_s + d[None, :], mask=ld_mask[:, None],
                        other=0.0)
            s = mma(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PREC, INTERP)
            if HAS_SOFTCAP:
                # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf
                y = s * (scale_log2 / (softcap * 1.4426950408889634))
                s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(2.8853900817779268 * y) + 1.0))
            else:
                s = s * scale_log2
            s = tl.where(p_mask[None, :], s, float("-inf"))
            s = tl.where(bad[None, :], float("nan"), s)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = mma(cast(p, v.dtype, INTERP), v, acc * alpha[:, None], PREC, INTERP)
            m_i = m_new

    # l = 0: nothing attended (acc is 0, so out 0, lse -inf); a NaN l (bad block id) stays NaN
    l_div = tl.where(l_i == 0, 1.0, l_i)
    o = acc / l_div[:, None]
    lse = tl.where(l_i == 0, float("-inf"), (m_i + tl.log2(l_div)) * 0.6931471805599453)
    row_off = b.to(tl.int64) * so_b + qi * so_q + head * so_h + split * so_s
    if PARTIAL:
        tl.store(out_ptr + row_off[:, None] + d[None, :], o, mask=r_mask[:, None])
    else:
        tl.store(out_ptr + row_off[:, None] + d[None, :], cast(o, out_ptr.dtype.element_ty, INTERP),
                 mask=r_mask[:, None])
    if WRITE_LSE:
        tl.store(lse_ptr + b.to(tl.int64) * sl_b + qi * sl_q + head * sl_h + split * sl_s, lse, mask=r_mask)
    if MERGE:
        _last_split_merges(out_ptr, lse_ptr, fin_ptr, flse_ptr, cnt_ptr, b, kvh, tl.program_id(2) * BLOCK_M,
                           tl.minimum(rows - tl.program_id(2) * BLOCK_M, BLOCK_M), G, splits,
                           so_b, so_q, so_h, so_s, sl_b, sl_q, sl_h, sl_s, fo_b, fo_q, fo_h, fl_b, fl_q, fl_h,
                           D, MERGE_MR, MERGE_MS, MERGE_LSE, INTERP)


@device_helper
def _last_split_merges(po_ptr, plse_ptr, out_ptr, lse_ptr, cnt_ptr, b, kvh, row0, here, G, splits,
                       so_b, so_q, so_h, so_s, sl_b, sl_q, sl_h, sl_s, fo_b, fo_q, fo_h, fl_b, fl_q, fl_h,
                       D: tl.constexpr, MR: tl.constexpr, MS: tl.constexpr, WRITE_LSE: tl.constexpr,
                       INTERP: tl.constexpr):
    """The merge of a small group (the `here` <= MR rows of one row tile x `splits` <= MS partials),
    done by the group's last program to finish instead of a second launch: split by split (unrolled),
    each split's [MR] lse and [MR, D] partial, so that every thread sums its own elements (a [MR, MS, D]
    tile reduced over its split axis took ~22 barriers of shared-memory exchanges in the sm_90 SASS) and
    every load is issued at once: no barrier orders them, and none depends on another's value. Same
    math as _merge_kernel (the largest lse first, then the weighted sum in split order)."""
    cnt = cnt_ptr + tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
    if last_to_arrive(cnt, splits):
        tl.store(cnt, 0)  # zero again for the next launch: no memset, graph replays reuse it
        r = row0 + tl.arange(0, MR)
        qi = r // G
        head = kvh * G + r % G
        mine = tl.arange(0, MR) < here
        d = tl.arange(0, D)
        lse_row = plse_ptr + b.to(tl.int64) * sl_b + qi * sl_q + head * sl_h
        part_row = po_ptr + (b.to(tl.int64) * so_b + qi * so_q + head * so_h)[:, None] + d[None, :]
        m = tl.full((MR,), float("-inf"), tl.float32)
        for j in tl.static_range(MS):
            ok = mine & (j < splits)
            m = tl.maximum(m, tl.load(lse_row + j * sl_s, mask=ok, other=float("-inf"), cache_modifier=".cg"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((MR,), dtype=tl.float32)
        acc = tl.zeros((MR, D), dtype=tl.float32)
        for j in tl.static_range(MS):
            ok = mine & (j < splits)
            lse_j = tl.load(lse_row + j * sl_s, mask=ok, other=float("-inf"), cache_modifier=".cg")
            # every split's partial is written (0 for an empty one, lse -inf: weight 0)
            part = tl.load(part_row + j * so_s, mask=ok[:, None], other=0.0, cache_modifier=".cg")
            w = tl.exp(lse_j - m_safe)
            total += w  # a NaN lse (bad block id) makes it NaN
            acc += w[:, None] * part  # and poisons its row
        total_div = tl.where(total == 0, 1.0, total)
        tl.store(out_ptr + (b.to(tl.int64) * fo_b + qi * fo_q + head * fo_h)[:, None] + d[None, :],
                 cast(acc / total_div[:, None], out_ptr.dtype.element_ty, INTERP), mask=mine[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + b.to(tl.int64) * fl_b + qi * fl_q + head * fl_h,
                     tl.where(total == 0, float("-inf"), m_safe + tl.log(total_div)), mask=mine)


@triton.jit(do_not_specialize=["splits", "Qn", "Hq", "sl_b", "sl_q", "sl_h"])
def _merge_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, splits, Qn, Hq,
                  so_b, so_q, so_h, sl_b, sl_q, sl_h,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, TILE_S: tl.constexpr, LSE_TILE: tl.constexpr,
                  WRITE_LSE: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)  # the partials are the main kernel's output
    row = tl.program_id(0)  # (b, q, h) of the contiguous partial buffers
    dblk = tl.program_id(1)  # BLOCK_D columns of it
    b = row // (Qn * Hq)
    qi = (row // Hq) % Qn
    h = row % Hq
    lse_row = plse_ptr + row.to(tl.int64) * splits
    # the row's largest lse, LSE_TILE splits a step (4 bytes each, from L2): one step up to 1024 splits
    m = float("-inf")
    for s0 in range(0, splits, LSE_TILE):
        si = s0 + tl.arange(0, LSE_TILE)
        m = tl.maximum(m, tl.max(tl.load(lse_row + si, mask=si < splits, other=float("-inf")), axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    total = 0.0
    base = po_ptr + row.to(tl.int64) * splits * D
    for s0 in range(0, splits, TILE_S):
        si = s0 + tl.arange(0, TILE_S)
        lse_i = tl.load(lse_row + si, mask=si < splits, other=float("-inf"))
        # loaded with the lse, not after them: every split's partial is written (0 for an empty one, lse
        # -inf: weight 0); a NaN weight still poisons the sum
        part = tl.load(base + si[:, None] * D + d[None, :], mask=(si < splits)[:, None], other=0.0)
        w = tl.exp(lse_i - m_safe)
        total += tl.sum(w, axis=0)  # a NaN lse (bad block id) makes it NaN
        acc += tl.sum(w[:, None] * part, axis=0)
    total_div = tl.where(total == 0, 1.0, total)
    o = acc / total_div
    tl.store(out_ptr + b.to(tl.int64) * so_b + qi * so_q + h * so_h + d, cast(o, out_ptr.dtype.element_ty, INTERP))
    if WRITE_LSE:
        tl.store(lse_ptr + b.to(tl.int64) * sl_b + qi * sl_q + h * sl_h,
                 tl.where(total == 0, float("-inf"), m_safe + tl.log(total_div)), mask=dblk == 0)


MIN_TILES_PER_SPLIT = 2
# Block-table entries a program loads at once (one segment of its key range, `segment_keys`): 64 pages of
# 16 keys hold ~1000 keys, more than a split has at the drafters' shapes; one int32 each.
TABLE_PAGES = 64


def table_pages(block_n: int) -> int:
    """Table entries per segment (PAGES): TABLE_PAGES, or a whole tile's at one key per page."""
    return max(TABLE_PAGES, block_n)


def segment_keys(block_size: int, block_n: int) -> int:
    """Keys of a segment: whole tiles of block_n whose keys, wherever they start, lie in at most
    table_pages(block_n) = P pages, i.e. at most (P - 1) * block_size + 1 keys (>= block_n)."""
    return ((table_pages(block_n) - 1) * block_size + 1) // block_n * block_n


def kernel_config(D: int, rows: int, elem_bytes: int = 2, *, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, min_tiles: int | None = None) -> dict:
    """Tiles and warps for one head dim and element size (also used by the AOT compile check). Chosen
    from the sm_80 / sm_90 compiles: the largest row tile whose fp32 accumulator [BLOCK_M, D] fits
    without spills (D 512 caps BLOCK_M at 32: 64 rows spill even with 16 warps). fp32 caches (tests)
    take 16-key tiles and fewer stages: with the bf16 tiles a D 512 fp32 launch needs ~200 KB of
    shared memory, more than an A100 block may have, and fails to launch. The keywords replace one
    choice each (`benchmarks/tune_launch_configs.py` times them); min_tiles is the key tiles a split has at
    least (MIN_TILES, MIN_TILES_PER_SPLIT by default: num_splits)."""
    block_m = min(32 if D == 512 else 64, pow2_at_least(rows, 16))
    warps = 4 if block_m * D <= 16 * 256 else 8
    if elem_bytes == 4:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=16, num_warps=8 if D == 512 else warps,
                   num_stages=1 if block_m * D >= 64 * 128 else 2)
    elif D <= 128:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=warps, num_stages=3)
    elif D == 256:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=warps, num_stages=3)
    else:
        cfg = dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=8, num_stages=3 if block_m == 16 else 2)
    chosen = dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg.update({k: v for k, v in chosen.items() if v is not None})
    # Without a cap ptxas held some pipelined launches (one split, 64 rows) to 128 registers and kept 6-8
    # values on the stack across the key loop; 255 still fits the programs an SM holds (programs_per_sm).
    cfg["maxnreg"] = 255
    cfg["MIN_TILES"] = min_tiles or MIN_TILES_PER_SPLIT
    return cfg


# The merge kernel's [TILE_S splits, BLOCK_D columns] fp32 tiles (4096 values, 32 a thread): one step
# per TILE_S splits, each loading the tile's lse and partials together (one dependent L2 round trip),
# after one step for the row's largest lse (MERGE_LSE_TILE at a time). Two shapes, not one per split
# count (tile sizes that followed the split count, which follows the batch size and the table width,
# made a compile per power of two of it): up to 32 splits, 128 columns a program; more (the long full
# layers of small batches: E2B at B = 1 has 128-132, 31B 33, one wave of the main kernel), 256 splits
# of 16 columns (64 bytes of each partial row), eight times the programs for one step where 32-split
# tiles took 2-5 (2 round trips in all where they took 3-6).
MERGE_BLOCK_D, MERGE_TILE_S = 128, 32
MERGE_MANY_BLOCK_D, MERGE_MANY_TILE_S = 16, 256
MERGE_LSE_TILE = 1024


# The merge of a row tile's splits goes into the attention kernel (the tile's last program to finish
# merges, no second launch: ~1.5-2.5 µs less per call on an H200, a dependent launch) when its partials
# are small: at most 32 KiB and 64 (row, split) pairs, read back from L2 in one wave of loads, split by
# split (~0.2-0.3 µs; rows and splits padded to powers of two, so its registers stay bounded).
# Larger groups (E2B's full layer at B = 1: 128 splits x 4 rows of 2 KiB) keep the merge kernel, which
# spreads them over programs.
MERGE_IN_KERNEL_BYTES = 32 * 1024
MERGE_IN_KERNEL_PAIRS = 64
IN_KERNEL_MERGE = True  # benchmarks/bench_drafter_step.py turns it off to price the merge launch it saves


def merge_tile(tile_rows: int, D: int) -> tuple[int, int]:
    """(rows, splits) of the in-kernel merge's tile for row tiles of `tile_rows` rows: the rows padded to
    a power of two, the splits what the bytes and pairs leave (0: none fits)."""
    mr = pow2_at_least(tile_rows, 1)
    return mr, min(MERGE_IN_KERNEL_PAIRS, MERGE_IN_KERNEL_BYTES // (4 * D)) // mr


def merges_in_kernel(tile_rows: int, splits: int, D: int) -> bool:
    """Whether the attention kernel merges the `splits` partials of its row tiles itself (tile_rows:
    rows of the fullest tile)."""
    return IN_KERNEL_MERGE and 1 < splits <= merge_tile(tile_rows, D)[1]


COUNTER_OWNER = "triton.q_only_attention"  # its cached counters in gemma4_mtp_kernels._counters


def merge_config(D: int, splits: int) -> dict:
    """Merge tiles: [TILE_S, BLOCK_D] fp32 tiles of the partials (see MERGE_TILE_S)."""
    block_d, tile_s = (MERGE_BLOCK_D, MERGE_TILE_S) if splits <= MERGE_TILE_S else (MERGE_MANY_BLOCK_D,
                                                                                    MERGE_MANY_TILE_S)
    return dict(BLOCK_D=min(D, block_d), TILE_S=tile_s, LSE_TILE=MERGE_LSE_TILE)


def programs_per_sm(cfg: dict) -> int:
    """Resident attention programs per SM. Registers bound it: the fp32 accumulator tiles take 130-240
    registers per thread in the sm_80 / sm_90 compiles (benchmarks/triton_resources.md), so an SM's 64K
    registers hold 8 warps of these programs; shared memory (three stages of K and V tiles: 74 KiB at
    D 256 with 4 warps, 146 KiB at D 512) holds as many on an A100 (164 KiB) as on an H100 (227)."""
    return max(1, 8 // cfg["num_warps"])


def num_splits(B: int, Hkv: int, row_tiles: int, max_len: int, block_n: int, sms: int, per_sm: int = 1,
               min_tiles: int = MIN_TILES_PER_SPLIT) -> int:
    """Key-range splits per (request, KV head) for an attended length of at most max_len: as many as
    keep the grid within one wave of sms * per_sm programs, each at least min_tiles tiles.
    Each program then cuts its own request's actual range into that many chunks on the device."""
    tiles = max(1, cdiv(max_len, block_n))
    programs = B * Hkv * row_tiles
    return max(1, min((sms * per_sm) // programs, cdiv(tiles, min_tiles)))


def fit_in_kernel_merge(splits: int, max_len: int, block_n: int, tile_rows: int, D: int) -> int:
    """`splits` (num_splits' count), or fewer where the in-kernel merge takes fewer at one key tile more a
    split: a count just above its capacity (Hugging Face's sliding window of 513 keys: 9 splits of two
    32-key tiles, the last holding one key) would pay the merge kernel's dependent launch for one key.
    The fewer splits are as many as the longer chunks need (6 of 3 tiles for 513 keys; plan.h
    attention_plan makes the same choice for the CUDA backend)."""
    cap = merge_tile(tile_rows, D)[1]
    if not IN_KERNEL_MERGE or splits <= cap or cap < 2:
        return splits
    tiles = cdiv(max_len, block_n)
    per_split = cdiv(tiles, cap)
    return cdiv(tiles, per_split) if per_split <= cdiv(tiles, splits) + 1 else splits


def q_only_paged_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=1.0, window=None, softcap=None,
                           out=None, return_lse=False, splits=None):
    """`splits` (tests only) forces the key-range split count instead of the SM-count heuristic."""
    B, Qn, Hq, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    rows = Qn * G
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous whatever q's strides
    lse = torch.empty(B, Qn, Hq, dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0 or Qn == 0:
        return (out, lse) if return_lse else out
    max_len = block_table.shape[1] * block_size
    if window is not None:
        max_len = min(max_len, window)
    cfg = kernel_config(D, rows, q.element_size(), **tuned.overrides(
        "q_only_paged_attention", q.device, B=B, Q=Qn, Hq=Hq, Hkv=Hkv, D=D, keys=max_len, bytes=q.element_size()))
    row_tiles = cdiv(rows, cfg["BLOCK_M"])
    if splits is None:
        splits = num_splits(B, Hkv, row_tiles, max_len, cfg["BLOCK_N"], num_sms(q.device), programs_per_sm(cfg),
                            cfg["MIN_TILES"])
        splits = fit_in_kernel_merge(splits, max_len, cfg["BLOCK_N"], min(rows, cfg["BLOCK_M"]), D)
    interp = interpreting(q.device)
    common = dict(D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  MIN_CHUNK=cfg["MIN_TILES"] * cfg["BLOCK_N"], PAGES=table_pages(cfg["BLOCK_N"]),
                  HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, PREC=dot_precision(q.dtype),
                  INTERP=interp,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"],
                  **pdl_args(q.device))
    args = (q, k_cache, v_cache, block_table, seq_lens)
    scalars = (scale * LOG2E, 1.0 if softcap is None else softcap, 0 if window is None else window, num_blocks,
               block_size, block_table.shape[1], segment_keys(block_size, cfg["BLOCK_N"]), splits, rows, G, Hkv,
               *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0))
    grid = (B * Hkv, splits, row_tiles)
    lse_strides = lse.stride() if return_lse else (0, 0, 0)
    if splits == 1:  # out / lse written by the main kernel; no merge (its pointers unused)
        _attn_kernel[grid](*args, out, lse, out, lse, out, *scalars, *out.stride()[:3], 0, *lse_strides, 0,
                           0, 0, 0, 0, 0, 0, WRITE_LSE=return_lse, PARTIAL=False, MERGE=False, MERGE_MR=1,
                           MERGE_MS=1, MERGE_LSE=False, **common)
        return (out, lse) if return_lse else out
    po = torch.empty(B, Qn, Hq, splits, D, dtype=torch.float32, device=q.device)
    plse = torch.empty(B, Qn, Hq, splits, dtype=torch.float32, device=q.device)
    tile_rows = min(rows, cfg["BLOCK_M"])
    fused = merges_in_kernel(tile_rows, splits, D)
    mr, ms = merge_tile(tile_rows, D) if fused else (1, 1)
    cnt = zeroed_counters(q.device, grid[0] * grid[2], COUNTER_OWNER) if fused else po
    _attn_kernel[grid](*args, po, plse, out, plse if lse is None else lse, cnt, *scalars, *po.stride()[:4],
                       *plse.stride(), *out.stride()[:3], *lse_strides, WRITE_LSE=True, PARTIAL=True, MERGE=fused,
                       MERGE_MR=mr, MERGE_MS=ms, MERGE_LSE=return_lse, **common)
    if not fused:
        mc = merge_config(D, splits)
        _merge_kernel[(B * Qn * Hq, D // mc["BLOCK_D"])](
            po, plse, out, lse, splits, Qn, Hq, *out.stride()[:3], *lse_strides, D=D, **mc,
            WRITE_LSE=return_lse, INTERP=interp, num_warps=4, num_stages=1, **pdl_args(q.device))
    return (out, lse) if return_lse else out
