"""Triton `tree_verify` (SPEC §4.4).

Design. The cost is reading B * N * V logits (0.5 MiB per node in bf16 at V = 262144); the tree walk
itself is a few scalar steps. Three short launches, all rows of the batch in parallel:
1. `_chunk_stats` grid (B * N rows, V / CHUNK chunks): each program streams one chunk of one row
   (logits / temperature for sampling rows) and writes its max, first argmax and (when any row may
   sample) sum of exp(x - max). CHUNK is sized so a small batch still gives >= 4 programs per SM (B = 1, N = 8,
   V = 262144 on 132 SMs: 1024 programs of 2 K ids). No V-sized buffer: B * N * V / CHUNK floats
   of statistics.
2. `_sample` grid (rows, chunks), only when some row samples: every program combines its row's
   chunk statistics (max M, Z = sum exp(x - M)); the one chunk where the inverse CDF crosses
   u * Z (first id whose cumulative mass exceeds u * Z, else the last id with mass > 0, as the
   reference) rescans its chunk and writes the sampled id. With draft_probs every program also
   writes its chunk's residual mass sum(max(p - q, 0)). Greedy rows return at once.
3. `_walk` grid (B): the tree walk per request, in the reference's order (children by ascending node
   index, the lowest-index child holding the token wins); greedy argmax from the chunk stats; for
   chains with draft_probs the accept test u0 < p(x) / q(x) with q(x) > 0, and on rejection the
   residual inverse CDF (find the crossing chunk from the residual sums, rescan that one chunk).
Why not one launch: phases 1 -> 2 -> 3 are grid-wide dependencies (the CDF needs the row's total
mass; the walk needs every visited row). A last-program-done counter would fold them into one
launch but relies on inter-CTA release/acquire ordering that we could not validate without a GPU;
three launches are deterministic and, inside a CUDA graph, cost ~2-3 us of launch gaps.
Expected on H100/H200: phase 1 reads every logit once (B * N * V * 2 bytes: 4 MiB for B = 1,
N = 8, ~1 us of traffic, so small batches are launch-latency bound; 64 rows and up are bandwidth
bound) at ~70-80% of copy bandwidth (2 K-element steps: two 16-byte loads per thread,
>= 4 programs per SM; the loads are not cp.async-pipelined, so occupancy hides the latency);
phase 2 rereads one chunk per sampling row (plus the q rows and a second logit pass for draft_probs
chains, which need the normaliser before the residual); phase 3 reads a chunk per rejection. So
greedy and tree sampling sit near the one-read floor; draft_probs chains are ~2x logits + 1x q.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._types import VerifyResult
from ._common import device_helper, num_sms, pow2_at_least

BLOCK = 2048  # 16 elements (two 16-byte bf16 loads) per thread per step at 4 warps


@device_helper
def _row_values(logit_ptr, row_off, offs, V, temp):
    """x = logits / temperature (logits as-is for greedy rows), -inf past V."""
    x = tl.load(logit_ptr + row_off + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return tl.where(temp > 0, x / tl.where(temp > 0, temp, 1.0), x)


@triton.jit
def _chunk_stats(logit_ptr, temp_ptr, max_ptr, sum_ptr, arg_ptr, N, V, chunk, nch, s_b, s_n,
                 HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // N
    row_off = b.to(tl.int64) * s_b + (row % N).to(tl.int64) * s_n
    temp = 0.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + b)
    m = float("-inf")
    s = 0.0
    arg = 0
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _row_values(logit_ptr, row_off, offs, V, temp)
        bm = tl.max(x, axis=0)
        barg = tl.min(tl.where(x == bm, offs, 2147483647), axis=0)
        arg = tl.where(bm > m, barg, arg)  # strictly greater: ties keep the lower id
        m_new = tl.maximum(m, bm)
        if HAS_TEMP:  # only sampling rows read the mass: a greedy-only call skips one exp per logit
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    out = row.to(tl.int64) * nch + c
    tl.store(max_ptr + out, m)
    if HAS_TEMP:
        tl.store(sum_ptr + out, s)
    tl.store(arg_ptr + out, arg)


@device_helper
def _row_total(max_ptr, sum_ptr, row, nch, BLOCK_C: tl.constexpr):
    """(M, per-chunk mass exp-rescaled to M, Z) of one row from its chunk statistics."""
    cc = tl.arange(0, BLOCK_C)
    cm = tl.load(max_ptr + row.to(tl.int64) * nch + cc, mask=cc < nch, other=float("-inf"))
    cs = tl.load(sum_ptr + row.to(tl.int64) * nch + cc, mask=cc < nch, other=0.0)
    M = tl.max(cm, axis=0)
    mass = tl.where(cm == float("-inf"), 0.0, cs * tl.exp(cm - M))
    return M, mass, tl.sum(mass, axis=0)


@device_helper
def _crossing_chunk(mass, target, nch, BLOCK_C: tl.constexpr):
    """(chunk, mass before it) where the cumulative mass first exceeds target; if rounding leaves
    the total at or below target, the last chunk with mass (the reference's fallback)."""
    cc = tl.arange(0, BLOCK_C)
    incl = tl.cumsum(mass, axis=0)
    first = tl.min(tl.where((incl > target) & (cc < nch), cc, BLOCK_C), axis=0)
    last = tl.max(tl.where(mass > 0, cc, -1), axis=0)
    hit = first < BLOCK_C
    c = tl.where(hit, first, last)
    before = tl.sum(tl.where(cc < c, mass, 0.0), axis=0)
    return c, before, hit


@device_helper
def _scan_chunk(logit_ptr, q_ptr, row_off, q_off, c, chunk, V, temp, M, Z, before, target, hit,
                RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse CDF inside chunk c: the first id whose cumulative weight (starting at `before`)
    exceeds target, or (no crossing at all) the last id with weight > 0. Weights are exp(x - M), or
    max(p - q, 0) with p = exp(x - M) / Z for the residual."""
    found = 2147483647
    last_pos = -1
    run = before
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M)
        if RESIDUAL:
            q = tl.load(q_ptr + q_off + offs, mask=offs < V, other=0.0).to(tl.float32)
            w = tl.maximum(w / Z - q, 0.0)
        cum = run + tl.cumsum(w, axis=0)
        found = tl.minimum(found, tl.min(tl.where((cum > target) & (offs < V), offs, 2147483647), axis=0))
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run = run + tl.sum(w, axis=0)
    return tl.where(hit & (found != 2147483647), found, last_pos)


@triton.jit
def _sample(logit_ptr, q_ptr, temp_ptr, unif_ptr, max_ptr, sum_ptr, sample_ptr, res_ptr,
            N, V, chunk, nch, s_b, s_n, sq_b, sq_n,
            HAS_DRAFT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // N
    temp = tl.load(temp_ptr + b)
    if temp > 0:
        row_off = b.to(tl.int64) * s_b + (row % N).to(tl.int64) * s_n
        q_off = b.to(tl.int64) * sq_b + (row % N).to(tl.int64) * sq_n
        M, mass, Z = _row_total(max_ptr, sum_ptr, row, nch, BLOCK_C)
        # without draft_probs a row samples with uniform 0; with them, only the leaf / p == q
        # fallback samples from p, with uniform 1
        u = tl.load(unif_ptr + row.to(tl.int64) * 2 + (1 if HAS_DRAFT else 0))
        target = u * Z
        cross, before, hit = _crossing_chunk(mass, target, nch, BLOCK_C)
        # no distribution (all -inf or some NaN logits, unchecked on the GPU): no chunk crosses, so
        # chunk 0 writes token -1 rather than leaving the slot unwritten
        has_mass = Z > 0
        if c == tl.where(has_mass, cross, 0):
            tok = _scan_chunk(logit_ptr, q_ptr, row_off, q_off, c, chunk, V, temp, M, Z, before, target, hit,
                              False, BLOCK)
            tl.store(sample_ptr + row, tl.where(has_mass, tok, -1))
        if HAS_DRAFT:
            r = 0.0
            for start in range(c * chunk, tl.minimum(c * chunk + chunk, V), BLOCK):
                offs = start + tl.arange(0, BLOCK)
                p = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M) / Z
                q = tl.load(q_ptr + q_off + offs, mask=offs < V, other=0.0).to(tl.float32)
                r += tl.sum(tl.maximum(p - q, 0.0), axis=0)
            tl.store(res_ptr + row.to(tl.int64) * nch + c, r)


@triton.jit
def _walk(tok_ptr, par_ptr, logit_ptr, q_ptr, temp_ptr, unif_ptr, max_ptr, sum_ptr, arg_ptr, sample_ptr, res_ptr,
          len_ptr, acc_ptr, out_ptr, last_ptr, N, V, chunk, nch, s_b, s_n, sq_b, sq_n,
          HAS_TEMP: tl.constexpr, HAS_DRAFT: tl.constexpr, BLOCK_NODES: tl.constexpr, BLOCK_C: tl.constexpr,
          BLOCK: tl.constexpr):
    b = tl.program_id(0)
    idx = tl.arange(0, BLOCK_NODES)
    in_row = idx < N
    parents = tl.load(par_ptr + b.to(tl.int64) * N + idx, mask=in_row, other=-2)
    tokens = tl.load(tok_ptr + b.to(tl.int64) * N + idx, mask=in_row, other=-1).to(tl.int32)
    temp = 0.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + b)
    cc = tl.arange(0, BLOCK_C)
    u = 0
    n = 0
    done = False
    for _ in range(N):
        if not done:
            row = b * N + u
            kids = (parents == u) & (idx > 0)
            if temp == 0:  # greedy: first maximum over the chunks
                cm = tl.load(max_ptr + row.to(tl.int64) * nch + cc, mask=cc < nch, other=float("-inf"))
                ca = tl.load(arg_ptr + row.to(tl.int64) * nch + cc, mask=cc < nch, other=2147483647)
                t = tl.min(tl.where(cm == tl.max(cm, axis=0), ca, 2147483647), axis=0)
                child = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
            elif HAS_DRAFT:
                t = tl.load(sample_ptr + row)  # p sampled with uniform 1: the leaf's bonus
                child = tl.min(tl.where(kids, idx, BLOCK_NODES), axis=0)
                if child < BLOCK_NODES:
                    x = tl.sum(tl.where(idx == child, tokens, 0), axis=0)
                    x_ok = (x >= 0) & (x < V)  # an unchecked bad draft token is rejected, never read
                    x = tl.where(x_ok, x, 0)
                    row_off = b.to(tl.int64) * s_b + u.to(tl.int64) * s_n
                    q_off = b.to(tl.int64) * sq_b + u.to(tl.int64) * sq_n
                    M, mass, Z = _row_total(max_ptr, sum_ptr, row, nch, BLOCK_C)
                    px = tl.exp(tl.load(logit_ptr + row_off + x).to(tl.float32) / temp - M) / Z
                    qx = tl.load(q_ptr + q_off + x).to(tl.float32)
                    u0 = tl.load(unif_ptr + row.to(tl.int64) * 2)
                    if x_ok & (qx > 0) & (u0 < px / qx):
                        t = x
                    else:
                        child = BLOCK_NODES
                        rc = tl.load(res_ptr + row.to(tl.int64) * nch + cc, mask=cc < nch, other=0.0)
                        total = tl.sum(rc, axis=0)
                        if total > 0:  # p == q leaves no residual: keep the sample from p
                            target = tl.load(unif_ptr + row.to(tl.int64) * 2 + 1) * total
                            cross, before, hit = _crossing_chunk(rc, target, nch, BLOCK_C)
                            t = _scan_chunk(logit_ptr, q_ptr, row_off, q_off, cross, chunk, V, temp, M, Z, before,
                                            target, hit, True, BLOCK)
            else:
                t = tl.load(sample_ptr + row)
                child = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
            if child < BLOCK_NODES:
                tl.store(acc_ptr + b.to(tl.int64) * N + n, child)
                tl.store(out_ptr + b.to(tl.int64) * N + n, t.to(tl.int64))
                n += 1
                u = child
            else:
                tl.store(out_ptr + b.to(tl.int64) * N + n, t.to(tl.int64))
                done = True
    tl.store(acc_ptr + b.to(tl.int64) * N + idx, tl.full((BLOCK_NODES,), -1, tl.int32), mask=in_row & (idx >= n))
    tl.store(out_ptr + b.to(tl.int64) * N + idx, tl.full((BLOCK_NODES,), -1, tl.int64), mask=in_row & (idx > n))
    tl.store(len_ptr + b, n)
    tl.store(last_ptr + b, u)


MAX_CHUNK = 16384
# (num_warps, num_stages) per kernel: the streaming loops are pipelined, the walk is scalar
LAUNCH = dict(chunk_stats=(4, 3), sample=(4, 2), walk=(4, 1))


def chunk_size(rows: int, V: int, sms: int) -> int:
    """Ids per program: >= 4 programs per SM over the whole batch, 1..16 K-element vector steps."""
    want = rows * V // (4 * sms)
    return min(MAX_CHUNK, max(BLOCK, want // BLOCK * BLOCK))


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None,
                chunk=None):
    """`chunk` (tests only) overrides the ids per program, to exercise many chunks at a small V."""
    B, N, V = target_logits.shape
    dev = target_logits.device
    accept_len = torch.empty(B, dtype=torch.int32, device=dev)
    accepted = torch.empty(B, N, dtype=torch.int32, device=dev)
    tokens = torch.empty(B, N, dtype=torch.int64, device=dev)
    last = torch.empty(B, dtype=torch.int32, device=dev)
    if B == 0:
        return VerifyResult(accept_len, accepted, tokens, last)
    rows = B * N
    if chunk is None:
        chunk = chunk_size(rows, V, num_sms(dev))
    block = min(BLOCK, chunk)
    nch = triton.cdiv(V, chunk)
    cmax = torch.empty(rows, nch, dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    carg = torch.empty(rows, nch, dtype=torch.int32, device=dev)
    s_b, s_n = target_logits.stride(0), target_logits.stride(1)
    # validation lets temperature come without uniforms only when every row is greedy
    has_temp = temperature is not None and uniforms is not None
    has_draft = draft_probs is not None
    sq_b, sq_n = (draft_probs.stride(0), draft_probs.stride(1)) if has_draft else (0, 0)
    block_c = pow2_at_least(nch, 2)
    _chunk_stats[(rows, nch)](target_logits, temperature, cmax, csum, carg, N, V, chunk, nch, s_b, s_n,
                              HAS_TEMP=has_temp, BLOCK=block, num_warps=LAUNCH["chunk_stats"][0],
                              num_stages=LAUNCH["chunk_stats"][1])
    sample = torch.empty(rows, dtype=torch.int32, device=dev) if has_temp else None
    resid = torch.empty(rows, nch, dtype=torch.float32, device=dev) if has_draft else None
    if has_temp:
        _sample[(rows, nch)](target_logits, draft_probs, temperature, uniforms, cmax, csum, sample, resid,
                             N, V, chunk, nch, s_b, s_n, sq_b, sq_n,
                             HAS_DRAFT=has_draft, BLOCK_C=block_c, BLOCK=block, num_warps=LAUNCH["sample"][0],
                             num_stages=LAUNCH["sample"][1])
    _walk[(B,)](draft_tokens, parents, target_logits, draft_probs, temperature, uniforms, cmax, csum, carg, sample,
                resid, accept_len, accepted, tokens, last, N, V, chunk, nch, s_b, s_n, sq_b, sq_n,
                HAS_TEMP=has_temp, HAS_DRAFT=has_draft, BLOCK_NODES=pow2_at_least(N, 2), BLOCK_C=block_c,
                BLOCK=block, num_warps=LAUNCH["walk"][0], num_stages=LAUNCH["walk"][1])
    return VerifyResult(accept_len, accepted, tokens, last)
