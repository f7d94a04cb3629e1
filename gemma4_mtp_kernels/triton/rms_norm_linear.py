"""Triton `rms_norm_linear`, and the decoder-layer prologue that `rms_norm_gate_up` and
`rms_norm_q_rope` share.

Design. A drafter layer's glue (post-norms, residual adds, layer scalar, pre-norms) is a handful of
row operations on T x Hd activations (T <= 64 tokens, Hd <= 1024: at most 128 KiB), between
projections whose weights are 0.1 to 32 MiB. Rather than launching it, every program of the
projection that consumes it recomputes it for its token tile from L2 ("prologue"):
- stats: 1 / rms of x (when a residual is added) and of h (when h is normalised), one pass each
  over the tile's rows; for one token (T = 1, `row_tile`) its row loaded whole, x, the residual, its
  norm weight and the layer scalar in one wave of loads, both statistics from those vectors;
- in the K loop, h and n for the K block: n = round(round(h * inv_rms) * w) exactly where Hugging
  Face rounds (rms_norm computes in fp32 and rounds once; the residual add and the layer scalar
  each round), then n feeds tl.dot against the weight tile.
The n-tile 0 programs (of every split) also write h / n to residual_out / normed_out in their K
loops, each K block once: the next kernel reads h as its residual, the LM head reads the final n.
The activations are read Hd / BLOCK_K + 2 times per program from L2, ~1-6 KiB per token: small
against its weight tile except at large T, where the T tiles divide it.
Projection: grid (N / BLOCK_N, T / BLOCK_T, SPLIT_K); acc[BLOCK_N, BLOCK_T] = W_tile @ n_tile^T in
fp32 via tl.dot (BLOCK_T = T rounded up to 16..64: each weight row is read once per T tile). When
N / BLOCK_N tiles cannot fill the GPU (o_proj and down_proj: N = Hd = 256..1024 rows of up to
16 K), K is split; each split writes an fp32 partial, and the last split program of a tile to
finish (a per-tile counter, as tree_verify counts: bar.sync, then one atom.acq_rel.gpu, partials
read back with .cg, the counter reset by its consumer so that the launch replays in a CUDA graph)
sums the partials in split order (deterministic) and stores the rounded tile. No second launch.
Expected on H100/H200: the weight stream dominates (31B o_proj 16-32 MiB, ~85% of copy bandwidth
with >= 2 programs per SM); E2B (0.5-1 MiB) is launch bound (~2-3 us per launch in a graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuned
from ._common import (cast, cdiv, device_helper, dot_precision, interpreting, last_to_arrive, mma, num_sms, pdl_args,
                      pow2_at_least, prefetch_weight_rows, split_epilogue, sum_splits, wait_for_inputs)
from .._counters import zeroed_counters

COUNTER_OWNER = "triton.rms_norm_linear"  # its cached counters in gemma4_mtp_kernels._counters

BLOCK_K = 64
# K blocks of the prologue's statistics loops in flight at once: each loop is unrolled this far, so that
# ptxas issues that many blocks' loads before the first of them is used (the activations come from L2;
# each wave of loads is a dependent round trip). The decode tiles (<= 16 tokens of 16-bit values: one
# 16-byte load per thread, block and tensor) take up to 16 blocks in the first loop (x) and 8 in the
# second (x, residual, its norm weight); larger tiles keep what they had (the first loop as LLVM unrolls
# it, the second by 4), which their registers allow (at 64 tokens 16 blocks made the fp16 26B
# post-projection spill on sm_80).
DECODE_UNROLL = (16, 8)
UNROLL = (None, 4)


# A one-token prologue (T = 1, a decode step at batch 1) loads its row whole, as vectors of up to this many
# columns (8 fp32 values a thread per tensor at 4 warps): x, the residual and its norm weight in one wave.
ROW_K_MAX = 1024


def row_tile(T: int, H: int, flags: dict) -> int:
    """ROW_K, the kernel constexpr of the one-token prologue: the row's columns as a power of two when T
    is 1 and the call has a prologue whose row fits ROW_K_MAX, else 0 (the statistics loops). sm_90 SASS
    at T = 1 with a residual: one wave of loads before the K loop where the loops took 2 (E2B, H 256)
    or 3 (31B, H 1024), and [H] vectors where the loops computed [64, 16] tiles of one valid token."""
    if T != 1 or not (flags["HAS_RES"] or flags["HAS_NORM"]):
        return 0
    k = pow2_at_least(H, 16)
    return k if k <= ROW_K_MAX else 0


def prologue_unroll(H: int, block_k: int, block_t: int, elem_bytes: int) -> dict:
    """The statistics loops' unroll factors (kernel constexprs) for a row of H columns: the largest power of
    two of K blocks up to the cap and H's own block count. Unrolled further than the row has blocks, a
    loop would run its remainder loop instead, one block (one round trip) per iteration. sm_90 SASS of
    the 31B q_rope at T = 1 (H 1024, 16 blocks): the first loop's loads in 1 wave instead of 4, the
    second's in 2 instead of 4; E2B's (H 256, 4 blocks) keep 1 and 1."""
    if block_t > 16 or elem_bytes > 2:
        return dict(STATS_UNROLL=UNROLL[0], NORM_UNROLL=UNROLL[1])
    blocks = 1 << (max(1, cdiv(H, block_k)).bit_length() - 1)
    return dict(STATS_UNROLL=min(DECODE_UNROLL[0], blocks), NORM_UNROLL=min(DECODE_UNROLL[1], blocks))


@device_helper
def _tile(ptr, tok, tok_mask, k, k_mask, stride):
    """Rows `tok` of a [T, H] tensor at columns k as fp32, k-major [BLOCK_K, BLOCK_T]."""
    return tl.load(ptr + tok.to(tl.int64)[None, :] * stride + k[:, None], mask=k_mask[:, None] & tok_mask[None, :],
                   other=0.0).to(tl.float32)


@device_helper
def _inv_rms(ptr, tok, tok_mask, H, eps, stride, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of rows `tok` (fp32)."""
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, loop_unroll_factor=UNROLL):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _tile(ptr, tok, tok_mask, k, k < H, stride)
        acc += tl.sum(x * x, axis=0)
    return tl.rsqrt(acc / H + eps)


