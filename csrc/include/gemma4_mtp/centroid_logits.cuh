// Two-stage centroid LM head. Launches, all on one stream with no host synchronisation:
//   scores:     s[t, c] = hidden[t] . centroids[c]      one warp per centroid, all tokens per pass
//   topk:       the top_k clusters per token            one CTA per token, bitonic sort of
//                                                       (score, index) keys in registers, shuffles
//                                                       and shared memory
//   candidates: logit = hidden[t] . lm_head[id] over the K = top_k * V / C gathered rows, one warp per
//               row; writes sparse/dense logits, or a per-CTA (max, lowest id) for argmax
//   argmax:     final reduction of the per-CTA maxima (argmax output only)
// Nothing of size K or V is written for argmax.
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/plan.h"
#include "gemma4_mtp/topk_logic.h"
#include "gemma4_mtp/tree_logic.h"

namespace gemma4_mtp {
namespace centroid {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokens = 8;
constexpr int kSortThreads = 1024;
constexpr int kMaxCentroids = 4096;  // sort keys live in 32 KB of shared memory
constexpr int kCandRows = 32;        // candidate rows per CTA

struct Workspace {
  float* scores;     // [T, C]
  int32_t* clusters;  // [T, top_k]
  ArgMax* partial;   // [T, candidate CTAs]
};

inline int64_t candidate_ctas(const CentroidParams& p) {
  return ceil_div(static_cast<int64_t>(p.top_k) * (p.V / p.C), kCandRows);
}

inline int64_t workspace_bytes(const CentroidParams& p) {
  return round_up(int64_t{4} * p.T * p.C, 16) + round_up(int64_t{4} * p.T * p.top_k, 16) +
         int64_t{8} * p.T * candidate_ctas(p);
}

inline Workspace carve(const CentroidParams& p) {
  char* base = static_cast<char*>(p.workspace);
  Workspace w;
  w.scores = reinterpret_cast<float*>(base);
  base += round_up(int64_t{4} * p.T * p.C, 16);
  w.clusters = reinterpret_cast<int32_t*>(base);
  base += round_up(int64_t{4} * p.T * p.top_k, 16);
  w.partial = reinterpret_cast<ArgMax*>(base);
  return w;
}

// Dot product of one row with the hidden vector of token t; lanes split the row, result in every lane.
template <class T, int VEC>
__device__ __forceinline__ float warp_dot(const T* __restrict__ row, const T* __restrict__ h, int Hd, int lane) {
  float s = 0.f;
  for (int k = lane * VEC; k < Hd; k += 32 * VEC) {
    float a[VEC], x[VEC];
    load_float<VEC>(row + k, a);
    load_float<VEC>(h + k, x);
#pragma unroll
    for (int e = 0; e < VEC; ++e) s = fmaf(a[e], x[e], s);
  }
  return warp_sum(s);
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) scores_kernel(CentroidParams p, Workspace w) {
  const int lane = threadIdx.x & 31;
  const int c = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (c >= p.C) return;
  const T* cen = static_cast<const T*>(p.centroids) + static_cast<int64_t>(c) * p.centroid_stride;
  const T* hid = static_cast<const T*>(p.hidden);
  for (int t0 = 0; t0 < p.T; t0 += kTokens) {
    const int nt = min(kTokens, p.T - t0);
    float acc[kTokens];
#pragma unroll
    for (int j = 0; j < kTokens; ++j) acc[j] = 0.f;
    for (int k = lane * VEC; k < p.Hd; k += 32 * VEC) {
      float a[VEC];
      load_float<VEC>(cen + k, a);
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if (j < nt) {
          float x[VEC];
          load_float<VEC>(hid + static_cast<int64_t>(t0 + j) * p.hidden_stride + k, x);
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[j] = fmaf(a[e], x[e], acc[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const float s = warp_sum(acc[j]);
      if (lane == 0 && j < nt) w.scores[static_cast<int64_t>(t0 + j) * p.C + c] = s;
    }
  }
}

// Descending bitonic sort of ELEMS * kSortThreads keys (padding keys 0 sort last). Thread t holds keys
// ELEMS*t .. ELEMS*t + ELEMS-1 in registers: partners closer than ELEMS are in the thread, closer than
// 32 * ELEMS in the warp (shuffles); only the longer strides go through shared memory.
template <int ELEMS>
__global__ void __launch_bounds__(kSortThreads) topk_kernel(CentroidParams p, Workspace w) {
  constexpr int n = ELEMS * kSortThreads;
  static_assert(n <= kMaxCentroids, "keys fit the shared buffer");
  __shared__ uint64_t keys[n];
  const int t = blockIdx.x;
  const uint32_t base = threadIdx.x * ELEMS;
  uint64_t v[ELEMS];
#pragma unroll
  for (int e = 0; e < ELEMS; ++e) {
    const uint32_t i = base + e;
    v[e] = i < static_cast<uint32_t>(p.C) ? topk_key(w.scores[static_cast<int64_t>(t) * p.C + i], i) : 0;
  }
  for (uint32_t k = 2; k <= n; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      if (j < ELEMS) {
        // the register index must be a compile-time constant: one branch per in-thread stride
#pragma unroll
        for (uint32_t jj = 1; jj < ELEMS; jj <<= 1) {
          if (jj == j) {
            uint64_t old[ELEMS];
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) old[e] = v[e];
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) v[e] = bitonic_exchange(base + e, jj, k, old[e], old[e ^ jj]);
          }
        }
      } else if (j < 32 * ELEMS) {
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) {
          const uint64_t theirs = __shfl_xor_sync(0xffffffffu, v[e], static_cast<int>(j / ELEMS));
          v[e] = bitonic_exchange(base + e, j, k, v[e], theirs);
        }
      } else {
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) keys[base + e] = v[e];
        __syncthreads();
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) v[e] = bitonic_exchange(base + e, j, k, v[e], keys[(base + e) ^ j]);
        __syncthreads();  // the buffer is rewritten by the next shared-memory stage
      }
    }
  }
