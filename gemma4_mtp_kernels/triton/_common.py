"""Launch-size helpers shared by the Triton launchers."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# On CPU (the interpreter) there is no SM count; a small fixed one keeps the split heuristics
# deterministic and makes ordinary test shapes take the split paths.
INTERPRETER_SMS = 4
# Set by `record.recording(sms, arch)`: launchers then size their grids and pick their features for
# a GPU with that many SMs and that SM architecture, on meta tensors (meta tensors reach a launcher
# only there).
recording_sms: int | None = None
recording_arch: int | None = None


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def sm_arch(device: torch.device) -> int:
    """The SM architecture a launch on `device` compiles for (90 for H100/H200); 0 for the
    interpreter, which has none of the architecture-specific features."""
    if device.type == "cuda":
        return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "meta":
        return _recorded(recording_arch)
    return 0


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "meta":
        return _recorded(recording_sms)
    return INTERPRETER_SMS


def _recorded(value: int | None) -> int:
    """What `record.recording` says of the GPU that meta tensors stand for."""
    if value is None:
        raise RuntimeError("meta tensors reach a Triton launcher only while recording launches "
                           "(gemma4_mtp_kernels.triton.record.recording)")
    return value


# Programmatic dependent launch (sm_90+) for every kernel of a drafter step. GEMMA4_MTP_PDL=0 turns it
# off (read once; benchmarks compare both by patching this flag around a capture).
PDL = os.environ.get("GEMMA4_MTP_PDL", "1") != "0"
# When a kernel lets the next one be scheduled: True, as soon as it has waited for its own inputs (the
# next grid's programs then sit resident in their wait while this kernel works); False, when it exits.
# On the H200 PDL saved 9 µs of the E2B step and cost 17 µs of the 31B one (2026-12-04), whose wide
# GEMVs may want the SM slots the waiting programs hold: bench_drafter_step's `triton_pdl_at_exit`
# measures the other choice (benchmarks/README.md, "Kernel by kernel").
PDL_EARLY_TRIGGER = True
# Whether the GEMV kernels (the glue, the pre-projection) ask L2 for their first weight lines before their
# wait (`prefetch_weight_rows`): bench_drafter_step's `triton_no_prefetch` measures the other choice.
PREFETCH_WEIGHTS = True


def pdl_args(device: torch.device, *, weights: bool = False) -> dict:
    """The kernel flag and launch option of a launch on `device`: with programmatic dependent launch
    (sm_90 and newer, not the interpreter) a kernel is scheduled while the kernel before it on the
    stream still runs and waits for it in `wait_for_inputs`, which hides the launch latency between
    the 20-24 dependent launches of a drafter step. A kernel launched this way must call
    `wait_for_inputs` before touching global memory (aot checks the PTX). USE_PDL: 0 off, 1 wait and
    trigger the next kernel at once, 2 wait only (the next kernel is triggered when this one exits);
    + 4 for a kernel that streams weights (`weights`): it prefetches its first weight lines into L2
    before the wait (`prefetch_weight_rows`, PREFETCH_WEIGHTS)."""
    if PDL and sm_arch(device) >= 90:
        return dict(USE_PDL=(1 if PDL_EARLY_TRIGGER else 2) + (4 if weights and PREFETCH_WEIGHTS else 0),
                    launch_pdl=True)
    return dict(USE_PDL=0)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 in tl.dot; bf16/fp16 take the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreting(device: torch.device) -> bool:
    """CPU tensors run under the interpreter; CUDA tensors (and meta tensors, which stand for them
    while launches are recorded) take the compiled kernels."""
    return device.type == "cpu"


def device_helper(fn):
    """@triton.jit for a device function called from kernels. Under the interpreter it stays a plain
    Python function: the interpreter re-patches triton.language on every call of one jit function
    from another (~3 ms each), which made helper calls inside loops dominate the CPU test time."""
    return fn if triton.knobs.runtime.interpret else triton.jit(fn)


@device_helper
def wait_for_inputs(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with `pdl_args`: wait until the previous kernel's writes
    are visible (everything it reads may be one), then (USE_PDL 1 or 5) let the next kernel be scheduled
    (it waits the same way). Without programmatic dependent launch it does nothing."""
    if USE_PDL:
        gdc_wait()
        if USE_PDL % 4 == 1:
            gdc_launch_dependents()


