"""Triton `rms_norm_gate_up`: the MLP's first half in one launch.

Design. Grid (I / BLOCK_N, T / BLOCK_T): a program owns BLOCK_N rows of both gate_proj and up_proj
and all tokens of its tile; the decoder-layer prologue (post-attention norm, residual add,
pre-feedforward norm; `rms_norm_linear`'s helpers) feeds two tl.dot accumulators from the same n
tile, and the epilogue rounds each projection, the tanh-approximated gelu (fp32, as torch computes
it) and the product, as Hugging Face's MLP does, so only m [T, I] reaches memory. I = 2048..8192
rows give 64..256 programs: no K split (K = Hd <= 1024).
Expected on H100/H200: the two weights (E2B 2 MiB, 31B 32 MiB) at ~85% of copy bandwidth for 31B;
E2B is launch bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import (cast, cdiv, device_helper, dot_precision, interpreting, mma, pdl_args, prefetch_weight_rows,
                      wait_for_inputs)
from .rms_norm_linear import (BLOCK_K, normed_tile, prologue_args, prologue_stats, prologue_unroll, row_tile,
                             token_block)


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
    # torch.compile's launcher passes a Python float as an fp64 scalar: the kernel's math stays fp32
    eps = tl.cast(eps, tl.float32)
    dt = out_ptr.dtype.element_ty
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < T
    inv_x, inv_h = prologue_stats(x_ptr, res_ptr, rw_ptr, sc_ptr, tok, tok_mask, H, eps, s_x, s_r, HAS_RES, HAS_SCALE,
                                  HAS_NORM, dt, BLOCK_T, BLOCK_K, STATS_UNROLL, NORM_UNROLL, ROW_K, INTERP)
    g_rows = g_ptr + n.to(tl.int64)[:, None] * s_g
    u_rows = u_ptr + n.to(tl.int64)[:, None] * s_u
    acc_g = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < H
        x = normed_tile(x_ptr, res_ptr, rw_ptr, sc_ptr, nw_ptr, hout_ptr, tok, tok_mask, k, k_mask, s_x, s_r, s_hout,
                        inv_x, inv_h, pid_n == 0, HAS_RES, HAS_SCALE, HAS_NORM, WRITE_H, dt, INTERP)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc_g = mma(tl.load(g_rows + k[None, :], mask=w_mask, other=0.0), x, acc_g, PREC, INTERP)
        acc_u = mma(tl.load(u_rows + k[None, :], mask=w_mask, other=0.0), x, acc_u, PREC, INTERP)
    gate = cast(gelu_tanh(cast(acc_g, dt, INTERP).to(tl.float32), INTERP), dt, INTERP).to(tl.float32)
    m = cast(gate * cast(acc_u, dt, INTERP).to(tl.float32), dt, INTERP)
    tl.store(out_ptr + tok.to(tl.int64)[None, :] * s_out + n[:, None], m, mask=n_mask[:, None] & tok_mask[None, :])


def launch_config(T: int, I: int, *, block_n: int = 32, block_k: int = BLOCK_K, num_warps: int = 4,
                  num_stages: int = 3) -> dict:
    """32 rows of each weight per program: 64 (E2B) to 256 (31B) programs at T <= 64. The keywords
    replace one choice each (`benchmarks/tune_launch_configs.py` times them)."""
    return dict(BLOCK_N=block_n, BLOCK_T=token_block(T), BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


def rms_norm_gate_up(x, gate_weight, up_weight, *, norm_weight=None, eps=1e-6, residual=None,
                     residual_norm_weight=None, layer_scalar=None, out=None, residual_out=None):
    T, H = x.shape
    I = gate_weight.shape[0]
    if out is None:
        out = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = launch_config(T, I)
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
