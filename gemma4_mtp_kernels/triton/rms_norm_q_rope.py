"""Triton `rms_norm_q_rope`: a drafter layer's queries in one launch (input norm -> q_proj -> q_norm -> RoPE).

Design. Grid (Hq * D / BLOCK_N, T / BLOCK_T), BLOCK_N dividing D: a program computes a BLOCK_N-row
slice of q_proj for its token tile with the decoder-layer prologue in front (`rms_norm_linear`'s
helpers: the previous layer's post-feedforward norm, residual add and layer scalar, then this
layer's input norm), rounds it to x's dtype (Hugging Face's q_proj output) and publishes it to a
[T, Hq * D] workspace. q_norm needs a whole head, so the last of a head's D / BLOCK_N programs to
finish (a per-(token tile, head) counter, the pattern of tree_verify: bar.sync, one
atom.acq_rel.gpu, .cg loads, the counter reset by its consumer so the launch replays in a CUDA
graph) normalises the head and rotates it, its two halves read from the workspace as [tokens, D / 2]
tiles (a neox pair j, j + D/2 sits at the same place of both): cos/sin of the fp32 `position *
inv_freq` (computed as Hugging Face does) come from `cos_sin` (~1 ulp, as torch's cosf / sinf), once
per pair, and are rounded to x's dtype, then q * cos, rotated * sin and their sum are each rounded, as
Hugging Face's apply_rotary_pos_emb does. Positions are read per request
(token t uses positions[t // (T / P)]): no repeat_interleave launch. Proportional RoPE (full
layers) is the same code: its non-rotated pairs have inv_freq 0 (cos 1, sin 0).
Expected on H100/H200: q_proj's weight (E2B 0.5-1 MiB, 31B 16-32 MiB) at the rate of
`rms_norm_linear`'s projection, plus one L2 round trip for the counter and the head's epilogue on
the critical path (~1 us).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuned
from ._common import (cast, cdiv, device_helper, dot_precision, interpreting, last_to_arrive, mma, pdl_args,
                      prefetch_weight_rows, wait_for_inputs)
from .rms_norm_linear import (BLOCK_K, normed_tile, prologue_args, prologue_stats, prologue_unroll, row_tile,
                             token_block)
from .._counters import zeroed_counters

COUNTER_OWNER = "triton.rms_norm_q_rope"  # its cached counters in gemma4_mtp_kernels._counters


@device_helper
def cos_sin(f):
    """cos(f), sin(f) of fp32 f to ~1 ulp without a stack frame: the quadrant reduction in fp64
    (exact enough for |f| < 2^24), then Cephes' fp32 polynomials on [-pi/4, pi/4]. (tl.cos / tl.sin
    are libdevice's cosf / sinf, whose Payne-Hanek path for |f| > 105615 rad keeps a 28-byte local
    array.) The same code runs under the interpreter, so the CPU tests check the GPU's math."""
    fd = f.to(tl.float64)
    q = tl.floor(fd * 0.6366197723675814 + 0.5)
    r = (fd - q * 1.5707963267948966).to(tl.float32)
    quadrant = q.to(tl.int32) & 3
    z = r * r
    s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    sin = tl.where(quadrant == 0, s, tl.where(quadrant == 1, c, tl.where(quadrant == 2, -s, -c)))
    cos = tl.where(quadrant == 0, c, tl.where(quadrant == 1, -s, tl.where(quadrant == 2, -c, s)))
    return cos, sin


