// The tensor-core GEMV steps shared by fused_concat_down_proj.cuh and rms_norm_linear.cuh: one 32-wide k
// step of a 16-token x 32-row tile from operands loaded as 16-byte vectors (down_proj_logic.h's fragment
// mapping), the sum of the CTA's warps' tiles, and the last-CTA election of a split-k reduction.
#pragma once

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/down_proj_logic.h"

namespace gemma4_mtp {

constexpr int kPrefetchLines = 4;  // 128-byte lines per thread before griddep_wait: 128 KiB per CTA

// L2 prefetch of a CTA's 32 weight rows over elements [k_lo, k_hi) (thread: its row `row`, the
// CTA's row tid % 32 or null past the weight; lines tid / 32 + 8 j), issued before griddep_wait:
// weights are not the previous kernel's output, and a prefetch holds no register.
template <class T>
__device__ __forceinline__ void prefetch_weight_rows(const T* row, int k_lo, int k_hi) {
  if (row == nullptr || k_hi <= k_lo) return;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(row + k_lo) & ~uintptr_t{127};
  const uintptr_t hi = reinterpret_cast<uintptr_t>(row + k_hi);
#pragma unroll
  for (int j = 0; j < kPrefetchLines; ++j) {
    const uintptr_t line = lo + 128 * (threadIdx.x / 32 + 8 * j);
    if (line < hi) prefetch_l2(reinterpret_cast<const void*>(line));
  }
}

// The lane's 16-byte B vectors of one k step: row g of each n8 tile (wrow[nt], null past the weight's
// rows) at element k; zeros where !live.
template <class T>
__device__ __forceinline__ void load_gemv_weights(uint4 (&wf)[kMmaRowTiles], const T* const (&wrow)[kMmaRowTiles],
                                                  int k, bool live) {
#pragma unroll
  for (int nt = 0; nt < kMmaRowTiles; ++nt)
    wf[nt] = live && wrow[nt] != nullptr ? __ldg(reinterpret_cast<const uint4*>(wrow[nt] + k)) : make_uint4(0u, 0u, 0u, 0u);
}

// acc[nt] += A W^T over one k step: A = the lane's 8 elements of token rows g (a_lo) and g + 8 (a_hi),
// W = its 8 elements of row g of each n8 tile (wf[nt]); the two k16 halves of the step.
template <class T>
__device__ __forceinline__ void mma_gemv_step(float (&acc)[kMmaRowTiles][4], const uint4& a_lo, const uint4& a_hi,
                                              const uint4 (&wf)[kMmaRowTiles]) {
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {
    uint32_t a[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = uint4_word((r & 1) ? a_hi : a_lo, mma_a_elem(kb, r) / 2);
#pragma unroll
    for (int nt = 0; nt < kMmaRowTiles; ++nt) {
      const uint32_t b[2] = {uint4_word(wf[nt], mma_b_elem(kb, 0) / 2), uint4_word(wf[nt], mma_b_elem(kb, 1) / 2)};
      mma_m16n8k16<T>(acc[nt], a, b);
    }
  }
}

// Floats of one warp's accumulators: MT m16 token tiles x kMmaRowTiles n8 tiles x 4.
template <int MT>
constexpr int kMmaAccRegs = MT * kMmaRowTiles * 4;

// Sums the kMmaWarps warps' accumulators into warp 0's, halving through `red` (shared memory of
// kMmaWarps / 2 x kMmaAccRegs<MT> x 32 floats): the same order on every run. Every thread calls it.
template <int MT>
__device__ __forceinline__ void sum_warp_tiles(float (&acc)[MT][kMmaRowTiles][4], float (*red)[kMmaAccRegs<MT>][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int half = kMmaWarps / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) red[warp - half][(mt * kMmaRowTiles + nt) * 4 + c][lane] = acc[mt][nt][c];
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[mt][nt][c] += red[warp][(mt * kMmaRowTiles + nt) * 4 + c][lane];
    }
    __syncthreads();
  }
}

// Whether this CTA is the last of `arrivals` CTAs to reach `counter` (the same answer in every thread):
// the CTA's writes before the call are published first (bar.sync, then thread 0's fence and atomic),
// and for the last one the other arrivals' published writes are ordered before what follows (read them
// with .cg loads: L1 is not coherent). `flag` is a shared int. Every thread of the CTA calls it.
__device__ __forceinline__ bool last_to_arrive(int32_t* counter, int arrivals, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *flag = atomicAdd(counter, 1) == arrivals - 1;
  }
  __syncthreads();
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}

}  // namespace gemma4_mtp
