"""Triton `rms_norm_gate_up`: the MLP's first half in one launch; with down_weight, the whole MLP in one.

Design. Grid (I / BLOCK_N, T / BLOCK_T): a program owns BLOCK_N rows of both gate_proj and up_proj
and all tokens of its tile; the decoder-layer prologue (post-attention norm, residual add,
pre-feedforward norm; `rms_norm_linear`'s helpers) feeds two tl.dot accumulators from the same n
tile, and the epilogue rounds each projection, the tanh-approximated gelu (fp32, as torch computes
it) and the product, as Hugging Face's MLP does, so only m [T, I] reaches memory. I = 2048..8192
rows give 64..256 programs: no K split (K = Hd <= 1024).
Expected on H100/H200: the two weights (E2B 2 MiB, 31B 32 MiB) at ~85% of copy bandwidth for 31B;
E2B is launch bound.

The whole MLP (down_weight given; one launch where `one_launch` says: T <= MLP_MAX_T, decode steps and
tree levels at small batch, and the small drafters' weights). A step's down_proj was a launch of its own:
a boundary (~1.4 us on the H200) and a split-K kernel whose chain (prologue, weight stream, partials,
election) took ~5 us on E2B for 1 MiB. But gate_up's programs already hold the down projection's
split-K operands: program p's m rows [p * BLOCK_I, (p + 1) * BLOCK_I) are the K range of down_proj's
split p. `_mlp_kernel` multiplies them by those BLOCK_I columns of down_weight (N rows of 64 bytes, asked
of L2 before the wait with the gate / up rows) and publishes an fp32 partial [T, N]; the partials are
summed in a fixed tree (deterministic): the last program of each GROUP (~sqrt(programs)) to arrive sums
its group's partials, the last group sums the group sums and rounds once, as down_proj rounds. At
T <= 4 the partials are <= 17% of the weights' bytes (E2B: 64 programs x T x 256 x 4 bytes, written
and read); the sums take one wave of 8 loads per level (`sum_splits` over the flat [T, N] output in
chunks of SUM_CHUNK). Above MLP_MAX_T the partials grow with T, and above MLP_MAX_WEIGHT_BYTES the
weights stream from DRAM: the two launches run (gate_up, then `rms_norm_linear`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import tuned
from ._common import (cast, cdiv, device_helper, dot_precision, interpreting, last_to_arrive, mma, pdl_args,
                      prefetch_weight_rows, split_epilogue, sum_splits, wait_for_inputs)
from .._counters import zeroed_counters
from .rms_norm_linear import (BLOCK_K, normed_tile, prologue_args, prologue_stats, prologue_unroll, row_tile,
                             token_block)
from .rms_norm_linear import rms_norm_linear as _linear

COUNTER_OWNER = "triton.rms_norm_gate_up"  # its cached counters in gemma4_mtp_kernels._counters


@device_helper
def gelu_tanh(x, INTERP: tl.constexpr):
    """torch's gelu(approximate="tanh") in fp32: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
    with the precise tanh (libdevice tanhf, as torch's CUDA kernel calls it)."""
    inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
    if INTERP:
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # the interpreter has no libdevice
    else:
        t = libdevice.tanh(inner)
    return 0.5 * x * (1.0 + t)


@device_helper
def _gated(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, g_ptr, u_ptr, hout_ptr, n, n_mask, tok, tok_mask, writer, H, eps,
           s_x, s_r, s_g, s_u, s_hout, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr,
           WRITE_H: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_K: tl.constexpr, STATS_UNROLL: tl.constexpr, NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr,
           PREC: tl.constexpr, INTERP: tl.constexpr):
    """m [BLOCK_N, BLOCK_T] in DTYPE for rows n of gate / up and tokens tok: the prologue, both projections,
    each rounded, gelu, the product rounded (rows past I are 0). The `writer` programs write h."""
    # torch.compile's launcher passes a Python float as an fp64 scalar: the kernel's math stays fp32
    eps = tl.cast(eps, tl.float32)
    inv_x, inv_h = prologue_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, H, eps, s_x, s_r, HAS_RES, HAS_SCALE,
                                  HAS_NORM, DTYPE, BLOCK_T, BLOCK_K, STATS_UNROLL, NORM_UNROLL, ROW_K, INTERP)
    g_rows = g_ptr + n.to(tl.int64)[:, None] * s_g
    u_rows = u_ptr + n.to(tl.int64)[:, None] * s_u
    acc_g = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < H
        x = normed_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, hout_ptr, tok, tok_mask, k, k_mask, s_x, s_r, s_hout,
                        inv_x, inv_h, writer, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, DTYPE, INTERP)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g = mma(tl.load(g_rows + k[None, :], mask=w_mask, other=0.0), x, acc_g, PREC, INTERP)
        acc_u = mma(tl.load(u_rows + k[None, :], mask=w_mask, other=0.0), x, acc_u, PREC, INTERP)
    gate = cast(gelu_tanh(cast(acc_g, DTYPE, INTERP).to(tl.float32), INTERP), DTYPE, INTERP).to(tl.float32)
    return cast(gate * cast(acc_u, DTYPE, INTERP).to(tl.float32), DTYPE, INTERP)