@device_helper
def last_to_arrive(cnt, arrivals):
    """Whether this program is the last of `arrivals` to reach counter `cnt` (csrc's last_to_arrive, in
    mma_gemv.cuh): bar.sync orders every thread's stores before one atom.acq_rel.gpu, whose release
    publishes them and whose acquire, for the last program, orders the other arrivals' published stores
    before what follows (read them with .cg loads: L1 is not coherent; tree_verify's design note). The
    caller zeroes the counter for the next launch (no memset: graph replays reuse it)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == arrivals - 1


# 128-byte lines of each weight row a GEMV program asks L2 for before its wait: the first 4 K blocks of 64
# 16-bit columns, what its 3-stage pipeline loads first (32 KiB for a program of 64 rows, ~8 MiB for a 31B
# q_proj: not its whole 32 MiB, which would push out of L2 what the kernel still running has not read)
PREFETCH_LINES = tl.constexpr(4)


@device_helper
def prefetch_weight_rows(w_ptr, rows, row_mask, s_w, k_lo, k_hi, USE_PDL: tl.constexpr):
    """Before `wait_for_inputs`: an L2 prefetch of the first PREFETCH_LINES lines of each of the program's
    weight rows over its columns [k_lo, k_hi). Under programmatic dependent launch the program may be
    resident while the previous kernel still runs: the weights are not that kernel's output, and
    prefetch.global.L2 moves nothing into the SM (the loads after the wait read L2, where that kernel's
    writes are), so the first weight tiles come from L2 instead of DRAM when the wait returns (~0.4 µs
    per kernel of a 31B step, whose weights do not stay in L2). Without PDL the kernel starts after its
    predecessor and nothing is issued (nor with USE_PDL < 4: `pdl_args`)."""
    if USE_PDL >= 4:
        per_line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth
        k = k_lo + tl.arange(0, PREFETCH_LINES) * per_line
        ok = row_mask[:, None] & (k < k_hi)[None, :]
        lines = w_ptr + rows.to(tl.int64)[:, None] * s_w + k[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [tl.where(ok, lines, w_ptr)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@device_helper
def mma(a, b, acc, PREC: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b. The interpreter (triton 3.8) multiplies bf16 tiles as raw integer bits, so on
    CPU the operands go up to fp32 first: the same products (exact in fp32) and fp32 accumulation."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# Host-side integer arithmetic of the launchers. triton.cdiv and triton.next_power_of_2 are constexpr
# functions: a call from Python costs ~2 us (it unwraps its arguments), and a drafter step made ~150.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= max(n, 1), at least floor."""
    return max(floor, 1 << (max(1, n) - 1).bit_length())


@device_helper
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even, as the GPU converts. The interpreter (triton 3.8)
    truncates fp32 -> bf16, so there the rounding is done on the fp32 bits first (then the
    truncating conversion is exact)."""
    if INTERP and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


# fp32 values per thread of a split-K epilogue's partials in flight at once (sum_splits), at 4 warps
SPLIT_LOAD_VALUES = 64
# Register cap of the split-K kernels. Left alone, ptxas kept them at 34-48 registers and issued the
# epilogue's partial loads a tile or two at a time, each wave waiting on the previous one's adds (the
# 31B down_proj's 16 partials: 10 dependent L2 round trips with sum_splits, 16 before it); capped at
# 128 it issues all 16 before the first add (sm_90 SASS). One or two programs per SM run these grids,
# so the registers cost no occupancy they use. Token tiles of at most 16 (decode steps) only: with 64,
# the cap made the sm_80 main loops spill (24-80 stack bytes, the AOT check), and their partial tiles
# are 4x larger, two at a time in flight anyway.
SPLIT_MAXNREG = 128


def split_epilogue(split: int, block_n: int, block_t: int, num_warps: int = 4) -> dict:
    """The launch parameters of a split-K kernel's epilogue (`sum_splits`): SPLIT_LOADS, the partial
    tiles loaded before adding them (up to 8, SPLIT_LOAD_VALUES fp32 registers per thread in all; the
    tiles are powers of two, so is this), and the register cap (SPLIT_MAXNREG at token tiles <= 16)."""
    if split == 1:
        return dict(SPLIT_LOADS=1, maxnreg=None)
    per_tile = max(1, block_n * block_t // (32 * num_warps))
    return dict(SPLIT_LOADS=max(1, min(8, SPLIT_LOAD_VALUES // per_tile)),
                maxnreg=SPLIT_MAXNREG if block_t <= 16 else None)


@device_helper
def _partial(ptr, s, split_stride, splits, mask):
    return tl.load(ptr + s * split_stride, mask=mask & (s < splits), other=0.0, cache_modifier=".cg")


@device_helper
def sum_splits(ptr, split_stride, splits, mask, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
               LOADS: tl.constexpr):
    """The sum over s in [0, splits) of the fp32 tiles at ptr + s * split_stride (another program
    wrote them: read from L2), added in split order. LOADS (1, 2, 4 or 8) tiles are loaded before any
    is added: a loop that adds each tile as it comes makes one L2 round trip per split, because ptxas
    issues a tile's loads only after the previous tile's adds (sm_90 SASS of the 31B down_proj, 16
    splits: 16 dependent round trips in its epilogue); a split past the end adds 0.0."""
    total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for s0 in range(0, splits, LOADS):
        p0 = _partial(ptr, s0, split_stride, splits, mask)
        if LOADS > 1:
            p1 = _partial(ptr, s0 + 1, split_stride, splits, mask)
        if LOADS > 2:
            p2 = _partial(ptr, s0 + 2, split_stride, splits, mask)
            p3 = _partial(ptr, s0 + 3, split_stride, splits, mask)
        if LOADS > 4:
            p4 = _partial(ptr, s0 + 4, split_stride, splits, mask)
            p5 = _partial(ptr, s0 + 5, split_stride, splits, mask)
            p6 = _partial(ptr, s0 + 6, split_stride, splits, mask)
            p7 = _partial(ptr, s0 + 7, split_stride, splits, mask)
        total += p0
        if LOADS > 1:
            total += p1
        if LOADS > 2:
            total += p2
            total += p3
        if LOADS > 4:
            total += p4
            total += p5
            total += p6
            total += p7
    return total
