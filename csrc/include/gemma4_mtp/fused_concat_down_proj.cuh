// fused_concat_down_proj: y[t] = W @ concat(round(E[token_t] * round(s)), h[t]) without materialising
// the concat or the gathered embedding rows. Memory bound on W (Hd x 2Hb: 1.5 MiB for E2B, 21 MiB for
// 31B in bf16) for the drafter's T <= 64; the T x 2Hb activations are small and come from L2.
//
// bf16 / fp16 with 16-byte aligned rows: tensor cores (mma.sync m16n8k16, sm_80+), for every T (at
// T = 1 the mma does 16x the needed multiply-adds for free; the cost is the weight stream). A CTA owns
// 32 weight rows x up to 64 tokens and a range of 32-wide k steps; its 8 warps take every 8th step, each
// lane loading one 16-byte vector per weight row and token row per step straight into mma fragments
// (down_proj_logic.h: the same k permutation for both operands), several steps' loads issued before
// any is consumed. The warps' tiles are summed in shared memory. When 32-row tiles alone cannot fill the
// GPU (every drafter: Hd <= 1024 is at most 32 tiles), the k range is split over CTAs: each writes an
// fp32 partial tile and the last CTA of a tile to finish (a counter, left zero) sums the partials in
// split order (deterministic) and writes the output. One launch either way.
// fp32, or rows that 16-byte loads cannot assume: the CUDA-core kernel below (R rows per CTA, 256
// threads split K, up to 8 tokens per pass over W).
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/down_proj_logic.h"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
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
__global__ void __launch_bounds__(kThreads, 2) kernel(DownProjParams p) {
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
  griddep_wait();  // the token ids and hidden states may be the previous kernel's output
  griddep_launch_dependents();

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
cudaError_t launch_vec(const DownProjParams& p, int rows_per_cta, bool pdl, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.Hd, rows_per_cta)));
  switch (rows_per_cta) {
    case 4: return launch(kernel<T, VEC, 4>, grid, kThreads, 0, pdl, stream, p);
    case 2: return launch(kernel<T, VEC, 2>, grid, kThreads, 0, pdl, stream, p);
    default: return launch(kernel<T, VEC, 1>, grid, kThreads, 0, pdl, stream, p);
  }
}


// ---------------------------------------------------------------- tensor-core path

// Loads the lane's 8 elements of concat row r at k (zero past K or for a token past T); embedding
// elements are only flagged here and converted by to_concat, so that every load of a step is issued
// before the first conversion waits for one.
template <class T>
struct XLoad {
  uint4 raw;
  bool embed;  // raw holds embedding elements (scale and round them) ...
  bool bad;    // ... of an out-of-range token id (the row becomes NaN)
};

template <class T>
__device__ __forceinline__ XLoad<T> load_x(const T* erow, const T* hrow, int k, int Hb, bool live) {
  XLoad<T> x{make_uint4(0u, 0u, 0u, 0u), false, false};
  if (!live || hrow == nullptr) return x;
  if (k < Hb) {
    x.embed = true;
    x.bad = erow == nullptr;
    if (erow != nullptr) x.raw = __ldg(reinterpret_cast<const uint4*>(erow + k));
  } else {
    x.raw = __ldg(reinterpret_cast<const uint4*>(hrow + (k - Hb)));
  }
  return x;
}

// Gemma's scaled embedding: the product rounded to the table dtype (the scale already is).
template <class T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t pair, float scale) {
  union {
    uint32_t u;
    T e[2];
  } v;
  v.u = pair;
  v.e[0] = from_float<T>(to_float(v.e[0]) * scale);
  v.e[1] = from_float<T>(to_float(v.e[1]) * scale);
  return v.u;
}

template <class T>
__device__ __forceinline__ uint4 to_concat(const XLoad<T>& x, float scale) {
  if (!x.embed) return x.raw;
  if (x.bad) {
    const uint32_t nan2 = std::is_same_v<T, __nv_bfloat16> ? 0x7fc07fc0u : 0x7e007e00u;
    return make_uint4(nan2, nan2, nan2, nan2);
  }
  return make_uint4(scale_pair<T>(x.raw.x, scale), scale_pair<T>(x.raw.y, scale), scale_pair<T>(x.raw.z, scale),
                    scale_pair<T>(x.raw.w, scale));
}

