"""Triton `tree_verify` (SPEC §4.4): one launch for the whole batch.

Design. The cost is reading B * N * V logits (0.5 MiB per node in bf16 at V = 262144); the tree walk
itself is a few scalar steps. Grid (B * N rows, V / CHUNK chunks), three phases in one kernel:
1. Every program streams one chunk of one row (logits / temperature for sampling rows) and publishes
   its max, first argmax and (when any row may sample) sum of exp(x - max). CHUNK is sized so a
   small batch still gives >= 4 programs per SM (B = 1, N = 8, V = 262144 on 132 SMs: 1024 programs
   of 2 K ids). Rows of padding slots are never visited by the walk, so their programs load nothing.
2. The last program of each row to finish (a per-row counter) makes the row's decision from the
   chunk statistics: the token t (greedy: first argmax; sampling: inverse CDF, locating the
   crossing chunk from the per-chunk masses and rescanning only that chunk; a sampling row with no
   distribution -- all -inf or NaN logits, unchecked on the GPU -- gives t = -1) and the child the
   walk continues to (the lowest-index child holding t; with draft_probs the chain child when
   u0 < p(x) / q(x) and q(x) > 0, else t is drawn from normalize(max(p - q, 0)) with uniform 1:
   this program scans the whole row once for the per-chunk residual masses, then rescans the
   crossing chunk; a leaf, or p == q with no residual, samples p with uniform 1). It publishes
   (t, next child or -1).
3. The last row of each request to be decided (a per-request counter) walks that request's tree
   from the published decisions and writes its outputs. Requests walk in parallel.
Counters. One zeroed int32 buffer per device (B * N row counters, then B request counters), cached
and grown on demand (`_counters`): every counter is reset to 0 by the program that consumed it, so
no per-call memset is needed and the launch replays in a CUDA graph. A call captured into a graph
before the cache is big enough gets a graph-private buffer (its zeroing memset is captured too);
outgrown buffers stay alive because captured graphs hold their addresses. Launches that overlap in
time on one device (concurrent streams or graph replays) would share the counters: they are not
supported.
Ordering (the interpreter runs programs one after another, so only this argument covers it). A
program's published values are scalar stores; `tl.debug_barrier()` (bar.sync) then orders every
thread's stores before the counter increment, an `atom.acq_rel.gpu` issued by one thread (release is
cumulative over what the barrier made that thread observe, the pattern of cooperative groups' grid
sync). The counter is only ever changed by these read-modify-writes until it reaches its total, so
the program that reads total - 1 reads the end of a chain of RMWs that contains every other
program's release: each of them synchronizes with its acquire. Triton hands the atomic's result to
the other threads through shared memory behind a barrier, so every thread's later loads of the
published values follow the acquire in causality order and see the writes of this launch, never
the previous launch's; they are `.cg` loads (L2, no L1 copy) besides. The resets are plain stores
after the last increment of their counter in this launch; the next launch runs after this one ends.
Checked in the sm_90 SASS: MEMBAR.ALL.GPU before each ATOMG.E.ADD.STRONG.GPU and CCTL.IVALL (L1
invalidate) after it, the published values stored and the atomic issued under the same thread-0
predicate, and the partial loads are LDG.E.STRONG.GPU. Not yet run on a GPU.
Expected on H100/H200: phase 1 reads every logit once (B * N * V * 2 bytes: 4 MiB for B = 1,
N = 8, ~1 us of traffic, so small batches are launch-latency bound; 64 rows and up are bandwidth
bound) at ~70-80% of copy bandwidth (2 K-element steps: two 16-byte loads per thread, several
programs per SM; the loads are not cp.async-pipelined, so occupancy hides the latency). Phase 2
adds one chunk per sampling row, an L2 round trip per counter and, for draft_probs rows that reject,
a serial pass of one program over the row's logits and q: greedy and tree sampling sit near the
one-read floor, a draft_probs rejection costs that row's read by one program (the price of one
launch; the normaliser must be known before the residual).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._types import VerifyResult
from ._common import device_helper, num_sms, pow2_at_least

BLOCK = 2048  # 16 elements (two 16-byte bf16 loads) per thread per step at 4 warps
NO_ID = tl.constexpr(2147483647)  # "no id": above every vocabulary id


@device_helper
def _row_values(logit_ptr, row_off, offs, V, temp):
    """x = logits / temperature (greedy rows divide by 1: exact), -inf past V. A division rather
    than a select keeps the row's kind out of the predicate registers (sm_80 spilled them)."""
    x = tl.load(logit_ptr + row_off + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x / tl.where(temp > 0, temp, 1.0)


@device_helper
def _row_total(max_ptr, sum_ptr, stat, nch, BLOCK_C: tl.constexpr):
    """(M, per-chunk mass exp-rescaled to M, Z) of one row from its published chunk statistics."""
    cc = tl.arange(0, BLOCK_C)
    cm = tl.load(max_ptr + stat + cc, mask=cc < nch, other=float("-inf"), cache_modifier=".cg")
    cs = tl.load(sum_ptr + stat + cc, mask=cc < nch, other=0.0, cache_modifier=".cg")
    M = tl.max(cm, axis=0)
    mass = tl.where(cm == float("-inf"), 0.0, cs * tl.exp(cm - M))
    return M, mass, tl.sum(mass, axis=0)


@device_helper
def _crossing_chunk(mass, target, nch, BLOCK_C: tl.constexpr):
    """(chunk, mass before it, target for the chunk scan) where the cumulative mass first exceeds
    target; if rounding leaves the total at or below target, the last chunk with mass (the
    reference's fallback) and an infinite target, so that the scan returns its last id with mass
    (a float rather than a flag: a predicate live across the scan spilled on sm_80)."""
    cc = tl.arange(0, BLOCK_C)
    incl = tl.cumsum(mass, axis=0)
    first = tl.min(tl.where((incl > target) & (cc < nch), cc, BLOCK_C), axis=0)
    last = tl.max(tl.where(mass > 0, cc, -1), axis=0)
    hit = first < BLOCK_C
    c = tl.where(hit, first, last)
    before = tl.sum(tl.where(cc < c, mass, 0.0), axis=0)
    return c, before, tl.where(hit, target, float("inf"))


@device_helper
def _scan_chunk(logit_ptr, q_ptr, row_off, q_off, c, chunk, V, temp, M, Z, before, target,
                RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse CDF inside chunk c: the first id whose cumulative weight (starting at `before`)
    exceeds target, or (no crossing at all) the last id with weight > 0. Weights are exp(x - M), or
    max(p - q, 0) with p = exp(x - M) / Z for the residual."""
    found = NO_ID
    last_pos = -1
    run = before
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, V), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M)
        if RESIDUAL:
            q = tl.load(q_ptr + q_off + offs, mask=offs < V, other=0.0).to(tl.float32)
            w = tl.maximum(w / Z - q, 0.0)
        cum = run + tl.cumsum(w, axis=0)
        found = tl.minimum(found, tl.min(tl.where((cum > target) & (offs < V), offs, NO_ID), axis=0))
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run = run + tl.sum(w, axis=0)
    return tl.where(found != NO_ID, found, last_pos)


@device_helper
def _residual_masses(logit_ptr, q_ptr, row_off, q_off, chunk, nch, V, temp, M, Z, BLOCK_C: tl.constexpr,
                     BLOCK: tl.constexpr):
    """sum(max(p - q, 0)) per chunk of the row (p = exp(x - M) / Z)."""
    cc = tl.arange(0, BLOCK_C)
    rc = tl.zeros((BLOCK_C,), tl.float32)
    for c in range(0, nch):
        r = 0.0
        for start in range(c * chunk, tl.minimum(c * chunk + chunk, V), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            p = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M) / Z
            q = tl.load(q_ptr + q_off + offs, mask=offs < V, other=0.0).to(tl.float32)
            r += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        rc = tl.where(cc == c, r, rc)
    return rc


@device_helper
def _walk(dec_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, b, N, BLOCK_NODES: tl.constexpr):
    """From the root, follow each node's published (token, next child) until a node has no next:
    its token is the bonus. A next child has a higher index than its node, so one ascending pass
    over the nodes meets the path in order; the loads do not depend on the walk. Only used nodes
    are reached (a child's parent is a node), and their rows all published a decision. The outputs
    are built in registers and written as vectors after the loop: scalar stores kept Triton's
    thread-0 predicate live through the whole kernel, which ptxas spilled on sm_80."""
    dec = dec_ptr + b.to(tl.int64) * N * 2
    idx = tl.arange(0, BLOCK_NODES)
    accepted = tl.full((BLOCK_NODES,), -1, tl.int32)
    emitted = tl.full((BLOCK_NODES,), -1, tl.int32)
    t = tl.load(dec, cache_modifier=".cg")
    child = tl.load(dec + 1, cache_modifier=".cg")
    u = 0
    n = 0
    for i in range(1, N):
        t_i = tl.load(dec + i * 2, cache_modifier=".cg")
        child_i = tl.load(dec + i * 2 + 1, cache_modifier=".cg")
        hit = i == child
        accepted = tl.where(hit & (idx == n), i, accepted)
        emitted = tl.where(hit & (idx == n), t, emitted)
        n = tl.where(hit, n + 1, n)
        u = tl.where(hit, i, u)
        t = tl.where(hit, t_i, t)
        child = tl.where(hit, child_i, child)
    emitted = tl.where(idx == n, t, emitted)  # the bonus
    out = b.to(tl.int64) * N
    tl.store(acc_ptr + out + idx, accepted, mask=idx < N)
    tl.store(out_ptr + out + idx, emitted.to(tl.int64), mask=idx < N)
    tl.store(len_ptr + b + idx, tl.full((BLOCK_NODES,), 0, tl.int32) + n, mask=idx == 0)
    tl.store(last_ptr + b + idx, tl.full((BLOCK_NODES,), 0, tl.int32) + u, mask=idx == 0)


@triton.jit
def _verify(tok_ptr, par_ptr, logit_ptr, q_ptr, temp_ptr, unif_ptr, max_ptr, sum_ptr, arg_ptr, dec_ptr, cnt_ptr,
            len_ptr, acc_ptr, out_ptr, last_ptr, N, V, chunk, nch, s_b, s_n, sq_b, sq_n,
            HAS_TEMP: tl.constexpr, HAS_DRAFT: tl.constexpr, BLOCK_NODES: tl.constexpr, BLOCK_C: tl.constexpr,
            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    b = row // N
    u = row % N
    row_off = b.to(tl.int64) * s_b + u.to(tl.int64) * s_n
    stat = row.to(tl.int64) * nch
    temp = 0.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + b)
    # padding slots are never visited by the walk: their rows load nothing (the test is repeated in
    # phase 2 rather than kept live: sm_80 spilled the predicate)
    hi = tl.where((u == 0) | (tl.load(par_ptr + row) >= 0), tl.minimum(c * chunk + chunk, V), c * chunk)

    # phase 1: this chunk's statistics
    m = float("-inf")
    s = 0.0
    arg = 0
    for start in range(c * chunk, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _row_values(logit_ptr, row_off, offs, V, temp)
        bm = tl.max(x, axis=0)
        barg = tl.min(tl.where(x == bm, offs, NO_ID), axis=0)
        arg = tl.where(bm > m, barg, arg)  # strictly greater: ties keep the lower id
        m_new = tl.maximum(m, bm)
        if HAS_TEMP:  # only sampling rows read the mass: a greedy-only call skips one exp per logit
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    tl.store(max_ptr + stat + c, m)
    if HAS_TEMP:
        tl.store(sum_ptr + stat + c, s)
    tl.store(arg_ptr + stat + c, arg)
    tl.debug_barrier()  # every thread's stores before the release (see the design note)
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == nch - 1:
        # phase 2: the row's last program decides the row
        tl.store(cnt_ptr + row, 0)
        if (u == 0) | (tl.load(par_ptr + row) >= 0):
            idx = tl.arange(0, BLOCK_NODES)
            kids = (tl.load(par_ptr + b * N + idx, mask=idx < N, other=-2) == u) & (idx > 0)
            tokens = tl.load(tok_ptr + b.to(tl.int64) * N + idx, mask=idx < N, other=-1).to(tl.int32)
            nxt = BLOCK_NODES
            t = -1  # a sampling row with no distribution (all -inf or some NaN logits): bonus -1, stop
            if temp == 0:  # greedy: first maximum over the chunks
                cc = tl.arange(0, BLOCK_C)
                cm = tl.load(max_ptr + stat + cc, mask=cc < nch, other=float("-inf"), cache_modifier=".cg")
                ca = tl.load(arg_ptr + stat + cc, mask=cc < nch, other=NO_ID, cache_modifier=".cg")
                t = tl.min(tl.where(cm == tl.max(cm, axis=0), ca, NO_ID), axis=0)
                nxt = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
            elif HAS_TEMP:
                # Only a launch with temperatures has sampling rows. Without them temp is the constant 0
                # and uniforms/draft_probs are None (constexpr): this branch must not be generated then,
                # since `temp == 0` is a runtime test and the compiler would still build the loads
                # through a None pointer (the first GPU run: the greedy launch did not compile).
                M, mass, Z = _row_total(max_ptr, sum_ptr, stat, nch, BLOCK_C)
                if Z > 0:
                    from_p = True
                    q_off = b.to(tl.int64) * sq_b + u.to(tl.int64) * sq_n
                    if HAS_DRAFT:
                        child = tl.min(tl.where(kids, idx, BLOCK_NODES), axis=0)
                        if child < BLOCK_NODES:
                            x = tl.sum(tl.where(idx == child, tokens, 0), axis=0)
                            x_ok = (x >= 0) & (x < V)  # an unchecked bad draft token is rejected, never read
                            x = tl.where(x_ok, x, 0)
                            px = tl.exp(tl.load(logit_ptr + row_off + x).to(tl.float32) / temp - M) / Z
                            qx = tl.load(q_ptr + q_off + x).to(tl.float32)
                            u0 = tl.load(unif_ptr + row.to(tl.int64) * 2)
                            if x_ok & (qx > 0) & (u0 < px / qx):
                                t = x
                                nxt = child
                                from_p = False
                            else:
                                rc = _residual_masses(logit_ptr, q_ptr, row_off, q_off, chunk, nch, V, temp, M, Z,
                                                      BLOCK_C, BLOCK)
                                total = tl.sum(rc, axis=0)
                                if total > 0:  # p == q leaves no residual: sample from p
                                    target = tl.load(unif_ptr + row.to(tl.int64) * 2 + 1) * total
                                    cross, before, target = _crossing_chunk(rc, target, nch, BLOCK_C)
                                    t = _scan_chunk(logit_ptr, q_ptr, row_off, q_off, cross, chunk, V, temp, M, Z,
                                                    before, target, True, BLOCK)
                                    from_p = False
                    if from_p:
                        # without draft_probs a row samples with uniform 0; with them, only the leaf and
                        # the p == q fallback sample from p, with uniform 1
                        target = tl.load(unif_ptr + row.to(tl.int64) * 2 + (1 if HAS_DRAFT else 0)) * Z
                        cross, before, target = _crossing_chunk(mass, target, nch, BLOCK_C)
                        t = _scan_chunk(logit_ptr, q_ptr, row_off, q_off, cross, chunk, V, temp, M, Z, before,
                                        target, False, BLOCK)
                        if not HAS_DRAFT:
                            nxt = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
            tl.store(dec_ptr + row.to(tl.int64) * 2, t)
            tl.store(dec_ptr + row.to(tl.int64) * 2 + 1, tl.where(nxt < BLOCK_NODES, nxt, -1))
        tl.debug_barrier()
        req_cnt = cnt_ptr + tl.num_programs(0) + b  # after the B * N row counters
        if tl.atomic_add(req_cnt, 1, sem="acq_rel", scope="gpu") == N - 1:
            # phase 3: the request's last decided row walks its tree
            tl.store(req_cnt, 0)
            _walk(dec_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, b, N, BLOCK_NODES)


# (num_warps, num_stages): the chunk loop streams; the pipeliner leaves these plain loads alone
LAUNCH = (4, 3)
# Register cap for calls with sampling rows. Left alone, ptxas fits the sampling variants in 64-80
# registers by saving predicates to the stack around its convergence subroutines (8-16 B/thread on
# sm_80 and sm_90); with a cap of 128 it takes 72-113 and saves none (4-7 programs of 4 warps per SM
# instead of 6-8). Greedy-only calls take 32-48 registers either way.
SAMPLING_MAXNREG = 128
MAX_CHUNK = 16384
MIN_COUNTERS = 1 << 16  # B * N + B up to 64 K without regrowing (256 KiB)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # captured graphs may still hold their addresses


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for one launch on `device` (the kernel leaves them zero)."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    fresh = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh  # graph-private memory: its zeroing replays with the graph, so it is not cached
    if buf is not None:
        _OUTGROWN.append(buf)
    _COUNTERS[device] = fresh
    return fresh


def chunk_size(rows: int, V: int, sms: int) -> int:
    """Ids per program: >= 4 programs per SM over the whole batch, 1..16 K-element vector steps."""
    want = rows * V // (4 * sms)
    return min(MAX_CHUNK, max(BLOCK, want // BLOCK * BLOCK))


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None,
                chunk=None):
    """`chunk` (tests only) overrides the ids per program, to put many programs on a row at a small V."""
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
    nch = triton.cdiv(V, chunk)
    cmax = torch.empty(rows, nch, dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    carg = torch.empty(rows, nch, dtype=torch.int32, device=dev)
    decision = torch.empty(rows, 2, dtype=torch.int32, device=dev)  # (token, next child or -1)
    counters = _counters(dev, rows + B)
    # validation lets temperature come without uniforms only when every row is greedy
    has_temp = temperature is not None and uniforms is not None
    has_draft = draft_probs is not None
    sq_b, sq_n = (draft_probs.stride(0), draft_probs.stride(1)) if has_draft else (0, 0)
    _verify[(rows, nch)](draft_tokens, parents, target_logits, draft_probs, temperature, uniforms, cmax, csum, carg,
                         decision, counters, accept_len, accepted, tokens, last, N, V, chunk, nch,
                         target_logits.stride(0), target_logits.stride(1), sq_b, sq_n,
                         HAS_TEMP=has_temp, HAS_DRAFT=has_draft, BLOCK_NODES=pow2_at_least(N, 2),
                         BLOCK_C=pow2_at_least(nch, 2), BLOCK=min(BLOCK, chunk), num_warps=LAUNCH[0],
                         num_stages=LAUNCH[1], maxnreg=SAMPLING_MAXNREG if has_temp else None)
    return VerifyResult(accept_len, accepted, tokens, last)