@device_helper
def _layer_scalar(sc_ptr, HAS_SCALE: tl.constexpr):
    """The layer scalar as fp32 (1 without one: unused)."""
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(sc_ptr).to(tl.float32)
    return scale


@device_helper
def _add_residual(x, res, w, inv_x, scale, HAS_SCALE: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """round(res + round(x * inv_x * w)), then round(h * scale) (fp32 holding DTYPE values), the operands
    broadcast by the caller."""
    n = cast(x * inv_x * w, DTYPE, INTERP).to(tl.float32)
    h = cast(res + n, DTYPE, INTERP).to(tl.float32)
    if HAS_SCALE:
        h = cast(h * scale, DTYPE, INTERP).to(tl.float32)
    return h


@device_helper
def residual_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, k, k_mask, s_x, s_r, inv_x,
                  HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """h at columns k (fp32 holding DTYPE values): x, or round(residual + round(rms_norm(x) * w)),
    then round(h * layer_scalar)."""
    h = _tile(x_ptr, tok, tok_mask, k, k_mask, s_x)
    if HAS_RES:
        w = tl.load(rw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        res = _tile(res_ptr, tok, tok_mask, k, k_mask, s_r)
        h = _add_residual(h, res, w[:, None], inv_x[None, :], _layer_scalar(sc_ptr, HAS_SCALE), HAS_SCALE, DTYPE,
                          INTERP)
    return h


@device_helper
def _one_token_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, H, eps, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
                     ROW_K: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """(1 / rms of x, 1 / rms of h) of token 0 as scalars, from its row loaded whole (x, the residual, its
    norm weight and the layer scalar issued together: one wave of loads, where the loops take one for x
    and then one or two for h)."""
    k = tl.arange(0, ROW_K)
    k_mask = k < H
    x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
    h = x
    inv_x = 0.0
    if HAS_RES:
        res = tl.load(res_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        scale = _layer_scalar(sc_ptr, HAS_SCALE)
        inv_x = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        h = _add_residual(x, res, w, inv_x, scale, HAS_SCALE, DTYPE, INTERP)
    return inv_x, tl.rsqrt(tl.sum(h * h, axis=0) / H + eps)


@device_helper
def prologue_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, H, eps, s_x, s_r,
                   HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
                   DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STATS_UNROLL: tl.constexpr,
                   NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr, INTERP: tl.constexpr):
    """(1 / rms of x, 1 / rms of h) of the token tile. Loads only: with no store in them, the loops
    unroll (`prologue_unroll`) and issue several blocks' loads at once (a store of h in the second loop,
    as there was, keeps every block's loads behind the previous block's store: one L2 round trip per 64
    columns). ROW_K > 0 (one token): `_one_token_stats`."""
    if ROW_K > 0:  # T = 1 (row_tile): the token's statistics from vectors, broadcast over the tile
        one_x, one_h = _one_token_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, H, eps, HAS_RES, HAS_SCALE, ROW_K, DTYPE,
                                        INTERP)
        return tl.full((BLOCK_T,), 0.0, tl.float32) + one_x, tl.full((BLOCK_T,), 0.0, tl.float32) + one_h
    inv_x = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if HAS_RES:
        inv_x = _inv_rms(x_ptr, tok, tok_mask, H, eps, s_x, BLOCK_T, BLOCK_K, STATS_UNROLL)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if HAS_NORM:
        for k0 in tl.range(0, H, BLOCK_K, loop_unroll_factor=NORM_UNROLL):
            k = k0 + tl.arange(0, BLOCK_K)
            h = residual_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, k, k < H, s_x, s_r, inv_x,
                              HAS_RES, HAS_SCALE, DTYPE, INTERP)
            acc += tl.sum(h * h, axis=0)
    return inv_x, tl.rsqrt(acc / H + eps)