// MT m16 tiles of tokens (16 * MT per CTA); U steps of loads in flight per warp before any mma.
template <class T, int MT>
__global__ void __launch_bounds__(kMmaWarps * 32, 1) mma_kernel(DownProjParams p, DownProjPlan plan) {
  constexpr int U = MT == 1 ? 4 : 2;
  constexpr int kTok = 16 * MT;
  __shared__ const T* erow[kTok];  // embedding row of each token (nullptr: id out of range)
  __shared__ const T* hrow[kTok];  // hidden row (nullptr: token past T)
  __shared__ float red[kMmaWarps / 2][kMmaAccRegs<MT>][32];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * kMmaRowsPerCta;
  const int t0 = blockIdx.y * kTok;
  const T* table = static_cast<const T*>(p.embed_table);
  const T* weight = static_cast<const T*>(p.weight);
  const int K = 2 * p.Hb;
  const int s_end = min(static_cast<int>(ceil_div(K, kMmaStepK)), (blockIdx.z + 1) * plan.steps_per_split);
  auto weight_row = [&](int n) { return n < p.Hd ? weight + static_cast<int64_t>(n) * p.weight_stride : nullptr; };
  const T* wrow[kMmaRowTiles];
#pragma unroll
  for (int nt = 0; nt < kMmaRowTiles; ++nt) wrow[nt] = weight_row(n0 + nt * 8 + mma_b_row(lane));
  prefetch_weight_rows(weight_row(n0 + (threadIdx.x & 31)),
                       static_cast<int>(blockIdx.z) * plan.steps_per_split * kMmaStepK, min(s_end * kMmaStepK, K));
  griddep_wait();  // the token ids and hidden states may be the previous kernel's output
  griddep_launch_dependents();
  if (threadIdx.x < kTok) {
    const int t = t0 + threadIdx.x;
    const T* e = nullptr;
    const T* h = nullptr;
    if (t < p.T) {
      const int64_t id = p.token_ids_int64 ? static_cast<const int64_t*>(p.token_ids)[t]
                                           : static_cast<int64_t>(static_cast<const int32_t*>(p.token_ids)[t]);
      if (id >= 0 && id < p.vocab) e = table + id * p.table_stride;
      h = static_cast<const T*>(p.hidden) + static_cast<int64_t>(t) * p.hidden_stride;
    }
    erow[threadIdx.x] = e;
    hrow[threadIdx.x] = h;
  }
  __syncthreads();
  const float scale = to_float(from_float<T>(p.embed_scale));
  const int lk = mma_lane_k(lane);
  float acc[MT][kMmaRowTiles][4] = {};

  for (int s0 = blockIdx.z * plan.steps_per_split + warp; s0 < s_end; s0 += kMmaWarps * U) {
    uint4 wf[U][kMmaRowTiles];
    XLoad<T> xa[U][MT], xb[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s0 + u * kMmaWarps) * kMmaStepK + lk;
      const bool live = s0 + u * kMmaWarps < s_end && k < K;
      load_gemv_weights(wf[u], wrow, k, live);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int ra = mt * 16 + mma_a_row(lane, 0), rb = mt * 16 + mma_a_row(lane, 1);
        xa[u][mt] = load_x<T>(erow[ra], hrow[ra], k, p.Hb, live);
        xb[u][mt] = load_x<T>(erow[rb], hrow[rb], k, p.Hb, live);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_gemv_step<T>(acc[mt], to_concat<T>(xa[u][mt], scale), to_concat<T>(xb[u][mt], scale), wf[u]);
      }
  }
  sum_warp_tiles<MT>(acc, red);

  T* out = static_cast<T*>(p.out);
  if (plan.splits == 1) {
    if (warp == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int t = t0 + mt * 16 + mma_c_token(lane, c), n = n0 + nt * 8 + mma_c_row(lane, c);
            if (t < p.T && n < p.Hd) out[static_cast<int64_t>(t) * p.out_stride + n] = from_float<T>(acc[mt][nt][c]);
          }
    }
    return;
  }
  // split k: an fp32 partial per split; the tile's last CTA sums them in split order
  float* part = p.partials;
  const int64_t tile_elems = static_cast<int64_t>(p.T) * p.Hd;
  if (warp == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int t = t0 + mt * 16 + mma_c_token(lane, c), n = n0 + nt * 8 + mma_c_row(lane, c);
          if (t < p.T && n < p.Hd) part[blockIdx.z * tile_elems + static_cast<int64_t>(t) * p.Hd + n] = acc[mt][nt][c];
        }
  }
  int32_t* counter = p.counters + blockIdx.y * gridDim.x + blockIdx.x;
  if (!last_to_arrive(counter, plan.splits, &last)) return;
  for (int e = threadIdx.x; e < kTok * kMmaRowsPerCta; e += blockDim.x) {
    const int t = t0 + e / kMmaRowsPerCta, n = n0 + e % kMmaRowsPerCta;
    if (t >= p.T || n >= p.Hd) continue;
    float sum = 0.f;
    for (int s = 0; s < plan.splits; ++s) sum += __ldcg(part + s * tile_elems + static_cast<int64_t>(t) * p.Hd + n);
    out[static_cast<int64_t>(t) * p.out_stride + n] = from_float<T>(sum);
  }
  if (threadIdx.x == 0) *counter = 0;
}

