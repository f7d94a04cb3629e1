// fused_concat_down_proj: y[t] = W @ concat(round(E[token_t] * round(s)), h[t]) without materialising
// the concat or the gathered embedding rows. Memory bound on W for the drafter's small T: each CTA
// owns R rows of W, its 256 threads split the K = 2 * Hb dimension (16-byte loads), and up to 8 tokens
// are accumulated per pass so W is read once per 8 tokens. fp32 accumulation; warp-shuffle reduction,
// then across the CTA's warps in shared memory.
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/plan.h"

namespace gemma4_mtp {
namespace down_proj {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokens = 8;  // tokens accumulated per pass over W
// 16-byte weight loads each thread issues before consuming any: R rows x U = kWeightLoadsInFlight / R
// vectors per row, so R = 1 and 2 (small Hd) batch like R = 4 already did. Little's law: to stream W at
// H200's ~4.8 TB/s with ~600 ns of DRAM latency, ~4.8e12 B/s * 600e-9 s ~ 2.9 MB must be in flight,
// ~22 KB per SM over 132 SMs. A 256-thread CTA with one vector per thread has 4 KB in flight; with 4
// it has 16 KB, and two resident CTAs (<= 128 registers each) 32 KB.
constexpr int kWeightLoadsInFlight = 4;

template <class T, int VEC, int R>
__global__ void __launch_bounds__(kThreads) kernel(DownProjParams p) {
  const T* __restrict__ table = static_cast<const T*>(p.embed_table);
  const T* __restrict__ hidden = static_cast<const T*>(p.hidden);
  const T* __restrict__ weight = static_cast<const T*>(p.weight);
  T* __restrict__ out = static_cast<T*>(p.out);
  const int row0 = blockIdx.x * R;
  const int K = 2 * p.Hb;
  const int nvec = K / VEC;
  // Gemma's scaled embedding: the scale and the product are both rounded to the table dtype.
  const float scale = to_float(from_float<T>(p.embed_scale));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  __shared__ int64_t ids[kTokens];
  __shared__ float partial[R][kTokens][kWarps];

  for (int t0 = 0; t0 < p.T; t0 += kTokens) {
    const int nt = min(kTokens, p.T - t0);
    if (threadIdx.x < nt) {
      const int t = t0 + threadIdx.x;
      int64_t id = p.token_ids_int64 ? static_cast<const int64_t*>(p.token_ids)[t]
                                     : static_cast<int64_t>(static_cast<const int32_t*>(p.token_ids)[t]);
      ids[threadIdx.x] = (id >= 0 && id < p.vocab) ? id : -1;
    }
    __syncthreads();

    float acc[R][kTokens];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < kTokens; ++j) acc[r][j] = 0.f;

    // kUnroll vectors of each of the R rows per thread: their weight loads are issued together, then
    // consumed in the thread's ascending v order, so every acc[r][j] sums the same terms in the same
    // order as a one-vector loop. The thread's last batch may be partial: its missing vectors are
    // neither loaded nor consumed. Hb % VEC == 0, so a vector never straddles the two halves.
    constexpr int kUnroll = kWeightLoadsInFlight / R > 1 ? kWeightLoadsInFlight / R : 1;
    for (int v0 = threadIdx.x; v0 < nvec; v0 += kUnroll * kThreads) {
      float w[kUnroll][R][VEC];
#pragma unroll
      for (int l = 0; l < kUnroll; ++l)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int v = v0 + l * kThreads;
          if (v < nvec && row0 + r < p.Hd) {
            load_float<VEC>(weight + static_cast<int64_t>(row0 + r) * p.weight_stride + v * VEC, w[l][r]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) w[l][r][e] = 0.f;
          }
        }
#pragma unroll
      for (int l = 0; l < kUnroll; ++l) {
        const int k = (v0 + l * kThreads) * VEC;
        if (k >= K) break;
        const bool embed_half = k < p.Hb;
#pragma unroll
        for (int j = 0; j < kTokens; ++j) {
          if (j >= nt) break;
          float x[VEC];
          if (embed_half) {
            const int64_t id = ids[j];
            if (id >= 0) {
              load_float<VEC>(table + id * p.table_stride + k, x);
#pragma unroll
              for (int e = 0; e < VEC; ++e) x[e] = to_float(from_float<T>(x[e] * scale));
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) x[e] = NAN;
            }
          } else {
            load_float<VEC>(hidden + static_cast<int64_t>(t0 + j) * p.hidden_stride + (k - p.Hb), x);
          }
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[r][j] = fmaf(w[l][r][e], x[e], acc[r][j]);
        }
      }
    }

#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        const float s = warp_sum(acc[r][j]);
        if (lane == 0) partial[r][j][warp] = s;
      }
    __syncthreads();
    if (threadIdx.x < R * kTokens) {
      const int r = threadIdx.x / kTokens, j = threadIdx.x % kTokens;
      if (j < nt && row0 + r < p.Hd) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += partial[r][j][w];
        out[static_cast<int64_t>(t0 + j) * p.out_stride + row0 + r] = from_float<T>(s);
      }
    }
    __syncthreads();  // ids and partial are rewritten by the next pass
  }
}

template <class T, int VEC>
cudaError_t launch_vec(const DownProjParams& p, int rows_per_cta, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.Hd, rows_per_cta)));
  switch (rows_per_cta) {
    case 4: kernel<T, VEC, 4><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: kernel<T, VEC, 2><<<grid, kThreads, 0, stream>>>(p); break;
    default: kernel<T, VEC, 1><<<grid, kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace down_proj

// Launches the down projection for element type T (float, __half, __nv_bfloat16).
template <class T>
cudaError_t fused_concat_down_proj(const DownProjParams& p, cudaStream_t stream) {
  if (p.T <= 0 || p.Hd <= 0) return cudaSuccess;
  if (p.Hb < 0) return cudaErrorInvalidValue;  // Hb == 0 is legal: y = 0
  constexpr int V = kVec16<T>;
  const bool vec = p.Hb % V == 0 && p.table_stride % V == 0 && p.hidden_stride % V == 0 &&
                   p.weight_stride % V == 0 && host_aligned16(p.embed_table) && host_aligned16(p.hidden) &&
                   host_aligned16(p.weight);
  const int rows = plan_rows_per_cta(p.Hd, device_sm_count());
  return vec ? down_proj::launch_vec<T, V>(p, rows, stream) : down_proj::launch_vec<T, 1>(p, rows, stream);
}

}  // namespace gemma4_mtp
