"""Triton `centroid_logits` (SPEC §4.3): the E2B/E4B two-stage LM head.

Design. The dense head would read 262144 x 256 bf16 (128 MiB); this one reads the centroids
(2048 x 256, 1 MiB) and the 32 x 128 = 4096 candidate rows (2 MiB), so it is latency bound: the
aim is few, short, well-spread launches.
1. `_scores` grid (C / BLOCK_C, T / BLOCK_T): scores[T, C] = hidden @ centroids^T in fp32 through
   tl.dot; BLOCK_C = 16 gives 128 programs for C = 2048 so the 1 MiB centroid read is spread over
   the GPU. The [T, C] fp32 scores (8 KiB per token) are the only intermediate.
2. `_candidates` grid (T, top_k): program (t, j) takes the cluster of rank j itself, with no sort
   and no cross-program step: scores become distinct int64 keys (order-preserving fp32 bits, then
   C - 1 - c so equal scores rank the lower cluster first) and a radix select (6 steps of one
   256-bin histogram over the row, 8 key bits per step) finds the key with exactly j keys above
   it; the 8 KiB score row comes from L2. It then gathers the cluster's V / C rows of lm_head
   through token_ordering, dots them with hidden[t] in fp32, and either keeps a running argmax
   (ties to the lowest vocabulary id) and writes one (logit, id) pair ("argmax": nothing of size
   K reaches memory), writes ids and logits at [t, j * V/C ...] ("sparse": cluster order, then
   token_ordering order), or scatters the logits into the dense row ("dense": the row is
   pre-filled with fill_value).
3. `_argmax` grid (T): the best of the top_k pairs, ties to the lowest id.
Expected on H100/H200 (E2B, T = 1): ~3 MiB of reads, i.e. < 1 us of bandwidth, so the three
launches (~2 us each un-graphed, ~1 us in a CUDA graph) plus the 6 dependent select steps of stage 2
dominate: ~4-6 us against ~30-40 us for the dense 128 MiB head + argmax (about 6-8x, short of the
20x target; reaching it needs stages 1-3 fused into one persistent launch with a grid-wide
barrier, which we do not attempt untested).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_precision, interpreting, mma, pow2_at_least


@triton.jit
def _scores(h_ptr, c_ptr, s_ptr, T, C, Hd, s_h, s_c,
            BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
            PREC: tl.constexpr, INTERP: tl.constexpr):
    cs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, Hd, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        cen = tl.load(c_ptr + cs.to(tl.int64)[:, None] * s_c + k[None, :], mask=(cs[:, None] < C) & (k[None, :] < Hd),
                      other=0.0)
        hid = tl.load(h_ptr + ts.to(tl.int64)[None, :] * s_h + k[:, None], mask=(ts[None, :] < T) & (k[:, None] < Hd),
                      other=0.0)
        acc = mma(cen, hid, acc, PREC, INTERP)
    tl.store(s_ptr + ts.to(tl.int64)[None, :] * C + cs[:, None], acc, mask=(cs[:, None] < C) & (ts[None, :] < T))


@triton.jit
def _candidates(h_ptr, s_ptr, order_ptr, lm_ptr, best_ptr, best_id_ptr, ids_ptr, logit_ptr, dense_ptr,
                C, V, Hd, CS, top_k, s_h, s_lm, s_dense,
                BLOCK_CC: tl.constexpr, IDX_BITS: tl.constexpr, KEY_DIGITS: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                OUTPUT: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1)
    cc = tl.arange(0, BLOCK_CC)
    score = tl.load(s_ptr + t.to(tl.int64) * C + cc, mask=cc < C, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with +0.0, as in the reference's sort
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648  # order-preserving, >= 0
    keys = tl.where(cc < C, (ordered << IDX_BITS) | (C - 1 - cc).to(tl.int64), -1)
    # radix select, 8 bits per step from the top: the key with exactly j keys above it (keys are
    # distinct); each step is one histogram of the next digit among keys matching the prefix so far
    need = j + 1
    prefix = tl.zeros((), dtype=tl.int64)
    bins = tl.arange(0, 256)
    for p in tl.static_range(KEY_DIGITS):
        shift = 8 * (KEY_DIGITS - 1 - p)
        match = (cc < C) & ((keys >> (shift + 8)) == prefix)
        hist = tl.histogram(((keys >> shift) & 255).to(tl.int32), 256, mask=match)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= bin
        digit = tl.max(tl.where(at_least >= need, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = (prefix << 8) | digit.to(tl.int64)
    cluster = (C - 1 - (prefix & ((1 << IDX_BITS) - 1))).to(tl.int64)

    h_row = h_ptr + t.to(tl.int64) * s_h
    best = float("-inf")
    best_id = 2147483647
    bad_seen = False
    for r0 in range(0, CS, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < CS
        ids = tl.load(order_ptr + cluster * CS + r, mask=r_mask, other=0).to(tl.int64)
        # token_ordering is not validated on the GPU: an id outside [0, V) is never dereferenced,
        # its logit is NaN (and an argmax over it reports token -1, logit NaN)
        id_ok = r_mask & (ids >= 0) & (ids < V)
        logit = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in range(0, Hd, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            w = tl.load(lm_ptr + ids[:, None] * s_lm + d[None, :], mask=id_ok[:, None] & (d[None, :] < Hd), other=0.0)
            h = tl.load(h_row + d, mask=d < Hd, other=0.0)
            logit += tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        logit = tl.where(id_ok | ~r_mask, logit, float("nan"))
        if OUTPUT == "argmax":
            bad_seen = bad_seen | (tl.sum((r_mask & ~id_ok).to(tl.int32), axis=0) > 0)
            logit = tl.where(r_mask, logit, float("-inf"))
            m = tl.max(logit, axis=0)
            m_id = tl.min(tl.where(r_mask & (logit == m), ids.to(tl.int32), 2147483647), axis=0)
            better = (m > best) | ((m == best) & (m_id < best_id))
            best_id = tl.where(better, m_id, best_id)
            best = tl.maximum(best, m)
        elif OUTPUT == "sparse":
            out = t.to(tl.int64) * top_k * CS + j * CS + r
            tl.store(ids_ptr + out, ids, mask=r_mask)
            tl.store(logit_ptr + out, logit, mask=r_mask)
        else:
            tl.store(dense_ptr + t.to(tl.int64) * s_dense + ids, logit, mask=id_ok)
    if OUTPUT == "argmax":
        tl.store(best_ptr + t.to(tl.int64) * top_k + j, tl.where(bad_seen, float("nan"), best))
        tl.store(best_id_ptr + t.to(tl.int64) * top_k + j, best_id)


@triton.jit
def _argmax(best_ptr, best_id_ptr, token_ptr, logit_ptr, top_k, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    v = tl.load(best_ptr + t.to(tl.int64) * top_k + k, mask=k < top_k, other=float("-inf"))
    i = tl.load(best_id_ptr + t.to(tl.int64) * top_k + k, mask=k < top_k, other=2147483647)
    m = tl.max(v, axis=0)
    bad = tl.sum((v != v).to(tl.int32), axis=0) > 0  # a NaN partial: an out-of-range candidate id
    token = tl.min(tl.where(v == m, i, 2147483647), axis=0)
    tl.store(token_ptr + t, tl.where(bad, -1, token).to(tl.int64))
    tl.store(logit_ptr + t, tl.where(bad, float("nan"), m))


SCORE_TILES = dict(BLOCK_C=16, BLOCK_K=64)


def score_config(T: int) -> dict:
    return dict(SCORE_TILES, BLOCK_T=min(64, pow2_at_least(T, 16)), num_warps=4, num_stages=3)


def candidate_config(C: int, CS: int, Hd: int) -> dict:
    idx_bits = max(1, (C - 1).bit_length())
    return dict(BLOCK_CC=pow2_at_least(C, 2), IDX_BITS=idx_bits, KEY_DIGITS=triton.cdiv(32 + idx_bits, 8),
                BLOCK_R=min(128, pow2_at_least(CS, 2)), BLOCK_D=min(64, pow2_at_least(Hd, 16)),
                num_warps=4 if C <= 2048 else 8, num_stages=2)


def centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k=32, output="argmax", fill_value=None):
    T, Hd = hidden.shape
    C = centroids.shape[0]
    V = lm_head.shape[0]
    CS = V // C
    K = top_k * CS
    dev = hidden.device
    scores = torch.empty(T, C, dtype=torch.float32, device=dev)
    if T > 0:
        sc = score_config(T)
        _scores[(triton.cdiv(C, sc["BLOCK_C"]), triton.cdiv(T, sc["BLOCK_T"]))](
            hidden, centroids, scores, T, C, Hd, hidden.stride(0), centroids.stride(0),
            BLOCK_C=sc["BLOCK_C"], BLOCK_T=sc["BLOCK_T"], BLOCK_K=sc["BLOCK_K"], PREC=dot_precision(hidden.dtype),
            INTERP=interpreting(dev), num_warps=sc["num_warps"], num_stages=sc["num_stages"])
    best = best_id = ids = logits = dense = None
    if output == "argmax":
        best = torch.empty(T, top_k, dtype=torch.float32, device=dev)
        best_id = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    elif output == "sparse":
        ids = torch.empty(T, K, dtype=torch.int64, device=dev)
        logits = torch.empty(T, K, dtype=torch.float32, device=dev)
    else:
        dense = torch.full((T, V), fill_value, dtype=torch.float32, device=dev)
    if T > 0:
        cfg = candidate_config(C, CS, Hd)
        _candidates[(T, top_k)](hidden, scores, token_ordering, lm_head, best, best_id, ids, logits, dense,
                                C, V, Hd, CS, top_k, hidden.stride(0), lm_head.stride(0), V,
                                BLOCK_CC=cfg["BLOCK_CC"], IDX_BITS=cfg["IDX_BITS"],
                                KEY_DIGITS=cfg["KEY_DIGITS"], BLOCK_R=cfg["BLOCK_R"],
                                BLOCK_D=cfg["BLOCK_D"], OUTPUT=output, num_warps=cfg["num_warps"],
                                num_stages=cfg["num_stages"])
    if output == "sparse":
        return ids, logits
    if output == "dense":
        return dense
    token = torch.empty(T, dtype=torch.int64, device=dev)
    logit = torch.empty(T, dtype=torch.float32, device=dev)
    if T > 0:
        _argmax[(T,)](best, best_id, token, logit, top_k, BLOCK_K=pow2_at_least(top_k, 2), num_warps=4,
                      num_stages=1)
    return token, logit