template <class T>
cudaError_t launch_mma(const DownProjParams& p, const DownProjPlan& plan, bool pdl, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.row_tiles), static_cast<unsigned>(plan.token_tiles),
                  static_cast<unsigned>(plan.splits));
  switch (plan.token_tiles_m16) {
    case 1: return launch(mma_kernel<T, 1>, grid, kMmaWarps * 32, 0, pdl, stream, p, plan);
    case 2: return launch(mma_kernel<T, 2>, grid, kMmaWarps * 32, 0, pdl, stream, p, plan);
    case 3: return launch(mma_kernel<T, 3>, grid, kMmaWarps * 32, 0, pdl, stream, p, plan);
    default: return launch(mma_kernel<T, 4>, grid, kMmaWarps * 32, 0, pdl, stream, p, plan);
  }
}

}  // namespace down_proj

// Whether every row the kernels read with 16-byte loads starts 16-byte aligned (pointers, row strides, Hb).
template <class T>
bool down_proj_rows_aligned(const DownProjParams& p) {
  constexpr int V = kVec16<T>;
  return p.Hb % V == 0 && p.table_stride % V == 0 && p.hidden_stride % V == 0 && p.weight_stride % V == 0 &&
         host_aligned16(p.embed_table) && host_aligned16(p.hidden) && host_aligned16(p.weight);
}

// Whether the launch takes the tensor-core path: bf16 / fp16 with aligned rows.
template <class T>
bool down_proj_uses_mma(const DownProjParams& p) {
  return sizeof(T) == 2 && down_proj_rows_aligned<T>(p);
}

// Fills p.plan (the tensor-core path's grid) for a device with num_sms SMs; returns the bytes of fp32
// partials (p.partials) and, in *counters, the int32 counters (p.counters, zero before the first launch,
// left zero) a launch needs.
template <class T>
int64_t down_proj_prepare(DownProjParams& p, int num_sms, int64_t* counters) {
  p.plan = plan_down_proj(p.T, p.Hb, p.Hd, num_sms);
  const bool split = down_proj_uses_mma<T>(p) && p.plan.splits > 1;
  *counters = split ? down_proj_counters(p.plan) : 0;
  return split ? int64_t{4} * p.plan.splits * p.T * p.Hd : 0;
}

// Launches the down projection for element type T (float, __half, __nv_bfloat16) after
// down_proj_prepare(p).
template <class T>
cudaError_t fused_concat_down_proj(const DownProjParams& p, cudaStream_t stream) {
  if (p.T <= 0 || p.Hd <= 0) return cudaSuccess;
  if (p.Hb < 0) return cudaErrorInvalidValue;  // Hb == 0 is legal: y = 0
  DeviceInfo dev;
  const cudaError_t err = device_info(&dev);
  if (err != cudaSuccess) return err;
  if (down_proj_uses_mma<T>(p)) {
    if (p.plan.splits < 1 || p.plan.steps_per_split < 1 || p.plan.row_tiles < 1 || p.plan.token_tiles < 1)
      return cudaErrorInvalidValue;
    if (p.plan.splits > 1 && (p.partials == nullptr || p.counters == nullptr)) return cudaErrorInvalidValue;
    if constexpr (sizeof(T) == 2) return down_proj::launch_mma<T>(p, p.plan, dev.pdl, stream);
  }
  const int rows = plan_rows_per_cta(p.Hd, device_sm_count());
  return down_proj_rows_aligned<T>(p) ? down_proj::launch_vec<T, kVec16<T>>(p, rows, dev.pdl, stream)
                                      : down_proj::launch_vec<T, 1>(p, rows, dev.pdl, stream);
}

}  // namespace gemma4_mtp