@device_helper
def normed_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, hout_ptr, tok, tok_mask, k, k_mask, s_x, s_r, s_hout, inv_x,
                inv_h, writer, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
                WRITE_H: tl.constexpr, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """n at columns k, in DTYPE, k-major [BLOCK_K, BLOCK_T]: the projection's input; h goes to
    residual_out from the `writer` programs, whose K loops cover every column once."""
    h = residual_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, k, k_mask, s_x, s_r, inv_x, HAS_RES, HAS_SCALE,
                      DTYPE, INTERP)
    if WRITE_H:
        tl.store(hout_ptr + tok.to(tl.int64)[None, :] * s_hout + k[:, None], h.to(DTYPE),
                 mask=k_mask[:, None] & tok_mask[None, :] & writer)
    if HAS_NORM:
        w = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        h = h * inv_h[None, :] * w[:, None]
    return cast(h, DTYPE, INTERP)


@triton.jit(do_not_specialize=["T", "kb_per_split", "splits"])
def _norm_linear_kernel(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, hout_ptr, nout_ptr,
                        T, H, N, kb_per_split, splits, eps, s_x, s_r, s_w, s_out, s_hout, s_nout,
                        HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
                        WRITE_H: tl.constexpr, WRITE_N: tl.constexpr, SPLIT: tl.constexpr,
                        SPLIT_LOADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                        STATS_UNROLL: tl.constexpr, NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr, PREC: tl.constexpr,
                        INTERP: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_s = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kb_lo = pid_s * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, tl.cdiv(H, BLOCK_K))
    prefetch_weight_rows(w_ptr, n, n_mask, s_w, kb_lo * BLOCK_K, tl.minimum(kb_hi * BLOCK_K, H), USE_PDL)
    wait_for_inputs(USE_PDL)
    # torch.compile's launcher passes a Python float as an fp64 scalar: the kernel's math stays fp32
    eps = tl.cast(eps, tl.float32)
    dt = out_ptr.dtype.element_ty
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    inv_x, inv_h = prologue_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, H, eps, s_x, s_r, HAS_RES, HAS_SCALE,
                                  HAS_NORM, dt, BLOCK_T, BLOCK_K, STATS_UNROLL, NORM_UNROLL, ROW_K, INTERP)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * s_w
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = k < H
        # the n-tile 0 programs of all splits cover every K block once: they write h and n
        x = normed_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, hout_ptr, tok, tok_mask, k, k_mask, s_x, s_r, s_hout,
                        inv_x, inv_h, pid_n == 0, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, dt, INTERP)
        if WRITE_N:
            tl.store(nout_ptr + tok.to(tl.int64)[None, :] * s_nout + k[:, None], x,
                     mask=k_mask[:, None] & tok_mask[None, :] & (pid_n == 0))
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = mma(w, x, acc, PREC, INTERP)
    dst = tok.to(tl.int64)[None, :] * s_out + n[:, None]
    mask = n_mask[:, None] & tok_mask[None, :]
    if SPLIT:
        # split-K: publish the partial; the tile's last split to arrive sums them in split order
        tl.store(part_ptr + pid_s * T * N + tok.to(tl.int64)[None, :] * N + n[:, None], acc, mask=mask)
        cnt = cnt_ptr + pid_t * tl.num_programs(0) + pid_n
        if last_to_arrive(cnt, splits):
            tl.store(cnt, 0)
            total = sum_splits(part_ptr + tok.to(tl.int64)[None, :] * N + n[:, None], T * N, splits, mask, BLOCK_N,
                               BLOCK_T, SPLIT_LOADS)
            tl.store(out_ptr + dst, cast(total, dt, INTERP), mask=mask)
    else:
        tl.store(out_ptr + dst, cast(acc, dt, INTERP), mask=mask)


def token_block(T: int) -> int:
    """Tokens per program: T rounded up to 16..64 (tl.dot needs 16; each weight row is read once per tile)."""
    return min(64, pow2_at_least(T, 16))