#pragma unroll
  for (int e = 0; e < ELEMS; ++e)
    if (base + e < static_cast<uint32_t>(p.top_k))
      w.clusters[static_cast<int64_t>(t) * p.top_k + base + e] = static_cast<int32_t>(topk_key_index(v[e]));
}

template <class T, int VEC>
__global__ void __launch_bounds__(kThreads) candidates_kernel(CentroidParams p, Workspace w) {
  __shared__ ArgMax best_warp[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.y;
  const int64_t cs = p.V / p.C;
  const int64_t K = static_cast<int64_t>(p.top_k) * cs;
  const T* h = static_cast<const T*>(p.hidden) + static_cast<int64_t>(t) * p.hidden_stride;
  const T* lm = static_cast<const T*>(p.lm_head);
  ArgMax best = argmax_identity();
  for (int r = warp; r < kCandRows; r += kWarps) {
    const int64_t kpos = static_cast<int64_t>(blockIdx.x) * kCandRows + r;
    if (kpos >= K) break;
    const int64_t cluster = w.clusters[static_cast<int64_t>(t) * p.top_k + kpos / cs];
    const int64_t o = cluster * cs + kpos % cs;
    const int64_t id = p.ordering_int64 ? static_cast<const int64_t*>(p.token_ordering)[o]
                                        : static_cast<int64_t>(static_cast<const int32_t*>(p.token_ordering)[o]);
    const bool valid = id >= 0 && id < p.V;
    const float logit = valid ? warp_dot<T, VEC>(lm + id * p.lm_head_stride, h, p.Hd, lane) : NAN;
    if (lane == 0) {
      if (p.output == CentroidOutput::kSparse) {
        p.ids[t * K + kpos] = valid ? id : -1;
        p.logits[t * K + kpos] = logit;
      } else if (p.output == CentroidOutput::kDense) {
        if (valid) p.logits[static_cast<int64_t>(t) * p.V + id] = logit;
      } else if (valid) {
        best = argmax_merge(best, ArgMax{logit, static_cast<int>(id)});
      }
    }
  }
  if (p.output != CentroidOutput::kArgmax) return;
  if (lane == 0) best_warp[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    ArgMax b = best_warp[0];
    for (int i = 1; i < kWarps; ++i) b = argmax_merge(b, best_warp[i]);
    w.partial[static_cast<int64_t>(t) * gridDim.x + blockIdx.x] = b;
  }
}

__global__ void argmax_kernel(CentroidParams p, Workspace w, int parts) {
  const int t = blockIdx.x;
  ArgMax best = argmax_identity();
  for (int i = threadIdx.x; i < parts; i += 32) best = argmax_merge(best, w.partial[static_cast<int64_t>(t) * parts + i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax other{__shfl_xor_sync(0xffffffffu, best.value, o), __shfl_xor_sync(0xffffffffu, best.index, o)};
    best = argmax_merge(best, other);
  }
  if (threadIdx.x == 0) {
    p.ids[t] = best.index == kNoIndex ? -1 : best.index;
    p.logits[t] = best.index == kNoIndex ? NAN : best.value;
  }
}

template <class T, int VEC>
cudaError_t launch_vec(const CentroidParams& p, cudaStream_t stream) {
  const Workspace w = carve(p);
  scores_kernel<T, VEC><<<static_cast<unsigned>(ceil_div(p.C, kWarps)), kThreads, 0, stream>>>(p, w);
  if (p.C <= 2 * kSortThreads) {
    topk_kernel<2><<<p.T, kSortThreads, 0, stream>>>(p, w);
  } else {
    topk_kernel<4><<<p.T, kSortThreads, 0, stream>>>(p, w);
  }
  const int64_t ctas = candidate_ctas(p);
  candidates_kernel<T, VEC><<<dim3(static_cast<unsigned>(ctas), p.T), kThreads, 0, stream>>>(p, w);
  if (p.output == CentroidOutput::kArgmax) argmax_kernel<<<p.T, 32, 0, stream>>>(p, w, static_cast<int>(ctas));
  return cudaGetLastError();
}

}  // namespace centroid

inline int64_t centroid_workspace_bytes(const CentroidParams& p) { return centroid::workspace_bytes(p); }

// Launches the centroid head for element type T (float, __half, __nv_bfloat16). Requires
// 1 <= top_k <= C <= 4096, V a nonzero multiple of C and p.workspace of centroid_workspace_bytes(p) bytes.
template <class T>
cudaError_t centroid_logits(const CentroidParams& p, cudaStream_t stream) {
  if (p.T <= 0) return cudaSuccess;
  if (p.C < 1 || p.C > centroid::kMaxCentroids || p.top_k < 1 || p.top_k > p.C || p.V < p.C || p.V % p.C || p.Hd < 0 ||
      p.workspace == nullptr || p.T > 65535)
    return cudaErrorInvalidValue;
  constexpr int V = kVec16<T>;
  const bool vec = p.Hd % V == 0 && p.hidden_stride % V == 0 && p.centroid_stride % V == 0 &&
                   p.lm_head_stride % V == 0 && host_aligned16(p.hidden) && host_aligned16(p.centroids) &&
                   host_aligned16(p.lm_head);
  return vec ? centroid::launch_vec<T, V>(p, stream) : centroid::launch_vec<T, 1>(p, stream);
}

}  // namespace gemma4_mtp
