"""Triton `softmax_sample`: q = softmax(logits / temperature) written, and a token per row drawn from it
at a given uniform (inverse CDF), in two launches for the whole batch.

Design. At V = 262144 a row is 1 MiB of fp32 logits; one program per row would stream it at a single
SM's rate (~10 us). Each row is cut into chunks of CHUNK ids, one program each (64 per row at V =
262144), in both launches:
1. `_chunk_stats_kernel`: the chunk's maximum of x = logits / temperature and its sum of exp(x - max).
2. `_probs_kernel`: every program of a row reads the row's chunk statistics (P pairs, from L2), so all
   of them agree on M and Z = sum_c s_c exp(m_c - M); writes q = exp(x - M) / Z for its chunk and the
   chunk's mass (the fp64 sum of its q values); the last program of the row to finish (a per-row
   counter: bar.sync, one atom.acq_rel.gpu, .cg loads, the counter reset by its consumer so that the
   launch replays in a CUDA graph; tree_verify's pattern) finds the chunk where the fp64 cumulative
   mass first exceeds u, reads that chunk's q back and scans it in fp64: the token is the first id
   whose cumulative probability exceeds u, or (rounding left the total at or below u) the last id with
   q > 0, or -1 for a row without a distribution (NaN / all -inf logits): the reference's rule, with
   the cumulative sums added chunk by chunk instead of id by id (the same to fp64 rounding).
A grid-wide wait for the row statistics would save the second launch but needs every program of a row
resident; two launches under programmatic dependent launch cost ~1.5 us more.
Expected on H100/H200: the logits read twice (the second time mostly from L2) and q written once:
3 MiB per row at V = 262144, ~1 us of bandwidth at B = 1 (launch bound, ~4-5 us for the two launches),
~6 us at B = 8; against ~14 launches of torch ops (softmax, copy, fp64 cumsum, searchsorted, the
fallback's where / amax) and ~10 MiB per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._counters import zeroed_counters
from ._common import cdiv, last_to_arrive, pdl_args, pow2_at_least, wait_for_inputs

COUNTER_OWNER = "triton.softmax_sample"  # its cached counters in gemma4_mtp_kernels._counters
CHUNK = 4096  # ids per program: 32 fp32 values per thread at 4 warps
NO_ID = tl.constexpr(2147483647)


@triton.jit
def _chunk_stats_kernel(logit_ptr, temp_ptr, stat_ptr, V, s_logit, s_temp, CHUNK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    temp = tl.load(temp_ptr + row * s_temp)
    x = tl.load(logit_ptr + row.to(tl.int64) * s_logit + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = x / temp
    m = tl.max(x, axis=0)
    # an all -inf chunk has no mass (its exp(x - m) would be NaN)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    P = tl.num_programs(1)
    tl.store(stat_ptr + (row * P + c) * 2, m)
    tl.store(stat_ptr + (row * P + c) * 2 + 1, s)


@triton.jit
def _probs_kernel(logit_ptr, temp_ptr, u_ptr, stat_ptr, mass_ptr, cnt_ptr, q_ptr, tok_ptr, V, s_logit, s_temp, s_u,
                  s_q, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    P = tl.num_programs(1)
    pp = tl.arange(0, BLOCK_P)
    gm = tl.load(stat_ptr + (row * P + pp) * 2, mask=pp < P, other=float("-inf"))
    gs = tl.load(stat_ptr + (row * P + pp) * 2 + 1, mask=pp < P, other=0.0)
    M = tl.max(gm, axis=0)
    Z = tl.sum(tl.where(gm == float("-inf"), 0.0, gs * tl.exp(gm - M)), axis=0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    temp = tl.load(temp_ptr + row * s_temp)
    x = tl.load(logit_ptr + row.to(tl.int64) * s_logit + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    q = tl.exp(x / temp - M) / Z
    q_row = q_ptr + row.to(tl.int64) * s_q
    tl.store(q_row + offs, q, mask=offs < V)
    tl.store(mass_ptr + row * P + c, tl.sum(tl.where(offs < V, q, 0.0).to(tl.float64), axis=0))
    cnt = cnt_ptr + row
    if last_to_arrive(cnt, P):
        tl.store(cnt, 0)
        u = tl.load(u_ptr + row * s_u)
        mass = tl.load(mass_ptr + row * P + pp, mask=pp < P, other=0.0, cache_modifier=".cg")
        incl = tl.cumsum(mass, axis=0)
        first = tl.min(tl.where((incl > u) & (pp < P), pp, BLOCK_P), axis=0)
        hit = first < BLOCK_P
        g = tl.where(hit, first, tl.max(tl.where(mass > 0, pp, -1), axis=0))
        token = tl.full((), -1, tl.int64)
        if g >= 0:
            before = tl.sum(tl.where(pp < g, mass, 0.0), axis=0)
            target = tl.where(hit, u, float("inf"))
            ids = g * CHUNK + tl.arange(0, CHUNK)
            qg = tl.load(q_row + ids, mask=ids < V, other=0.0, cache_modifier=".cg")
            cum = before + tl.cumsum(qg.to(tl.float64), axis=0)
            found = tl.min(tl.where((cum > target) & (ids < V), ids, NO_ID), axis=0)
            last = tl.max(tl.where(qg > 0, ids, -1), axis=0)
            token = tl.where(found != NO_ID, found, last).to(tl.int64)
        tl.store(tok_ptr + row, token)


def launch_config(V: int) -> dict:
    """Chunks per row (P) and the padded width the statistics are read at."""
    P = cdiv(V, CHUNK)
    return dict(P=P, BLOCK_P=pow2_at_least(P, 2), CHUNK=CHUNK, num_warps=4)


def softmax_sample(logits, temperature, uniforms, *, probs_out=None):
    B, V = logits.shape
    dev = logits.device
    probs = torch.empty(B, V, dtype=torch.float32, device=dev) if probs_out is None else probs_out
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, probs
    cfg = launch_config(V)
    P = cfg["P"]
    if P > 65535:  # the chunks are the grid's second dimension
        raise ValueError(f"softmax_sample: logits must have at most {65535 * CHUNK} columns for the triton backend, "
                         f"got {V}")
    stats = torch.empty(B, P, 2, dtype=torch.float32, device=dev)
    mass = torch.empty(B, P, dtype=torch.float64, device=dev)
    cnt = zeroed_counters(dev, B, COUNTER_OWNER)
    pdl = pdl_args(dev)
    _chunk_stats_kernel[(B, P)](logits, temperature, stats, V, logits.stride(0), temperature.stride(0),
                                CHUNK=cfg["CHUNK"], num_warps=cfg["num_warps"], **pdl)
    _probs_kernel[(B, P)](logits, temperature, uniforms, stats, mass, cnt, probs, tokens, V, logits.stride(0),
                          temperature.stride(0), uniforms.stride(0), probs.stride(0), CHUNK=cfg["CHUNK"],
                          BLOCK_P=cfg["BLOCK_P"], num_warps=cfg["num_warps"], **pdl)
    return tokens, probs
