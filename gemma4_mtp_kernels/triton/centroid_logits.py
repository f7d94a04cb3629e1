"""Triton `centroid_logits` (SPEC §4.3): the E2B/E4B two-stage LM head in one launch.

Design. The dense head would read 262144 x 256 bf16 (128 MiB); this one reads the centroids
(2048 x 256, 1 MiB) and the 32 x 128 = 4096 candidate rows per token (2 MiB), so at T = 1 it is bound
by launches and dependent memory latencies, not bytes (0.75 us at 4.2 TB/s). One kernel, `grid`
programs (at most one per SM, a cooperative launch so that all are resident), three phases:
1. Scores: program p scores centroid blocks p, p + grid, ... (BLOCK_C = 16 centroids x all tokens,
   tl.dot, fp32) into a [T, C] fp32 workspace, after issuing L2 prefetches of its share of
   token_ordering (1-2 MiB) so that phase 2's id lookups hit L2.
   -- grid-wide barrier: a counter whose top bit flips when every program has arrived --
2. Candidates: token t's K candidate rows are cut into `chunks` items per cluster (finer only while
   T * top_k items would leave programs idle: 4 chunks of 32 rows at T = 1). Program p owns a
   contiguous range of items; whenever its range enters a new token it selects that token's top_k
   clusters itself, in rank order: the score row (8 KiB, from L2) becomes distinct int64 keys
   (order-preserving fp32 bits, then C - 1 - c so that equal scores rank the lower cluster first);
   the top K2 = next_pow2(top_k) keys lie in the K2 rows of 8 keys with the largest row maxima, so
   one tl.topk over the 256 row maxima and one over the 256 keys of those rows give them (two
   bitonic top-k networks over 256 elements instead of a 6-step radix select over 2048, whose
   tl.histogram steps made the previous kernel cost ~30 us). It then gathers the item's rows of
   lm_head through token_ordering and dots them with hidden[t] in fp32: "sparse" writes ids and
   logits at [t, j * V/C + r] (cluster order, then token_ordering order), "dense" scatters into the
   row pre-filled with fill_value, "argmax" keeps a running (logit, lowest id) per token and stores
   one partial per (token, program), "topk" keeps the token's best OUT_K2 = next_pow2(k) keys (the
   logit's order bits, then the inverted id: descending keys are the reference's order), merging each
   item's tl.topk into them, and stores them as its partial; nothing of size K reaches memory.
3. The last program to finish (a second counter) reduces the argmax (topk: tl.topk of the owners' keys)
   partials of every token and resets both counters (no per-call memset: gemma4_mtp_kernels._counters).
Cluster-major phase 2 (argmax and topk once T * top_k exceeds the SMs: `plan`). Token-major, each program
walks ~T * top_k / G items one after another, each an id lookup then a row gather dotted with one token,
and the last program merges the T tokens one after another: at T = 64 that was 143 us for 33 us of bytes
(2026-12-04), slower than the dense head. Instead, after phase 1 (which also clears a per-cluster flag):
2a. tokens over programs: each token's threshold, the key of its top_k-th cluster (its clusters are those
   whose key is at least that), and a flag on each cluster it selected. -- barrier --
2b. the flagged clusters, compacted, in equal shares: each cluster's rows are gathered once (64 rows x 256
   a tile, the next tile's rows and the one after's ids in flight meanwhile) and dotted with up to 64
   tokens at once on the tensor cores; a tile counts for the tokens whose key for it passes their
   threshold. Each program stores a partial of every token. -- barrier --
2c. tokens over programs: each token's argmax / top-k from the G partials; the last program clears the
   counters.
Tokens sharing a cluster share its gather (at T = 64 with random weights ~1300 distinct clusters of 2048),
and no step is serial over tokens. The logits come from tl.dot, not the elementwise sums of token-major
order: the same values up to fp32 summation order.
An out-of-range id in token_ordering (not validated on the GPU) is never dereferenced: its logit is
NaN and its sparse id -1, it is skipped by the dense scatter, and it makes its token's argmax and
every top-k answer (-1, NaN), as in the CUDA backend.
Under the interpreter programs run one after another, so a spinning barrier cannot work there: the
same kernel is launched once per stage (phase 1, then phases 2-3; cluster-major: 1, 2a, 2b, 2c), the
barriers compiled out. Only the GPU runs the one-launch form.
Expected on H200 (E2B, T = 1): launch ~1.3 us + centroid read ~0.8 us + barrier ~0.5 us + selection
~1 us + candidate gather ~1 us (L2 id lookups, one DRAM round trip for the rows) + election ~0.5 us
≈ 5 us, against 45 us for the dense head + argmax. T = 64, cluster-major: ~81 MiB of distinct
clusters' rows, ~20 tiles of 32 KiB per program at ~1 us each, plus ~14 us of launch, scores, three
barriers, selection and merge: ~30-45 us (benchmarks/README.md, "The centroid head at large T").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import centroid_order
from .._counters import zeroed_counters
from ._common import cdiv, dot_precision, interpreting, last_to_arrive, mma, num_sms, pow2_at_least

NO_ID = tl.constexpr(2147483647)
BAD_ID = tl.constexpr(-1)
ROW = 8  # keys per row of the first selection level
LINE = 128  # bytes per L2 prefetch
COUNTERS = 2  # barrier, done


@triton.jit
def _grid_barrier(cnt_ptr):
    """Program 0 adds 2^31 - (grid - 1), the others 1: the counter's top bit flips exactly when every
    program has arrived, whatever its value (cooperative groups' grid sync). bar.sync orders the
    program's stores before the release; the loads after it are .cg (L2)."""
    tl.debug_barrier()
    ptr = cnt_ptr.to(tl.pointer_type(tl.uint32))
    grid = tl.num_programs(0).to(tl.uint32)
    one = tl.full((), 1, tl.uint32)
    add = tl.where(tl.program_id(0) == 0, tl.full((), 0x80000000, tl.uint32) - (grid - one), one)
    old = tl.atomic_add(ptr, add, sem="release", scope="gpu")
    now = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    flip = tl.full((), 0x80000000, tl.uint32)
    while ((old ^ now) & flip) == 0:
        now = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _order_bits(x):
    """fp32 values as int64s in [0, 2^32) in the same order: -0.0 ties with +0.0 and every NaN (of either
    sign bit) ranks above +inf, as torch sorts."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    bits = tl.where(x != x, 0x7FFFFFFF, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648


@triton.jit
def _keys(score_row, c, C, IDX_BITS: tl.constexpr):
    """Distinct int64 keys of clusters c (padding -1): order bits of the score, then C - 1 - c."""
    ok = (c >= 0) & (c < C)
    score = tl.load(score_row + c, mask=ok, other=0.0, cache_modifier=".cg")
    return tl.where(ok, (_order_bits(score) << IDX_BITS) | (C - 1 - c).to(tl.int64), -1)


@triton.jit
def _top_clusters(score_row, C, BLOCK_CC: tl.constexpr, K2: tl.constexpr, ROW: tl.constexpr,
                  IDX_BITS: tl.constexpr, TWO_LEVEL: tl.constexpr):
    """The K2 largest keys of one token, descending. Keys are distinct, so the top K2 lie in the K2
    rows (of ROW consecutive clusters) with the largest row maxima."""
    keys = _keys(score_row, tl.arange(0, BLOCK_CC), C, IDX_BITS)
    if TWO_LEVEL:
        rowmax = tl.max(tl.reshape(keys, [BLOCK_CC // ROW, ROW]), axis=1)
        rows = tl.topk(rowmax, K2)
        first = (C - 1 - (rows & ((1 << IDX_BITS) - 1))) // ROW * ROW  # padding rows: negative, masked
        cand = _keys(score_row, first[:, None] + tl.arange(0, ROW)[None, :], C, IDX_BITS)
        top = tl.topk(tl.reshape(cand, [K2 * ROW]), K2)
    else:
        top = tl.topk(keys, K2)
    return top


@triton.jit
def _logit_key(logit, ids):
    """Distinct int64 keys of (logit, id) whose descending order is the reference's (higher logit, then
    lower id; NaN above every number): 32 order bits of the logit, then 2^31 - 1 - id."""
    return (_order_bits(logit) << 31) | (2147483647 - ids)


@triton.jit
def _key_logit(key):
    """The logit and id of a _logit_key."""
    x = ((key >> 31) - 2147483648).to(tl.int32)
    bits = tl.where(x < 0, x ^ 0x7FFFFFFF, x)
    return bits.to(tl.float32, bitcast=True), 2147483647 - (key & 2147483647)


@triton.jit
def _flush(part_val_ptr, part_id_ptr, part_key_ptr, t, pid, G, best, best_id, run, bad, OUT_K2: tl.constexpr,
           OUTPUT: tl.constexpr):
    """Program pid's partial of token t: its argmax, or its best OUT_K2 keys and whether it met a bad id."""
    if OUTPUT == "argmax":
        tl.store(part_val_ptr + t * G + pid, tl.where(bad, float("nan"), best))
        tl.store(part_id_ptr + t * G + pid, tl.where(bad, BAD_ID, best_id))
    elif OUTPUT == "topk":
        tl.store(part_key_ptr + (t * G + pid) * OUT_K2 + tl.arange(0, OUT_K2), run)
        tl.store(part_id_ptr + t * G + pid, tl.where(bad, BAD_ID, 0))