@triton.jit(do_not_specialize=["T"])
def _gate_up_kernel(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, g_ptr, u_ptr, out_ptr, hout_ptr,
                    T, H, I, eps, s_x, s_r, s_g, s_u, s_out, s_hout,
                    HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_H: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STATS_UNROLL: tl.constexpr,
                    NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr,
                    PREC: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < I
    prefetch_weight_rows(g_ptr, n, n_mask, s_g, 0, H, USE_PDL)
    prefetch_weight_rows(u_ptr, n, n_mask, s_u, 0, H, USE_PDL)
    wait_for_inputs(USE_PDL)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    m = _gated(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, g_ptr, u_ptr, hout_ptr, n, n_mask, tok, tok_mask, pid_n == 0,
               H, eps, s_x, s_r, s_g, s_u, s_hout, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, out_ptr.dtype.element_ty,
               BLOCK_N, BLOCK_T, BLOCK_K, STATS_UNROLL, NORM_UNROLL, ROW_K, PREC, INTERP)
    tl.store(out_ptr + tok.to(tl.int64)[None, :] * s_out + n[:, None], m, mask=n_mask[:, None] & tok_mask[None, :])


@device_helper
def _down_tile(d_ptr, n, i, i_mask, N, s_d):
    """down_weight's rows n (past N: 0) at this program's columns i: [BLOCK_N, BLOCK_I]."""
    return tl.load(d_ptr + n.to(tl.int64)[:, None] * s_d + i[None, :], mask=(n < N)[:, None] & i_mask[None, :],
                   other=0.0)


@device_helper
def _store_partial(wd, m, part, n, tok, tok_mask, N, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                   PREC: tl.constexpr, INTERP: tl.constexpr):
    """This program's fp32 partial of down_proj's rows n, wd @ m, into its [T, N] slice `part`."""
    acc = mma(wd, m, tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32), PREC, INTERP)
    tl.store(part + tok[None, :] * N + n[:, None], acc, mask=(n < N)[:, None] & tok_mask[None, :])


