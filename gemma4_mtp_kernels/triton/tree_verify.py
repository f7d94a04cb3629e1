"""Triton `tree_verify` (SPEC §4.4): one launch for the whole batch.

Design. The cost is reading B * N * V logits (0.5 MiB per node in bf16 at V = 262144); the tree walk
itself is a few scalar steps. Each node's row is cut into chunks of `chunk` ids (one program each),
and each chunk into granules of BLOCK ids (one loop step). Work items, in this order:
A. (row, chunk) for every row: the program streams its chunk (logits / temperature for sampling rows)
   and publishes each granule's max, first argmax and (when any row may sample) sum of exp(x - max).
   The last program of the row to finish (a per-row counter) decides the row from the granule
   statistics: the token t (greedy: first argmax; sampling: inverse CDF, locating the crossing
   granule from the granule masses and rescanning only that granule; a sampling row with no
   distribution -- all -inf or NaN logits, unchecked on the GPU -- gives t = -1) and the child the
   walk continues to (the lowest-index child holding t; with draft_probs the chain child when
   u0 < p(x) / q(x) and q(x) > 0; a leaf samples p with uniform 1). It publishes (t, next child or -1).
B. Launches with draft_probs only: (row, chunk) again. A rejected node draws its bonus from
   normalize(max(p - q, 0)), whose mass needs a second pass over the row's logits and q once the
   row's softmax maximum and normaliser are known. Every program takes its work item from a ticket
   counter, so a B item is handed out only after every A item; a B program waits (spinning on the
   row's state word) until its row is decided, then sums the residual of each granule of its chunk;
   the row's last B program locates the crossing granule and rescans it. Waiting cannot deadlock: a
   program waits only for items with lower tickets, whose programs already run and never wait for
   higher ones (the single-pass scan argument). Rows that need no residual are final after A; their
   B programs only count.
C. The last row of each request to become final (a per-request counter) walks that request's tree
   from the published decisions and writes its outputs. Requests walk in parallel.
Padding rows are read like the others (their decision is never visited): gating the loads on
parents[u] would put a dependent DRAM round trip in front of every program's loads.
Counters. One zeroed int32 buffer per device and stream (B * N row counters for A, B * N for B, B * N
row states, B request counters, the ticket), cached and grown on demand (`gemma4_mtp_kernels._counters`,
which says which overlapping launches it keeps apart): every counter is reset to 0 by the program that
consumed it last, so no per-call memset is needed and the launch replays in a CUDA graph.
Ordering (the interpreter runs programs one after another, in ticket order, so only this argument
covers it). A program's published values are scalar stores; `tl.debug_barrier()` (bar.sync) then
orders every thread's stores before the counter increment, an `atom.acq_rel.gpu` issued by one
thread (`_common.last_to_arrive`, which every kernel's last-program election calls; release is
cumulative over what the barrier made that thread observe, the pattern of cooperative groups' grid
sync). A counter is only ever changed by these read-modify-writes until it
reaches its total, so the program that reads total - 1 reads the end of a chain of RMWs that
contains every other program's release: each of them synchronizes with its acquire. A row state is
written with a release exchange and read with acquire RMWs. Triton hands the atomic's result to the
other threads through shared memory behind a barrier, so every thread's later loads of the
published values follow the acquire in causality order and see the writes of this launch, never the
previous launch's; they are `.cg` loads (L2, no L1 copy) besides. The resets are plain stores after
the last RMW of their counter in this launch; the next launch runs after this one ends.
Expected on H100/H200: A reads every logit once (B * N * V * 2 bytes: 2.6 MB for B = 1, N = 5,
~0.6 us of traffic, so small batches are launch-latency bound; 64 rows and up are bandwidth bound).
The decisions add one granule rescan per sampling row (L2) and an L2 round trip per counter; B reads
q once and the logits a second time (mostly from L2). See benchmarks/README.md for the predictions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._counters import zeroed_counters
from .._types import VerifyResult
from ._common import cdiv, device_helper, last_to_arrive, num_sms, pow2_at_least

BLOCK = 2048  # ids per step and per granule: 16 elements (two 16-byte bf16 loads) per thread at 4 warps
NO_ID = tl.constexpr(2147483647)  # "no id": above every vocabulary id


@device_helper
def _row_values(logit_ptr, row_off, offs, V, temp):
    """x = logits / temperature (greedy rows divide by 1: exact), -inf past V. A division rather
    than a select keeps the row's kind out of the predicate registers (sm_80 spilled them)."""
    x = tl.load(logit_ptr + row_off + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x / tl.where(temp > 0, temp, 1.0)


@device_helper
def _row_total(max_ptr, sum_ptr, stat, G, BLOCK_G: tl.constexpr):
    """(M, per-granule mass exp-rescaled to M, Z) of one row from its published granule statistics."""
    gg = tl.arange(0, BLOCK_G)
    gm = tl.load(max_ptr + stat + gg, mask=gg < G, other=float("-inf"), cache_modifier=".cg")
    gs = tl.load(sum_ptr + stat + gg, mask=gg < G, other=0.0, cache_modifier=".cg")
    M = tl.max(gm, axis=0)
    mass = tl.where(gm == float("-inf"), 0.0, gs * tl.exp(gm - M))
    return M, mass, tl.sum(mass, axis=0)


@device_helper
def _crossing_granule(mass, target, G, BLOCK_G: tl.constexpr):
    """(granule, mass before it, target for the granule scan) where the cumulative mass first exceeds
    target; if rounding leaves the total at or below target, the last granule with mass (the
    reference's fallback) and an infinite target, so that the scan returns its last id with mass
    (a float rather than a flag: a predicate live across the scan spilled on sm_80)."""
    gg = tl.arange(0, BLOCK_G)
    incl = tl.cumsum(mass, axis=0)
    first = tl.min(tl.where((incl > target) & (gg < G), gg, BLOCK_G), axis=0)
    last = tl.max(tl.where(mass > 0, gg, -1), axis=0)
    hit = first < BLOCK_G
    g = tl.where(hit, first, last)
    before = tl.sum(tl.where(gg < g, mass, 0.0), axis=0)
    return g, before, tl.where(hit, target, float("inf"))


@device_helper
def _residual(logit_ptr, q_ptr, row_off, q_off, offs, V, temp, M, Z):
    """max(p - q, 0) at offs, p = exp(x - M) / Z."""
    p = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M) / Z
    q = tl.load(q_ptr + q_off + offs, mask=offs < V, other=0.0).to(tl.float32)
    return tl.maximum(p - q, 0.0)