@triton.jit
def _merge_argmax(part_val_ptr, part_id_ptr, ids_ptr, logit_ptr, t, G, prog, owns):
    """Token t's argmax from the partials of the programs `prog` that own its items."""
    v = tl.load(part_val_ptr + t * G + prog, mask=owns, other=float("-inf"), cache_modifier=".cg")
    vid = tl.load(part_id_ptr + t * G + prog, mask=owns, other=NO_ID, cache_modifier=".cg")
    any_bad = tl.sum((owns & (vid == BAD_ID)).to(tl.int32), axis=0) > 0
    m = tl.max(v, axis=0)
    tok = tl.min(tl.where(owns & (v == m), vid, NO_ID), axis=0)
    none = any_bad | (tok == NO_ID)
    tl.store(ids_ptr + t, tl.where(none, -1, tok).to(tl.int64))
    tl.store(logit_ptr + t, tl.where(none, float("nan"), m))


@triton.jit
def _merge_topk(part_id_ptr, part_key_ptr, ids_ptr, logit_ptr, t, G, prog, owns, k_out, BLOCK_G: tl.constexpr,
                OUT_K2: tl.constexpr):
    """Token t's k_out best keys from the partials of the programs `prog` that own its items; a bad id
    met by any of them makes every answer (-1, NaN), as argmax does."""
    j = tl.arange(0, OUT_K2)
    keys = tl.load(part_key_ptr + (t * G + prog)[:, None] * OUT_K2 + j[None, :], mask=owns[:, None], other=-1,
                   cache_modifier=".cg")
    flags = tl.load(part_id_ptr + t * G + prog, mask=owns, other=0, cache_modifier=".cg")
    any_bad = tl.sum((flags == BAD_ID).to(tl.int32), axis=0) > 0
    top = tl.topk(tl.reshape(keys, [BLOCK_G * OUT_K2]), OUT_K2)
    logit, tok = _key_logit(top)
    tl.store(ids_ptr + t * k_out + j, tl.where(any_bad, -1, tok), mask=j < k_out)
    tl.store(logit_ptr + t * k_out + j, tl.where(any_bad, float("nan"), logit), mask=j < k_out)