@device_helper
def _norm_rope_head(ws_ptr, qw_ptr, pos_ptr, freq_ptr, out_ptr, head, t_lo, T, N, per_pos, eps,
                    D: tl.constexpr, EPI_T: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr,
                    INTERP: tl.constexpr):
    """q_norm + RoPE of one head for the tokens [t_lo, t_lo + BLOCK_T) of the workspace, EPI_T tokens at a
    time as [tokens, D / 2] tiles of the head's two halves: a neox pair (j, j + D / 2) shares its angle,
    so each half is loaded once (not the head and then its partners) and each cos / sin computed once."""
    HALF: tl.constexpr = D // 2
    h = tl.arange(0, HALF)
    w_lo = tl.load(qw_ptr + h).to(tl.float32)
    w_hi = tl.load(qw_ptr + HALF + h).to(tl.float32)
    freq = tl.load(freq_ptr + h)
    for t0 in range(t_lo, tl.minimum(t_lo + BLOCK_T, T), EPI_T):
        tk = t0 + tl.arange(0, EPI_T)
        tm = tk < T
        pos = tl.load(pos_ptr + tk // per_pos, mask=tm, other=0).to(tl.float32)
        row = tk.to(tl.int64)[:, None] * N + head * D + h[None, :]
        q_lo = tl.load(ws_ptr + row, mask=tm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        q_hi = tl.load(ws_ptr + row + HALF, mask=tm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        inv = tl.rsqrt((tl.sum(q_lo * q_lo, axis=1) + tl.sum(q_hi * q_hi, axis=1)) / D + eps)
        n_lo = cast(q_lo * inv[:, None] * w_lo[None, :], DT, INTERP).to(tl.float32)
        n_hi = cast(q_hi * inv[:, None] * w_hi[None, :], DT, INTERP).to(tl.float32)
        c, s = cos_sin(pos[:, None] * freq[None, :])
        c = cast(c, DT, INTERP).to(tl.float32)
        s = cast(s, DT, INTERP).to(tl.float32)
        # as Hugging Face's apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, each product rounded
        o_lo = cast(n_lo * c, DT, INTERP).to(tl.float32) + cast(-n_hi * s, DT, INTERP).to(tl.float32)
        o_hi = cast(n_hi * c, DT, INTERP).to(tl.float32) + cast(n_lo * s, DT, INTERP).to(tl.float32)
        out_row = out_ptr + tk.to(tl.int64)[:, None] * N + head * D + h[None, :]
        tl.store(out_row, cast(o_lo, DT, INTERP), mask=tm[:, None])
        tl.store(out_row + HALF, cast(o_hi, DT, INTERP), mask=tm[:, None])


@triton.jit(do_not_specialize=["T", "per_pos"])
def _q_rope_kernel(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, w_ptr, qw_ptr, pos_ptr, freq_ptr, ws_ptr, cnt_ptr,
                   out_ptr, hout_ptr, T, H, N, Hq, per_pos, eps, s_x, s_r, s_w, s_hout,
                   HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_H: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   STATS_UNROLL: tl.constexpr, NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr,
                   EPI_T: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    prefetch_weight_rows(w_ptr, n, n < N, s_w, 0, H, USE_PDL)
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
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < H
        x = normed_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, hout_ptr, tok, tok_mask, k, k_mask, s_x, s_r, s_hout,
                        inv_x, inv_h, pid_n == 0, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, dt, INTERP)
        acc = mma(tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0), x, acc, PREC, INTERP)
    # N = Hq * D is a multiple of BLOCK_N: every row of the tile exists
    tl.store(ws_ptr + tok.to(tl.int64)[None, :] * N + n[:, None], cast(acc, dt, INTERP), mask=tok_mask[None, :])
    head = pid_n * BLOCK_N // D
    cnt = cnt_ptr + pid_t * Hq + head
    if last_to_arrive(cnt, D // BLOCK_N):
        tl.store(cnt, 0)
        _norm_rope_head(ws_ptr, qw_ptr, pos_ptr, freq_ptr, out_ptr, head, pid_t * BLOCK_T, T, N, per_pos, eps, D,
                        EPI_T, BLOCK_T, dt, INTERP)


MAXNREG = 168


def launch_config(T: int, N: int, D: int, *, block_n: int | None = None, block_k: int = BLOCK_K, num_warps: int = 4,
                  num_stages: int = 3) -> dict:
    """BLOCK_N divides D (>= 64): 32-row slices for E2B/E4B (32-64 programs), 64 for 26B/31B (128-256).
    The epilogue handles 2048 / D tokens at a time (two [tokens, D / 2] fp32 tiles, ~8 values per thread
    each), one when T = 1: a decode step at batch 1 computed 8 (D 256) or 4 (D 512) tokens' norm and RoPE
    for the one it stores, and its elected program ran ~1100 instructions, 15 barriers and 4-5
    dependent load waves after the election (sm_90 SASS) where one token takes ~200-280, 5-11 and 2 (its own
    compile: 6 q_rope compiles per drafter instead of 3, see tests/test_triton_aot.py).
    Register cap 168: left alone, ptxas fit the D 512 epilogue of some sm_80 launches in 64 registers
    by saving predicates to the stack (8 bytes per thread); the cap lets it take 72-168 and save none.
    The keywords replace one choice each (`benchmarks/tune_launch_configs.py` times them); block_n
    must divide D (a head's slices are counted to elect its epilogue)."""
    block_n = block_n or (32 if N <= 2048 else 64)
    if D % block_n:
        raise ValueError(f"block_n: must divide the head dim {D}, got {block_n}")
    return dict(BLOCK_N=block_n, BLOCK_T=token_block(T), BLOCK_K=block_k,
                EPI_T=1 if T == 1 else max(1, 2048 // D),
                num_warps=num_warps, num_stages=num_stages, maxnreg=MAXNREG)


def rms_norm_q_rope(x, weight, q_norm_weight, positions, inv_freq, *, norm_weight=None, eps=1e-6, residual=None,
                    residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    T, H = x.shape
    N = weight.shape[0]
    D = q_norm_weight.shape[0]
    Hq = N // D
    if out is None:
        out = torch.empty(T, Hq, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = launch_config(T, N, D, **tuned.overrides("rms_norm_q_rope", x.device, T=T, N=N, K=H, D=D))
    t_tiles = cdiv(T, cfg["BLOCK_T"])
    ws = torch.empty(T, N, dtype=x.dtype, device=x.device)
    cnt = zeroed_counters(x.device, t_tiles * Hq, COUNTER_OWNER)
    ptrs, flags, strides = prologue_args(x, norm_weight, residual, residual_norm_weight, layer_scalar, residual_out)
    hout = residual_out if residual_out is not None else out
    _q_rope_kernel[(N // cfg["BLOCK_N"], t_tiles)](
        *ptrs, weight, q_norm_weight, positions, inv_freq, ws, cnt, out, hout, T, H, N, Hq, T // positions.shape[0],
        float(eps), *strides, weight.stride(0), hout.stride(0), D=D, BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"],
        BLOCK_K=cfg["BLOCK_K"], EPI_T=cfg["EPI_T"], **prologue_unroll(H, cfg["BLOCK_K"], cfg["BLOCK_T"],
                                                                      x.element_size()),
        ROW_K=row_tile(T, H, flags),
        PREC=dot_precision(x.dtype), INTERP=interpreting(x.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"], **flags, **pdl_args(x.device, weights=True))
    return out