# K blocks per program at least. Where the tiles alone fill the GPU's two programs an SM (the 31B and 26B
# projections: 16-17 splits of 8-29 blocks) this never binds; where the weight is small (E2B / E4B o_proj
# and down_proj, 0.5-1 MiB over 8 tiles), it set the split count: at 8 blocks, 16-32 programs each streamed
# its 8 blocks through a 3-stage pipeline, a chain of ~2.5 us (the op cases took 5.0-5.1 us, as long as
# the pre-projection's 24 serial epilogue round trips). At 2 the program's whole range is what the L2
# prefetch before its wait asks for (PREFETCH_LINES = 4 blocks) and its loop two loads deep, for 8-16
# partials that the elected program sums in 1-2 waves of 8 (sum_splits).
MIN_KB_PER_SPLIT = 2


def launch_config(T: int, H: int, N: int, sms: int, *, block_n: int | None = None, block_k: int = BLOCK_K,
                  split_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> dict:
    """Tiles and split count (also what the AOT compile check records): up to 2 programs per SM (the
    first GPU run's 31B down projection, split into 5-block runs over many more programs, reached 38%
    of copy bandwidth), each streaming >= MIN_KB_PER_SPLIT K blocks, with the fp32 partials
    (8 * SPLIT_K * T * N bytes written and read back) capped at ~1/4 of the weight. The keywords
    replace one choice each (the rest follows from it): `benchmarks/tune_launch_configs.py` times them
    against these defaults."""
    block_t = token_block(T)
    block_n = block_n or (32 if N <= 512 else 64)
    tiles = cdiv(N, block_n) * cdiv(max(T, 1), block_t)
    nkb = cdiv(H, block_k)
    if split_k is None:
        split_k = min(2 * sms // tiles, nkb // MIN_KB_PER_SPLIT, H // (8 * max(T, 1)))
    kb_per_split = max(1, cdiv(nkb, max(1, split_k)))
    split = max(1, cdiv(nkb, kb_per_split))
    return dict(BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_K=block_k, split_k=split, kb_per_split=kb_per_split,
                num_warps=num_warps, num_stages=num_stages, **split_epilogue(split, block_n, block_t, num_warps))


def prologue_args(x, norm_weight, residual, residual_norm_weight, layer_scalar, residual_out):
    """Pointer arguments and flags of the prologue, in kernel order (x, residual, its norm weight,
    the scalar, the norm weight) and its strides; absent tensors are passed as x (never read)."""
    has_res = residual is not None
    ptrs = (x, residual if has_res else x, residual_norm_weight if has_res else x,
            layer_scalar if layer_scalar is not None else x, norm_weight if norm_weight is not None else x)
    flags = dict(HAS_RES=has_res, HAS_SCALE=layer_scalar is not None, HAS_NORM=norm_weight is not None,
                 WRITE_H=residual_out is not None)
    strides = (x.stride(0), residual.stride(0) if has_res else 0)
    return ptrs, flags, strides


def rms_norm_linear(x, weight, *, norm_weight=None, eps=1e-6, residual=None, residual_norm_weight=None,
                    layer_scalar=None, out=None, residual_out=None, normed_out=None):
    T, H = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = launch_config(T, H, N, num_sms(x.device), **tuned.overrides("rms_norm_linear", x.device, T=T, N=N, K=H))
    split = cfg["split_k"]
    part = cnt = out
    if split > 1:
        part = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
        tiles = cdiv(N, cfg["BLOCK_N"]) * cdiv(T, cfg["BLOCK_T"])
        cnt = zeroed_counters(x.device, tiles, COUNTER_OWNER)
    ptrs, flags, strides = prologue_args(x, norm_weight, residual, residual_norm_weight, layer_scalar, residual_out)
    hout = residual_out if residual_out is not None else out
    nout = normed_out if normed_out is not None else out
    grid = (cdiv(N, cfg["BLOCK_N"]), cdiv(T, cfg["BLOCK_T"]), split)
    _norm_linear_kernel[grid](*ptrs, weight, out, part, cnt, hout, nout, T, H, N, cfg["kb_per_split"], split,
                              float(eps), *strides, weight.stride(0), out.stride(0), hout.stride(0), nout.stride(0),
                              WRITE_N=normed_out is not None, SPLIT=split > 1, SPLIT_LOADS=cfg["SPLIT_LOADS"],
                              BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
                              **prologue_unroll(H, cfg["BLOCK_K"], cfg["BLOCK_T"], x.element_size()),
                              ROW_K=row_tile(T, H, flags), PREC=dot_precision(x.dtype), INTERP=interpreting(x.device),
                              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"], **flags,
                              **pdl_args(x.device, weights=True))
    return out