@triton.jit
def _select_clusters(score_ptr, thr_ptr, flag_ptr, T, C, top_k, pid, G, BLOCK_CC: tl.constexpr, K2: tl.constexpr,
                     ROW: tl.constexpr, IDX_BITS: tl.constexpr, TWO_LEVEL: tl.constexpr):
    """Cluster-major phase 2a, tokens over programs: each token's threshold (the key of its top_k-th
    cluster: its clusters are those whose key is at least that) and a flag on every cluster some token
    selected (every writer stores 1: the races are benign)."""
    kk = tl.arange(0, K2)
    for t in range(pid, T, G):
        top = _top_clusters(score_ptr + (tl.zeros((), tl.int64) + t) * C, C, BLOCK_CC, K2, ROW, IDX_BITS, TWO_LEVEL)
        tl.store(thr_ptr + t, tl.sum(tl.where(kk == top_k - 1, top, 0), axis=0))
        tl.store(flag_ptr + (C - 1 - (top & ((1 << IDX_BITS) - 1))), tl.full((K2,), 1, tl.int32), mask=kk < top_k)


@triton.jit
def _tile_ids(order_ptr, mine, it, n_it, tiles, CS, V, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Row tile `it` of a program's cluster share: its cluster (from the share held in registers), the
    token ids of its rows and which are real rows and valid ids (none past the share's last tile)."""
    cluster = tl.sum(tl.where(tl.arange(0, BLOCK_Q) == it // tiles, mine, 0), axis=0)
    rr = (it % tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = (rr < CS) & (it < n_it)
    ids = tl.load(order_ptr + cluster.to(tl.int64) * CS + rr, mask=r_mask, other=0).to(tl.int64)
    return cluster, ids, r_mask, r_mask & (ids >= 0) & (ids < V)


@triton.jit
def _cluster_major(h_ptr, order_ptr, lm_ptr, score_ptr, thr_ptr, flag_ptr, list_ptr, part_val_ptr, part_id_ptr,
                   part_key_ptr, T, C, V, Hd, CS, pid, G, s_h, s_lm, BLOCK_T: tl.constexpr, BLOCK_CC: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, WHOLE_ROW: tl.constexpr,
                   IDX_BITS: tl.constexpr, OUT_K2: tl.constexpr, OUTPUT: tl.constexpr, PREC: tl.constexpr,
                   INTERP: tl.constexpr):
    """Cluster-major phase 2b (argmax, topk). The n selected clusters (flags), compacted in cluster order,
    are dealt out in equal contiguous shares, program p the ranks [p n / G, (p + 1) n / G) (at most
    BLOCK_Q), which it writes to list[rank] and reads back into registers (its own stores: a CTA barrier
    orders them). Each cluster's rows are gathered once, BLOCK_R rows a tile, and dotted with a block of
    tokens at once ([BLOCK_R, BLOCK_T] on the tensor cores); a tile's logits count only for the tokens
    that selected its cluster (key >= threshold). The gathers are software-pipelined by hand: while a tile
    is computed, the next tile's rows and the one after's ids are in flight (Triton's pipeliner, given the
    ids -> rows chain, issued each tile's rows after the previous tile's math and waited for them at once:
    no overlap in the sm_90 SASS). The program then stores its partial of every token, as the
    token-major flush does."""
    cc = tl.arange(0, BLOCK_CC)
    flags = tl.load(flag_ptr + cc, mask=cc < C, other=0, cache_modifier=".cg")
    rank = tl.cumsum(flags, axis=0) - 1  # of a selected cluster
    n = tl.sum(flags, axis=0)
    lo = pid * n // G
    hi = (pid + 1) * n // G
    tl.store(list_ptr + rank, cc, mask=(flags > 0) & (rank >= lo) & (rank < hi))
    tl.debug_barrier()
    qq = tl.arange(0, BLOCK_Q)
    mine = tl.load(list_ptr + lo + qq, mask=qq < hi - lo, other=0, cache_modifier=".cg")
    tiles = tl.cdiv(CS, BLOCK_R)
    n_it = (hi - lo) * tiles
    j = tl.arange(0, OUT_K2)
    d = tl.arange(0, BLOCK_D)
    for t0 in range(0, T, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        thr = tl.load(thr_ptr + ts, mask=t_ok, other=0x7FFFFFFFFFFFFFFF, cache_modifier=".cg")
        score_rows = score_ptr + tl.minimum(ts, T - 1).to(tl.int64) * C  # padding tokens: a real row, thr max
        h_rows = h_ptr + ts.to(tl.int64)[None, :] * s_h
        h = tl.load(h_rows + d[:, None], mask=t_ok[None, :] & (d[:, None] < Hd) & WHOLE_ROW, other=0.0)
        best = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        best_id = tl.full((BLOCK_T,), NO_ID, tl.int32)
        run = tl.full((BLOCK_T, OUT_K2), -1, tl.int64)  # topk: each token's best keys, descending
        bad = tl.zeros((BLOCK_T,), tl.int1)
        # tile 0's ids, rows and members; tile 1's ids
        cl_a, ids_a, rm_a, ok_a = _tile_ids(order_ptr, mine, 0, n_it, tiles, CS, V, BLOCK_R, BLOCK_Q)
        mem_a = _keys(score_rows, cl_a, C, IDX_BITS) >= thr  # [BLOCK_T]: the tokens that selected it
        w_a = tl.load(lm_ptr + ids_a[:, None] * s_lm + d[None, :], mask=ok_a[:, None] & (d[None, :] < Hd) & WHOLE_ROW,
                      other=0.0)
        cl_b, ids_b, rm_b, ok_b = _tile_ids(order_ptr, mine, 1, n_it, tiles, CS, V, BLOCK_R, BLOCK_Q)
        for it in range(0, n_it):
            # in flight during this tile's math: the next tile's rows and members, the one after's ids
            w_b = tl.load(lm_ptr + ids_b[:, None] * s_lm + d[None, :],
                          mask=ok_b[:, None] & (d[None, :] < Hd) & WHOLE_ROW, other=0.0)
            mem_b = _keys(score_rows, cl_b, C, IDX_BITS) >= thr
            cl_c, ids_c, rm_c, ok_c = _tile_ids(order_ptr, mine, it + 2, n_it, tiles, CS, V, BLOCK_R, BLOCK_Q)
            if WHOLE_ROW:
                acc = mma(w_a, h, tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32), PREC, INTERP)
            else:
                acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
                for d0 in range(0, Hd, BLOCK_D):
                    dd = d0 + d
                    w = tl.load(lm_ptr + ids_a[:, None] * s_lm + dd[None, :], mask=ok_a[:, None] & (dd[None, :] < Hd),
                                other=0.0)
                    hh = tl.load(h_rows + dd[:, None], mask=t_ok[None, :] & (dd[:, None] < Hd), other=0.0)
                    acc = mma(w, hh, acc, PREC, INTERP)
            bad = bad | (mem_a & (tl.sum((rm_a & ~ok_a).to(tl.int32), axis=0) > 0))
            if OUTPUT == "topk":
                keys = tl.where(ok_a[:, None] & mem_a[None, :], _logit_key(acc, ids_a[:, None]), -1)
                mine_k = tl.topk(tl.trans(keys), OUT_K2)  # [BLOCK_T, OUT_K2]
                run = tl.topk(tl.reshape(tl.join(run, mine_k), [BLOCK_T, 2 * OUT_K2]), OUT_K2)
            else:
                live = rm_a[:, None] & mem_a[None, :]
                logit = tl.where(live, acc, float("-inf"))
                m = tl.max(logit, axis=0)
                m_id = tl.min(tl.where(live & (logit == m[None, :]), ids_a.to(tl.int32)[:, None], NO_ID), axis=0)
                better = (m > best) | ((m == best) & (m_id < best_id))
                best_id = tl.where(better, m_id, best_id)
                best = tl.maximum(best, m)
            ids_a, rm_a, ok_a, mem_a, w_a = ids_b, rm_b, ok_b, mem_b, w_b
            cl_b, ids_b, rm_b, ok_b = cl_c, ids_c, rm_c, ok_c
        part = ts.to(tl.int64) * G + pid
        if OUTPUT == "topk":
            tl.store(part_key_ptr + part[:, None] * OUT_K2 + j[None, :], run, mask=t_ok[:, None])
            tl.store(part_id_ptr + part, tl.where(bad, BAD_ID, 0), mask=t_ok)
        else:
            tl.store(part_val_ptr + part, tl.where(bad, float("nan"), best), mask=t_ok)
            tl.store(part_id_ptr + part, tl.where(bad, BAD_ID, best_id), mask=t_ok)


@triton.jit(do_not_specialize=["T", "k_out"])
def _head(h_ptr, c_ptr, order_ptr, lm_ptr, score_ptr, part_val_ptr, part_id_ptr, part_key_ptr, thr_ptr, flag_ptr,
          list_ptr, cnt_ptr, ids_ptr, logit_ptr, dense_ptr, T, C, V, Hd, CS, top_k, chunks, rows, items, order_lines,
          k_out, s_h, s_c, s_lm, s_dense,
          BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_CC: tl.constexpr, K2: tl.constexpr, ROW: tl.constexpr, IDX_BITS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
          BLOCK_G: tl.constexpr, LINE_ELEMS: tl.constexpr, OUT_K2: tl.constexpr, OUTPUT: tl.constexpr,
          BLOCK_Q: tl.constexpr, CLUSTER_MAJOR: tl.constexpr, WHOLE_ROW: tl.constexpr, SCORES: tl.constexpr,
          SELECT: tl.constexpr, CANDIDATES: tl.constexpr, MERGE: tl.constexpr, BARRIER: tl.constexpr,
          PREC: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if SCORES:
        if not INTERP:
            for line in range(pid * BLOCK_P, order_lines, G * BLOCK_P):
                lines = line + tl.arange(0, BLOCK_P)
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                          [order_ptr + lines.to(tl.int64) * LINE_ELEMS], dtype=tl.int32,
                                          is_pure=False, pack=1)
        for cb in range(pid, tl.cdiv(C, BLOCK_C), G):
            cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
            for t0 in range(0, T, BLOCK_T):
                ts = t0 + tl.arange(0, BLOCK_T)
                acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
                for k0 in range(0, Hd, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    cen = tl.load(c_ptr + cs.to(tl.int64)[:, None] * s_c + k[None, :],
                                  mask=(cs[:, None] < C) & (k[None, :] < Hd), other=0.0)
                    hid = tl.load(h_ptr + ts.to(tl.int64)[None, :] * s_h + k[:, None],
                                  mask=(ts[None, :] < T) & (k[:, None] < Hd), other=0.0)
                    acc = mma(cen, hid, acc, PREC, INTERP)
                tl.store(score_ptr + ts.to(tl.int64)[None, :] * C + cs[:, None], acc,
                         mask=(cs[:, None] < C) & (ts[None, :] < T))
        if CLUSTER_MAJOR:  # the selection flags start clear
            for c0 in range(pid * BLOCK_P, C, G * BLOCK_P):
                cz = c0 + tl.arange(0, BLOCK_P)
                tl.store(flag_ptr + cz, tl.zeros((BLOCK_P,), tl.int32), mask=cz < C)
    if BARRIER:
        _grid_barrier(cnt_ptr)
    if SELECT:
        _select_clusters(score_ptr, thr_ptr, flag_ptr, T, C, top_k, pid, G, BLOCK_CC, K2, ROW, IDX_BITS, TWO_LEVEL)
        if BARRIER:
            _grid_barrier(cnt_ptr)
    if CANDIDATES and CLUSTER_MAJOR:
        _cluster_major(h_ptr, order_ptr, lm_ptr, score_ptr, thr_ptr, flag_ptr, list_ptr, part_val_ptr, part_id_ptr,
                       part_key_ptr, T, C, V, Hd, CS, pid, G, s_h, s_lm, BLOCK_T, BLOCK_CC, BLOCK_R, BLOCK_D, BLOCK_Q,
                       WHOLE_ROW, IDX_BITS, OUT_K2, OUTPUT, PREC, INTERP)
        if BARRIER:
            _grid_barrier(cnt_ptr)
    if MERGE:  # cluster-major phase 2c: every program holds a partial of every token; tokens over programs
        g = tl.arange(0, BLOCK_G)
        for t in range(pid, T, G):
            if OUTPUT == "topk":
                _merge_topk(part_id_ptr, part_key_ptr, ids_ptr, logit_ptr, t, G, g, g < G, k_out, BLOCK_G, OUT_K2)
            else:
                _merge_argmax(part_val_ptr, part_id_ptr, ids_ptr, logit_ptr, t, G, g, g < G)
        if last_to_arrive(cnt_ptr + 1, G):  # every other program is past every barrier
            tl.store(cnt_ptr, 0)
            tl.store(cnt_ptr + 1, 0)
    if CANDIDATES and not CLUSTER_MAJOR:
        per_token = top_k * chunks
        i1 = (pid + 1).to(tl.int64) * items // G
        current = tl.full((), -1, tl.int64)
        top = tl.zeros((K2,), dtype=tl.int64)
        best = float("-inf")
        best_id = NO_ID
        run = tl.full((OUT_K2,), -1, tl.int64)  # topk: the program's best keys of the current token, descending
        bad = False
        kk = tl.arange(0, K2)
        for i in range(pid.to(tl.int64) * items // G, i1):
            t = i // per_token
            j = (i % per_token) // chunks
            q = i % chunks
            if t != current:
                if current >= 0:
                    _flush(part_val_ptr, part_id_ptr, part_key_ptr, current, pid, G, best, best_id, run, bad, OUT_K2,
                           OUTPUT)
                top = _top_clusters(score_ptr + t * C, C, BLOCK_CC, K2, ROW, IDX_BITS, TWO_LEVEL)
                best = float("-inf")
                best_id = NO_ID
                run = tl.full((OUT_K2,), -1, tl.int64)
                bad = False
                current = t
            key = tl.sum(tl.where(kk == j, top, 0), axis=0)
            cluster = C - 1 - (key & ((1 << IDX_BITS) - 1))
            rr = tl.arange(0, BLOCK_R)
            r = q * rows + rr
            r_mask = (rr < rows) & (r < CS)
            ids = tl.load(order_ptr + cluster * CS + r, mask=r_mask, other=0).to(tl.int64)
            id_ok = r_mask & (ids >= 0) & (ids < V)
            h_row = h_ptr + t * s_h
            logit = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for d0 in range(0, Hd, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                w = tl.load(lm_ptr + ids[:, None] * s_lm + d[None, :], mask=id_ok[:, None] & (d[None, :] < Hd),
                            other=0.0)
                h = tl.load(h_row + d, mask=d < Hd, other=0.0)
                logit += tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
            if OUTPUT == "topk":
                bad = bad | (tl.sum((r_mask & ~id_ok).to(tl.int32), axis=0) > 0)
                mine = tl.topk(tl.where(id_ok, _logit_key(logit, ids), -1), OUT_K2)
                run = tl.topk(tl.reshape(tl.join(run, mine), [2 * OUT_K2]), OUT_K2)
            elif OUTPUT == "argmax":
                bad = bad | (tl.sum((r_mask & ~id_ok).to(tl.int32), axis=0) > 0)
                logit = tl.where(r_mask, logit, float("-inf"))
                m = tl.max(logit, axis=0)
                m_id = tl.min(tl.where(r_mask & (logit == m), ids.to(tl.int32), NO_ID), axis=0)
                better = (m > best) | ((m == best) & (m_id < best_id))
                best_id = tl.where(better, m_id, best_id)
                best = tl.maximum(best, m)
            elif OUTPUT == "sparse":
                out = t * top_k * CS + j * CS + r
                tl.store(ids_ptr + out, tl.where(id_ok, ids, -1), mask=r_mask)
                tl.store(logit_ptr + out, tl.where(id_ok, logit, float("nan")), mask=r_mask)
            else:
                tl.store(dense_ptr + t * s_dense + ids, logit, mask=id_ok)
        if current >= 0:
            _flush(part_val_ptr, part_id_ptr, part_key_ptr, current, pid, G, best, best_id, run, bad, OUT_K2, OUTPUT)
        # the last program to get here has every partial, and every program is past the barrier
        if last_to_arrive(cnt_ptr + 1, G):
            if OUTPUT == "argmax" or OUTPUT == "topk":
                g = tl.arange(0, BLOCK_G)
                for t in range(0, T):
                    first = (tl.zeros((), tl.int64) + t) * per_token
                    lo = ((first + 1) * G - 1) // items
                    hi = ((first + per_token) * G - 1) // items
                    prog = lo + g
                    # programs that own items of t (ones with an empty range wrote nothing)
                    owns = (prog <= hi) & (prog * items // G < (prog + 1) * items // G)
                    if OUTPUT == "topk":
                        _merge_topk(part_id_ptr, part_key_ptr, ids_ptr, logit_ptr, t, G, prog, owns, k_out, BLOCK_G,
                                    OUT_K2)
                    else:
                        _merge_argmax(part_val_ptr, part_id_ptr, ids_ptr, logit_ptr, t, G, prog, owns)
            tl.store(cnt_ptr, 0)
            tl.store(cnt_ptr + 1, 0)


# _head's stage flags in launch order (cluster-major runs all four; token-major SCORES and CANDIDATES)
STAGES = ("SCORES", "SELECT", "CANDIDATES", "MERGE")
CENTROIDS_PER_PROGRAM = 16  # BLOCK_C: phase 1's centroid rows per tile
# Phase 1's K tile: the whole hidden row up to 256 (E2B / E4B: one load wave). In 64-column blocks the
# sm_90 SASS waited for each block's copy before issuing the next (LDGSTS, then DEPBAR.LE SB0, 0x0: the
# nested loops are not pipelined), 4 dependent round trips before the grid barrier.
SCORE_BLOCK_K = 256
MIN_ROWS = 16


def plan(T: int, top_k: int, CS: int, C: int, sms: int, output: str = "argmax", order: str | None = None) -> dict:
    """Programs, items and phase-2 order of a call (csrc's centroid_order and centroid_plan decide the order
    and the grid alike; csrc's cluster-major items also cut a pair's rows over warps, a Triton program's
    tiles are whole clusters).
    Token-major (sparse and dense always; argmax and topk while T * top_k items leave programs idle): items
    are (token, cluster, row chunk), cut finer only while T * top_k of them would leave SMs idle, never below
    MIN_ROWS rows. Cluster-major (argmax and topk once T * top_k exceeds the SMs): the selected clusters
    are the items, each gathered once for every token that chose it. `order` forces one ("tokens",
    "clusters": the benchmark's and the tests' comparison of both)."""
    pairs = T * top_k
    if order is None:
        order = "clusters" if output in ("argmax", "topk") and pairs > sms else "tokens"
    centroid_order("centroid_logits", order, output)
    if order == "clusters":
        grid = max(1, min(sms, max(min(pairs, C), cdiv(C, CENTROIDS_PER_PROGRAM))))
        return dict(grid=grid, chunks=1, rows=CS, items=pairs, order=order)
    chunks = 1
    while pairs * chunks * 2 <= sms and CS >= MIN_ROWS * chunks * 2:
        chunks *= 2
    rows = cdiv(CS, chunks)
    chunks = cdiv(CS, rows)
    items = pairs * chunks
    grid = max(1, min(sms, max(items, cdiv(C, CENTROIDS_PER_PROGRAM))))
    return dict(grid=grid, chunks=chunks, rows=rows, items=items, order=order)


# Cluster-major tiles: 64 rows (topk: 32) x the whole hidden row up to 256 columns (32 KiB at bf16), x up to
# 64 tokens. The next tile's rows are in flight in registers while a tile is computed (w_b: 32 registers a
# thread at 64 x 256 bf16 and 8 warps); topk's int64 keys of a [rows, tokens] tile come on top, which at 64
# rows made Triton 3.6 spill at T = 64. fp32 rows take half as many (the same bytes: 64 rows spilled ~3.9 KiB).
CLUSTER_ROWS = {"argmax": 64, "topk": 32}
CLUSTER_BLOCK_D = 256


def launch_config(T: int, C: int, CS: int, Hd: int, top_k: int, rows: int, k: int = 1, order: str = "tokens",
                  output: str = "argmax", elem_bytes: int = 2) -> dict:
    """Compile-time tiles of a call (also used by the AOT compile check). k: output="topk"'s count."""
    idx_bits = max(1, (C - 1).bit_length())
    block_cc = pow2_at_least(C, 2)
    k2 = pow2_at_least(top_k, 2)  # tl.topk needs k >= 2
    out_k2 = pow2_at_least(k, 2)
    if order == "clusters":  # tl.dot needs 16 rows; topk takes the best OUT_K2 <= 16 of each tile's rows
        block_r = min(max(16, CLUSTER_ROWS[output] * 2 // elem_bytes), pow2_at_least(CS, 16))
        block_d = min(CLUSTER_BLOCK_D, pow2_at_least(Hd, 16))
    else:
        # a [BLOCK_R, BLOCK_D] tile of rows: 32 x 256 at T = 1, 128 x 128 at T = 64; topk takes the best
        # OUT_K2 of an item's rows (BLOCK_R >= OUT_K2, padding rows masked)
        block_r = max(pow2_at_least(rows, 2), out_k2)
        block_d = min(16384 // block_r, 256, pow2_at_least(Hd, 16))
    return dict(OUT_K2=out_k2, BLOCK_C=CENTROIDS_PER_PROGRAM, BLOCK_K=min(SCORE_BLOCK_K, pow2_at_least(Hd, 16)),
                BLOCK_T=min(64, pow2_at_least(T, 16)), BLOCK_CC=block_cc, K2=k2, ROW=ROW,
                IDX_BITS=idx_bits, TWO_LEVEL=block_cc >= k2 * ROW and block_cc > ROW,
                BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_P=256, CLUSTER_MAJOR=order == "clusters",
                WHOLE_ROW=order == "clusters" and Hd <= block_d, num_warps=8,
                # cluster-major: no compiler pipelining (the loop pipelines its gathers by hand), and the
                # register cap said: without .maxnreg, Triton 3.8's ptxas held the topk loop to 128
                # registers and spilled (48 bytes at T = 8); with it, 163 and none
                num_stages=1 if order == "clusters" else 2, maxnreg=255 if order == "clusters" else None)


def centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k=32, output="argmax", fill_value=None, k=1,
                    order=None):
    """order: plan()'s phase-2 order forced ("tokens" or "clusters"), for comparisons; None picks it."""
    T, Hd = hidden.shape
    C = centroids.shape[0]
    V = lm_head.shape[0]
    CS = V // C
    K = top_k * CS
    dev = hidden.device
    ids = logits = dense = None
    if output == "argmax":
        ids = torch.empty(T, dtype=torch.int64, device=dev)
        logits = torch.empty(T, dtype=torch.float32, device=dev)
    elif output == "topk":
        ids = torch.empty(T, k, dtype=torch.int64, device=dev)
        logits = torch.empty(T, k, dtype=torch.float32, device=dev)
    elif output == "sparse":
        ids = torch.empty(T, K, dtype=torch.int64, device=dev)
        logits = torch.empty(T, K, dtype=torch.float32, device=dev)
    else:
        dense = torch.full((T, V), fill_value, dtype=torch.float32, device=dev)
    if T > 0:
        pl = plan(T, top_k, CS, C, num_sms(dev), output, order)
        cfg = launch_config(T, C, CS, Hd, top_k, pl["rows"], k, pl["order"], output, lm_head.element_size())
        G = pl["grid"]
        scores = torch.empty(T, C, dtype=torch.float32, device=dev)
        pval = torch.empty(T, G, dtype=torch.float32, device=dev)
        pids = torch.empty(T, G, dtype=torch.int32, device=dev)  # argmax: ids; topk: bad-id flags
        # topk: each program's best keys per token (the other outputs never touch it: pids stands in)
        pkeys = torch.empty(T, G, cfg["OUT_K2"], dtype=torch.int64, device=dev) if output == "topk" else pids
        # cluster-major: each token's threshold key, each cluster's selection flag, the selected clusters
        thr = flags = clusters = pids
        if cfg["CLUSTER_MAJOR"]:
            thr = torch.empty(T, dtype=torch.int64, device=dev)
            flags = torch.empty(C, dtype=torch.int32, device=dev)
            clusters = torch.empty(C, dtype=torch.int32, device=dev)
        counters = zeroed_counters(dev, COUNTERS, "triton.centroid_logits")
        line_elems = LINE // token_ordering.element_size()
        interp = interpreting(dev)
        args = (hidden, centroids, token_ordering, lm_head, scores, pval, pids, pkeys, thr, flags, clusters, counters,
                ids, logits, dense, T, C, V, Hd, CS, top_k, pl["chunks"], pl["rows"], pl["items"],
                cdiv(V, line_elems), k, hidden.stride(0), centroids.stride(0), lm_head.stride(0), V)
        consts = dict(BLOCK_C=cfg["BLOCK_C"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
                      BLOCK_CC=cfg["BLOCK_CC"], K2=cfg["K2"], ROW=cfg["ROW"], IDX_BITS=cfg["IDX_BITS"],
                      TWO_LEVEL=cfg["TWO_LEVEL"], BLOCK_R=cfg["BLOCK_R"], BLOCK_D=cfg["BLOCK_D"],
                      BLOCK_P=cfg["BLOCK_P"], BLOCK_G=pow2_at_least(G, 2), BLOCK_Q=pow2_at_least(cdiv(C, G), 2),
                      LINE_ELEMS=line_elems, OUT_K2=cfg["OUT_K2"], OUTPUT=output, CLUSTER_MAJOR=cfg["CLUSTER_MAJOR"],
                      WHOLE_ROW=cfg["WHOLE_ROW"],
                      PREC=dot_precision(hidden.dtype), INTERP=interp, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"])
        stages = STAGES if cfg["CLUSTER_MAJOR"] else ("SCORES", "CANDIDATES")
        if interp:  # programs run one after another: each barrier becomes the end of a launch
            for stage in stages:
                _head[(G,)](*args, **{s: s == stage for s in STAGES}, BARRIER=False, **consts)
        else:
            _head[(G,)](*args, **{s: s in stages for s in STAGES}, BARRIER=True, launch_cooperative_grid=True,
                        **consts)
    if output == "dense":
        return dense
    return ids, logits