@triton.jit(do_not_specialize=["T"])
def _mlp_kernel(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, g_ptr, u_ptr, d_ptr, out_ptr, hout_ptr, part_ptr, gpart_ptr,
                cnt_ptr, T, H, I, N, eps, s_x, s_r, s_g, s_u, s_d, s_out, s_hout,
                HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_NORM: tl.constexpr, WRITE_H: tl.constexpr,
                BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                ONE_TILE: tl.constexpr, GROUP: tl.constexpr, SUM_ROWS: tl.constexpr, SPLIT_LOADS: tl.constexpr,
                STATS_UNROLL: tl.constexpr, NORM_UNROLL: tl.constexpr, ROW_K: tl.constexpr, PREC: tl.constexpr,
                INTERP: tl.constexpr, USE_PDL: tl.constexpr):
    """The whole MLP for T <= BLOCK_T tokens (one token tile): grid (I / BLOCK_I,), design at the top."""
    pid = tl.program_id(0)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < I
    prefetch_weight_rows(g_ptr, i, i_mask, s_g, 0, H, USE_PDL)
    prefetch_weight_rows(u_ptr, i, i_mask, s_u, 0, H, USE_PDL)
    for n0 in range(0, N, BLOCK_N):  # down_proj's columns i: one line of each of its N rows
        n = n0 + tl.arange(0, BLOCK_N)
        prefetch_weight_rows(d_ptr, n, n < N, s_d, pid * BLOCK_I, tl.minimum(pid * BLOCK_I + BLOCK_I, I), USE_PDL)
    wait_for_inputs(USE_PDL)
    dt = out_ptr.dtype.element_ty
    tok = tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    if ONE_TILE:  # all of down_proj's rows in one tile: asked for before gate / up, used after them
        wd0 = _down_tile(d_ptr, tl.arange(0, BLOCK_N), i, i_mask, N, s_d)
    m = _gated(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, g_ptr, u_ptr, hout_ptr, i, i_mask, tok, tok_mask, pid == 0,
               H, eps, s_x, s_r, s_g, s_u, s_hout, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, dt, BLOCK_I, BLOCK_T,
               BLOCK_K, STATS_UNROLL, NORM_UNROLL, ROW_K, PREC, INTERP)
    # this program's split of down_proj: partial [T, N] = m^T @ down_weight[:, i]^T, stored row-major
    size = T * N
    part = part_ptr + pid.to(tl.int64) * size
    if ONE_TILE:
        _store_partial(wd0, m, part, tl.arange(0, BLOCK_N), tok, tok_mask, N, BLOCK_N, BLOCK_T, PREC, INTERP)
    else:
        for n0 in range(0, N, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            _store_partial(_down_tile(d_ptr, n, i, i_mask, N, s_d), m, part, n, tok, tok_mask, N, BLOCK_N, BLOCK_T,
                           PREC, INTERP)
    # the fixed reduction tree: the group's last program sums its members' partials, the last group the groups'
    programs = tl.num_programs(0)
    groups = tl.cdiv(programs, GROUP)
    grp = pid // GROUP
    members = tl.minimum(GROUP, programs - grp * GROUP)
    flat = tl.arange(0, SUM_ROWS)[:, None] * 16 + tl.arange(0, 16)[None, :]
    if last_to_arrive(cnt_ptr + grp, members):
        tl.store(cnt_ptr + grp, 0)
        first = part_ptr + grp.to(tl.int64) * GROUP * size
        for f0 in range(0, size, SUM_ROWS * 16):
            f = f0 + flat
            total = sum_splits(first + f, size, members, f < size, SUM_ROWS, 16, SPLIT_LOADS)
            tl.store(gpart_ptr + grp.to(tl.int64) * size + f, total, mask=f < size)
        if last_to_arrive(cnt_ptr + groups, groups):
            tl.store(cnt_ptr + groups, 0)
            for f0 in range(0, size, SUM_ROWS * 16):
                f = f0 + flat
                total = sum_splits(gpart_ptr + f, size, groups, f < size, SUM_ROWS, 16, SPLIT_LOADS)
                tl.store(out_ptr + (f // N).to(tl.int64) * s_out + f % N, cast(total, dt, INTERP), mask=f < size)


def launch_config(T: int, I: int, *, block_n: int = 32, block_k: int = BLOCK_K, num_warps: int = 4,
                  num_stages: int = 3) -> dict:
    """32 rows of each weight per program: 64 (E2B) to 256 (31B) programs at T <= 64. The keywords
    replace one choice each (`benchmarks/tune_launch_configs.py` times them)."""
    return dict(BLOCK_N=block_n, BLOCK_T=token_block(T), BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


# When the MLP with down_weight is one launch (`_mlp_kernel`, `one_launch`): up to MLP_MAX_T tokens, and weights
# (gate, up and down) of at most MLP_MAX_WEIGHT_BYTES. E2B / E4B (3 MiB, L2-resident in a replayed step) are
# latency bound: their down_proj launch was a boundary and a ~3-5 us chain for 1 MiB, and in `_mlp_kernel`
# it is one L2 round trip for each program's 16 KiB slice and the reduction tree. 26B / 31B (48 MiB from
# DRAM) are not: their gate_up streams 32 MiB at ~1.4 TB/s (2026-12-04) and down_proj's 16 MiB would join
# each program's stream behind it, so the one launch would save a boundary and cost about what it saves
# (not measured: the two launches stay). Benchmarks set MLP_MAX_T 0 to time the two launches
# (bench_drafter_step's and bench_fused_glue's `triton_two_launch_mlp`).
MLP_MAX_T = 4
MLP_MAX_WEIGHT_BYTES = 8 << 20
# fp32 values of the flat [T, N] output a program sums per chunk (4 warps: 8 a thread per partial, 8 partials
# in flight: split_epilogue's 64)
SUM_CHUNK = 1024


def one_launch(T: int, H: int, I: int, N: int, element_size: int) -> bool:
    """Whether rms_norm_gate_up with a down_weight [N, I] runs as one launch (MLP_MAX_T, MLP_MAX_WEIGHT_BYTES)."""
    return 0 < T <= MLP_MAX_T and (2 * H + N) * I * element_size <= MLP_MAX_WEIGHT_BYTES


def mlp_config(T: int, I: int, *, block_i: int = 32, block_n: int = 256, num_warps: int = 4,
               num_stages: int = 3) -> dict:
    """The one-launch MLP's grid and reduction tree: gate_up's 32 rows a program (64 programs for E2B),
    down_proj's rows 256 at a time (E2B's 256 in one tile: one L2 round trip), groups of the power of two
    >= sqrt(programs) (8 groups of 8 for E2B: one wave of loads per level at T = 1)."""
    programs = cdiv(I, block_i)
    group = 1 << (((programs - 1).bit_length() + 1) // 2)
    rows = SUM_CHUNK // 16
    return dict(BLOCK_I=block_i, BLOCK_T=token_block(T), BLOCK_K=BLOCK_K, BLOCK_N=block_n, GROUP=group, SUM_ROWS=rows,
                programs=programs, groups=cdiv(programs, group), num_warps=num_warps, num_stages=num_stages,
                **split_epilogue(group, rows, 16, num_warps))


def _mlp(x, gate_weight, up_weight, down_weight, out, *, norm_weight, eps, residual, residual_norm_weight,
         layer_scalar, residual_out):
    T, H = x.shape
    I, N = gate_weight.shape[0], down_weight.shape[0]
    cfg = mlp_config(T, I, **tuned.overrides("rms_norm_gate_up/mlp", x.device, T=T, N=N, K=H, I=I))
    part = torch.empty(cfg["programs"], T, N, dtype=torch.float32, device=x.device)
    gpart = torch.empty(cfg["groups"], T, N, dtype=torch.float32, device=x.device)
    cnt = zeroed_counters(x.device, cfg["groups"] + 1, COUNTER_OWNER)
    ptrs, flags, strides = prologue_args(x, norm_weight, residual, residual_norm_weight, layer_scalar, residual_out)
    hout = residual_out if residual_out is not None else out
    _mlp_kernel[(cfg["programs"],)](
        *ptrs, gate_weight, up_weight, down_weight, out, hout, part, gpart, cnt, T, H, I, N, float(eps), *strides,
        gate_weight.stride(0), up_weight.stride(0), down_weight.stride(0), out.stride(0), hout.stride(0),
        BLOCK_I=cfg["BLOCK_I"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], BLOCK_N=cfg["BLOCK_N"],
        ONE_TILE=N <= cfg["BLOCK_N"], GROUP=cfg["GROUP"], SUM_ROWS=cfg["SUM_ROWS"], SPLIT_LOADS=cfg["SPLIT_LOADS"],
        **prologue_unroll(H, cfg["BLOCK_K"], cfg["BLOCK_T"], x.element_size()), ROW_K=row_tile(T, H, flags),
        PREC=dot_precision(x.dtype), INTERP=interpreting(x.device), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], maxnreg=cfg["maxnreg"], **flags, **pdl_args(x.device, weights=True))
    return out


def rms_norm_gate_up(x, gate_weight, up_weight, *, down_weight=None, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    T, H = x.shape
    I = gate_weight.shape[0]
    if out is None:
        out = torch.empty(T, I if down_weight is None else down_weight.shape[0], dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    prologue = dict(norm_weight=norm_weight, eps=eps, residual=residual, residual_norm_weight=residual_norm_weight,
                    layer_scalar=layer_scalar, residual_out=residual_out)
    if down_weight is not None:
        if one_launch(T, H, I, down_weight.shape[0], x.element_size()):
            return _mlp(x, gate_weight, up_weight, down_weight, out, **prologue)
        m = rms_norm_gate_up(x, gate_weight, up_weight, **prologue)
        return _linear(m, down_weight, out=out)
    cfg = launch_config(T, I, **tuned.overrides("rms_norm_gate_up", x.device, T=T, N=I, K=H))
    ptrs, flags, strides = prologue_args(x, norm_weight, residual, residual_norm_weight, layer_scalar, residual_out)
    hout = residual_out if residual_out is not None else out
    grid = (cdiv(I, cfg["BLOCK_N"]), cdiv(T, cfg["BLOCK_T"]))
    _gate_up_kernel[grid](*ptrs, gate_weight, up_weight, out, hout, T, H, I, float(eps), *strides,
                          gate_weight.stride(0), up_weight.stride(0), out.stride(0), hout.stride(0),
                          BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"],
                          **prologue_unroll(H, cfg["BLOCK_K"], cfg["BLOCK_T"], x.element_size()),
                          ROW_K=row_tile(T, H, flags),
                          PREC=dot_precision(x.dtype), INTERP=interpreting(x.device), num_warps=cfg["num_warps"],
                          num_stages=cfg["num_stages"], **flags, **pdl_args(x.device, weights=True))
    return out