@device_helper
def _scan_granule(logit_ptr, q_ptr, row_off, q_off, g, V, temp, M, Z, before, target, RESIDUAL: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Inverse CDF inside granule g: the first id whose cumulative weight (starting at `before`)
    exceeds target, or (no crossing at all) the last id with weight > 0. Weights are exp(x - M), or
    max(p - q, 0) with p = exp(x - M) / Z for the residual."""
    offs = g * BLOCK + tl.arange(0, BLOCK)
    if RESIDUAL:
        w = _residual(logit_ptr, q_ptr, row_off, q_off, offs, V, temp, M, Z)
    else:
        w = tl.exp(_row_values(logit_ptr, row_off, offs, V, temp) - M)
    cum = before + tl.cumsum(w, axis=0)
    found = tl.min(tl.where((cum > target) & (offs < V), offs, NO_ID), axis=0)
    last_pos = tl.max(tl.where(w > 0, offs, -1), axis=0)
    return tl.where(found != NO_ID, found, last_pos)


@device_helper
def _sample(logit_ptr, q_ptr, row_off, q_off, mass, total, uniform, V, G, temp, M, Z, RESIDUAL: tl.constexpr,
            BLOCK_G: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse CDF with `uniform` over the row (granule masses summing to `total`)."""
    g, before, target = _crossing_granule(mass, uniform * total, G, BLOCK_G)
    return _scan_granule(logit_ptr, q_ptr, row_off, q_off, g, V, temp, M, Z, before, target, RESIDUAL, BLOCK)


@device_helper
def _walk(dec_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, b, N, BLOCK_NODES: tl.constexpr):
    """From the root, follow each node's published (token, next child) until a node has no next:
    its token is the bonus. A next child has a higher index than its node, so one ascending pass
    over the nodes meets the path in order. Only used nodes are reached (a child's parent is a node),
    and their rows all published a decision. The decisions are loaded once as vectors (one L2 round
    trip, not one per node) and the outputs built in registers and written as vectors after the
    loop: scalar stores kept Triton's thread-0 predicate live through the whole kernel, which ptxas
    spilled on sm_80."""
    dec = dec_ptr + b.to(tl.int64) * N * 2
    idx = tl.arange(0, BLOCK_NODES)
    toks = tl.load(dec + idx * 2, mask=idx < N, other=-1, cache_modifier=".cg")
    kids = tl.load(dec + idx * 2 + 1, mask=idx < N, other=-1, cache_modifier=".cg")
    accepted = tl.full((BLOCK_NODES,), -1, tl.int32)
    emitted = tl.full((BLOCK_NODES,), -1, tl.int32)
    t = tl.sum(tl.where(idx == 0, toks, 0), axis=0)
    child = tl.sum(tl.where(idx == 0, kids, 0), axis=0)
    u = 0
    n = 0
    for i in range(1, N):
        hit = i == child
        accepted = tl.where(hit & (idx == n), i, accepted)
        emitted = tl.where(hit & (idx == n), t, emitted)
        n = tl.where(hit, n + 1, n)
        u = tl.where(hit, i, u)
        t = tl.where(hit, tl.sum(tl.where(idx == i, toks, 0), axis=0), t)
        child = tl.where(hit, tl.sum(tl.where(idx == i, kids, 0), axis=0), child)
    emitted = tl.where(idx == n, t, emitted)  # the bonus
    out = b.to(tl.int64) * N
    tl.store(acc_ptr + out + idx, accepted, mask=idx < N)
    tl.store(out_ptr + out + idx, emitted.to(tl.int64), mask=idx < N)
    tl.store(len_ptr + b + idx, tl.full((BLOCK_NODES,), 0, tl.int32) + n, mask=idx == 0)
    tl.store(last_ptr + b + idx, tl.full((BLOCK_NODES,), 0, tl.int32) + u, mask=idx == 0)


@device_helper
def _finish(dec_ptr, cnt_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, row, b, N, R, t, nxt, BLOCK_NODES: tl.constexpr):
    """Publishes the row's final decision; the request's last final row walks the request."""
    tl.store(dec_ptr + row.to(tl.int64) * 2, t)
    tl.store(dec_ptr + row.to(tl.int64) * 2 + 1, nxt)
    req_cnt = cnt_ptr + 3 * R + b  # after the row counters (A, B) and the row states
    if last_to_arrive(req_cnt, N):
        tl.store(req_cnt, 0)
        _walk(dec_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, b, N, BLOCK_NODES)


@triton.jit(do_not_specialize=["R", "N"])
def _verify(tok_ptr, par_ptr, logit_ptr, q_ptr, temp_ptr, unif_ptr, max_ptr, sum_ptr, arg_ptr, res_ptr, mz_ptr,
            dec_ptr, cnt_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, R, N, V, chunk, nch, G, s_b, s_n, sq_b, sq_n,
            HAS_TEMP: tl.constexpr, HAS_DRAFT: tl.constexpr, BLOCK_NODES: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK: tl.constexpr):
    items = R * nch
    if HAS_DRAFT:
        # work items in ticket order (all of A, then B): a B program may wait for A items only
        ticket_ptr = cnt_ptr + 3 * R + R // N
        ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
        if ticket == 2 * items - 1:  # the last ticket: every other one was taken
            tl.store(ticket_ptr, 0)
    else:
        ticket = tl.program_id(0)
    item = ticket % items
    row = item // nch
    c = item % nch
    b = row // N
    u = row % N
    row_off = b.to(tl.int64) * s_b + u.to(tl.int64) * s_n
    q_off = b.to(tl.int64) * sq_b + u.to(tl.int64) * sq_n
    stat = row.to(tl.int64) * G
    state_ptr = cnt_ptr + 2 * R + row
    temp = 0.0
    if HAS_TEMP:
        temp = tl.load(temp_ptr + b)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, V)

    if ticket < items:
        # A: the statistics of this chunk's granules
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _row_values(logit_ptr, row_off, offs, V, temp)
            gm = tl.max(x, axis=0)
            g = start // BLOCK
            tl.store(max_ptr + stat + g, gm)
            tl.store(arg_ptr + stat + g, tl.min(tl.where(x == gm, offs, NO_ID), axis=0))
            if HAS_TEMP:  # only sampling rows read the mass: a greedy-only call skips one exp per logit
                shift = tl.where(gm == float("-inf"), 0.0, gm)
                tl.store(sum_ptr + stat + g, tl.sum(tl.exp(x - shift), axis=0))
        if last_to_arrive(cnt_ptr + row, nch):
            # the row's last program decides the row
            tl.store(cnt_ptr + row, 0)
            t = -1  # a sampling row with no distribution (all -inf or some NaN logits): bonus -1, stop
            nxt = BLOCK_NODES
            state = 1  # final
            M = 0.0
            Z = 0.0
            if (u == 0) | (tl.load(par_ptr + row) >= 0):
                idx = tl.arange(0, BLOCK_NODES)
                kids = (tl.load(par_ptr + b * N + idx, mask=idx < N, other=-2) == u) & (idx > 0)
                tokens = tl.load(tok_ptr + b.to(tl.int64) * N + idx, mask=idx < N, other=-1).to(tl.int32)
                if temp == 0:  # greedy: first maximum over the granules
                    gg = tl.arange(0, BLOCK_G)
                    gm = tl.load(max_ptr + stat + gg, mask=gg < G, other=float("-inf"), cache_modifier=".cg")
                    ga = tl.load(arg_ptr + stat + gg, mask=gg < G, other=NO_ID, cache_modifier=".cg")
                    t = tl.min(tl.where(gm == tl.max(gm, axis=0), ga, NO_ID), axis=0)
                    nxt = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
                elif HAS_TEMP:
                    # Only a launch with temperatures has sampling rows. Without them temp is the constant 0
                    # and uniforms/draft_probs are None (constexpr): this branch must not be generated then,
                    # since `temp == 0` is a runtime test and the compiler would still build the loads
                    # through a None pointer (the first GPU run: the greedy launch did not compile).
                    M, mass, Z = _row_total(max_ptr, sum_ptr, stat, G, BLOCK_G)
                    if Z > 0:
                        from_p = True
                        if HAS_DRAFT:
                            child = tl.min(tl.where(kids, idx, BLOCK_NODES), axis=0)
                            if child < BLOCK_NODES:
                                from_p = False
                                x = tl.sum(tl.where(idx == child, tokens, 0), axis=0)
                                x_ok = (x >= 0) & (x < V)  # an unchecked bad draft token is rejected, never read
                                x = tl.where(x_ok, x, 0)
                                px = tl.exp(tl.load(logit_ptr + row_off + x).to(tl.float32) / temp - M) / Z
                                qx = tl.load(q_ptr + q_off + x).to(tl.float32)
                                u0 = tl.load(unif_ptr + row.to(tl.int64) * 2)
                                if x_ok & (qx > 0) & (u0 < px / qx):
                                    t = x
                                    nxt = child
                                else:
                                    state = 2  # B draws the bonus from the residual
                        if from_p:
                            # without draft_probs a row samples with uniform 0; with them only the leaf
                            # samples from p, with uniform 1
                            uni = tl.load(unif_ptr + row.to(tl.int64) * 2 + (1 if HAS_DRAFT else 0))
                            t = _sample(logit_ptr, q_ptr, row_off, q_off, mass, Z, uni, V, G, temp, M, Z, False,
                                        BLOCK_G, BLOCK)
                            if not HAS_DRAFT:
                                nxt = tl.min(tl.where(kids & (tokens == t), idx, BLOCK_NODES), axis=0)
            nxt = tl.where(nxt < BLOCK_NODES, nxt, -1)
            if HAS_DRAFT:
                tl.store(mz_ptr + row.to(tl.int64) * 2, M)
                tl.store(mz_ptr + row.to(tl.int64) * 2 + 1, Z)
                tl.debug_barrier()
                tl.atomic_xchg(state_ptr, state, sem="release", scope="gpu")
            if state == 1:
                _finish(dec_ptr, cnt_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, row, b, N, R, t, nxt, BLOCK_NODES)
    elif HAS_DRAFT:
        # B: wait for the row's decision (its A items all have lower tickets)
        state = tl.atomic_add(state_ptr, 0, sem="acquire", scope="gpu")
        while state == 0:
            state = tl.atomic_add(state_ptr, 0, sem="acquire", scope="gpu")
        if state == 2:
            M = tl.load(mz_ptr + row.to(tl.int64) * 2, cache_modifier=".cg")
            Z = tl.load(mz_ptr + row.to(tl.int64) * 2 + 1, cache_modifier=".cg")
            for start in range(lo, hi, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                r = tl.sum(_residual(logit_ptr, q_ptr, row_off, q_off, offs, V, temp, M, Z), axis=0)
                tl.store(res_ptr + stat + start // BLOCK, r)
        if last_to_arrive(cnt_ptr + R + row, nch):
            tl.store(cnt_ptr + R + row, 0)
            tl.store(state_ptr, 0)  # every B program of the row has read it
            if state == 2:
                M = tl.load(mz_ptr + row.to(tl.int64) * 2, cache_modifier=".cg")
                Z = tl.load(mz_ptr + row.to(tl.int64) * 2 + 1, cache_modifier=".cg")
                uni = tl.load(unif_ptr + row.to(tl.int64) * 2 + 1)
                gg = tl.arange(0, BLOCK_G)
                rg = tl.load(res_ptr + stat + gg, mask=gg < G, other=0.0, cache_modifier=".cg")
                total = tl.sum(rg, axis=0)
                if total > 0:
                    t = _sample(logit_ptr, q_ptr, row_off, q_off, rg, total, uni, V, G, temp, M, Z, True, BLOCK_G,
                                BLOCK)
                else:  # p == q leaves no residual (rejection is then impossible in exact arithmetic): sample p
                    M, mass, Z = _row_total(max_ptr, sum_ptr, stat, G, BLOCK_G)
                    t = _sample(logit_ptr, q_ptr, row_off, q_off, mass, Z, uni, V, G, temp, M, Z, False, BLOCK_G,
                                BLOCK)
                _finish(dec_ptr, cnt_ptr, len_ptr, acc_ptr, out_ptr, last_ptr, row, b, N, R, t, -1, BLOCK_NODES)


# (num_warps, num_stages): the chunk loop streams; the pipeliner leaves these plain loads alone
LAUNCH = (4, 3)
# Register cap for calls with sampling rows. Left alone, ptxas fits the sampling variants in 64-80
# registers by saving predicates to the stack around its convergence subroutines (8-16 B/thread on
# sm_80 and sm_90); with a cap of 128 it takes 72-113 and saves none (4-7 programs of 4 warps per SM
# instead of 6-8). Greedy-only calls take 32-48 registers either way.
SAMPLING_MAXNREG = 128
MAX_CHUNK = 16384
COUNTER_OWNER = "triton.tree_verify"  # its cached counters in gemma4_mtp_kernels._counters
# Programs per SM a launch should have at least: a step's loads are not pipelined, so each program
# keeps one step (4 KB of bf16) in flight; greedy programs (32-56 registers, 4 warps, depending on
# the Triton version and target) fit 9-16 per SM, 36-64 KB in flight, enough for the copy bandwidth.
PROGRAMS_PER_SM = 12


def chunk_size(rows: int, V: int, sms: int) -> int:
    """Ids per program: >= PROGRAMS_PER_SM programs per SM over the whole batch, 1..8 steps."""
    want = rows * V // (PROGRAMS_PER_SM * sms)
    return min(MAX_CHUNK, max(BLOCK, want // BLOCK * BLOCK))


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None,
                chunk=None):
    """`chunk` (tests only: a power of two below BLOCK or a multiple of it) overrides the ids per
    program, to put many programs on a row at a small V."""
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
    if chunk % block or block & (block - 1):
        raise ValueError(f"tree_verify: chunk must be a power of two below {BLOCK} or a multiple of it, got {chunk}")
    nch = cdiv(V, chunk)
    G = cdiv(V, block)  # granules per row
    gmax = torch.empty(rows, G, dtype=torch.float32, device=dev)
    gsum = torch.empty_like(gmax)
    garg = torch.empty(rows, G, dtype=torch.int32, device=dev)
    decision = torch.empty(rows, 2, dtype=torch.int32, device=dev)  # (token, next child or -1)
    has_temp = temperature is not None and uniforms is not None  # validation: else every row is greedy
    has_draft = draft_probs is not None and has_temp  # only sampling rows read q (no launch without uniforms)
    # draft launches: residual mass per granule, and each row's (max, normaliser) for phase B
    gres = torch.empty_like(gmax) if has_draft else None
    mz = torch.empty(rows, 2, dtype=torch.float32, device=dev) if has_draft else None
    counters = zeroed_counters(dev, 3 * rows + B + 1, COUNTER_OWNER)
    sq_b, sq_n = (draft_probs.stride(0), draft_probs.stride(1)) if has_draft else (0, 0)
    items = rows * nch * (2 if has_draft else 1)
    _verify[(items,)](draft_tokens, parents, target_logits, draft_probs, temperature, uniforms, gmax, gsum, garg, gres,
                      mz, decision, counters, accept_len, accepted, tokens, last, rows, N, V, chunk, nch, G,
                      target_logits.stride(0), target_logits.stride(1), sq_b, sq_n,
                      HAS_TEMP=has_temp, HAS_DRAFT=has_draft, BLOCK_NODES=pow2_at_least(N, 2),
                      BLOCK_G=pow2_at_least(G, 2), BLOCK=block, num_warps=LAUNCH[0],
                      num_stages=LAUNCH[1], maxnreg=SAMPLING_MAXNREG if has_temp else None)
    return VerifyResult(accept_len, accepted, tokens, last)
