// dense_lm_head: the 26B / 31B drafters' 262144 x 1024 LM head read once in its own dtype, with the
// top-k of each token's fp32 logits kept on the fly (no fp32 copy of the head, no [T, V] logits, no
// sort over V), or the dense fp32 logits for sampling.
//
// Memory bound on the head (512 MiB in bf16). Kernel 1: each CTA owns a contiguous run of rows; a
// warp takes kRows rows at a time, its lanes stride the Hd dimension with 16-byte loads (all kRows *
// Hd / (32 * VEC) loads of a lane issued before any is consumed), the hidden rows of up to kTokens
// tokens sit in shared memory, fp32 FMAs, one warp_sum per (row, token). Lane j keeps token j's best
// K (score, row) pairs as 64-bit keys (topk_logic.h: higher score first, then lower index; -0 ties
// +0, NaN ranks first as in torch's sort) in registers; the CTA's warps merge their lists in shared
// memory and publish one list per token. More than kTokens tokens: another pass over the CTA's rows
// per group of kTokens. Kernel 2: one CTA per token merges the published lists (threads scan, then a
// tree of pairwise list merges) and writes ids (int64) and logits (fp32), best first.
// Little's law as in fused_concat_down_proj.cuh: 2 rows x 4 vectors of 16 bytes per lane (Hd 1024,
// bf16) and 8 warps give 32 KiB in flight per CTA, 2 CTAs per SM: ~64 KiB per SM (H200 needs ~22).
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/dense_lm_head_params.h"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/topk_logic.h"

namespace gemma4_mtp {

// The inverse of orderable_bits (topk_logic.h): the score a key was made from (-0 comes back as +0).
G4_HD float key_score(uint64_t key) {
  const uint32_t ob = static_cast<uint32_t>(key >> 32);
  const uint32_t b = (ob & 0x80000000u) ? (ob & 0x7fffffffu) : ~ob;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

namespace dense_head {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokens = 8;  // tokens per pass over the rows
constexpr int kRows = 2;    // rows a warp streams at a time

// key with the lowest rank: below every (score, index) key
constexpr uint64_t kEmpty = 0;

template <int K>
__device__ __forceinline__ void insert(uint64_t (&best)[K], uint64_t key) {
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const uint64_t b = best[i];
    best[i] = key > b ? key : b;
    key = key > b ? b : key;
  }
}

__device__ __forceinline__ uint64_t score_key(float s, int row) {
  return topk_key(orderable_bits(s != s ? NAN : s), static_cast<uint32_t>(row));  // one NaN: every NaN ranks first
}

// Shared memory of kernel 1: the kTokens hidden rows of a pass.
inline size_t smem_bytes(int Hd, size_t elem) { return static_cast<size_t>(kTokens) * Hd * elem; }

template <class T, int VEC, int K>
__global__ void __launch_bounds__(kThreads, 2) rows_kernel(DenseHeadParams p) {
  T* hid = reinterpret_cast<T*>(dynamic_smem());
  __shared__ uint64_t lists[kWarps][kTokens][K];
  griddep_wait();  // the hidden states are the previous kernel's output
  griddep_launch_dependents();
  const T* __restrict__ hidden = static_cast<const T*>(p.hidden);
  const T* __restrict__ head = static_cast<const T*>(p.lm_head);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_cta = static_cast<int>(ceil_div(p.V, p.num_ctas));
  const int lo = blockIdx.x * per_cta, hi = min(p.V, lo + per_cta);
  const int nvec = p.Hd / VEC;

  for (int t0 = 0; t0 < p.T; t0 += kTokens) {
    const int nt = min(kTokens, p.T - t0);
    __syncthreads();  // the previous pass is done with hid and lists
    for (int i = threadIdx.x; i < kTokens * p.Hd; i += kThreads) {
      const int j = i / p.Hd, d = i % p.Hd;
      hid[i] = j < nt ? hidden[static_cast<int64_t>(t0 + j) * p.hidden_stride + d] : from_float<T>(0.f);
    }
    __syncthreads();

    uint64_t best[K];
#pragma unroll
    for (int i = 0; i < K; ++i) best[i] = kEmpty;

    for (int row0 = lo + warp * kRows; row0 < hi; row0 += kWarps * kRows) {
      float acc[kRows][kTokens];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < kTokens; ++j) acc[r][j] = 0.f;
      for (int v = lane; v < nvec; v += 32) {
        float w[kRows][VEC];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (row0 + r < hi) {
            load_float<VEC>(head + static_cast<int64_t>(row0 + r) * p.head_stride + v * VEC, w[r]);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) w[r][e] = 0.f;
          }
        }
#pragma unroll
        for (int j = 0; j < kTokens; ++j) {
          if (j >= nt) break;
          float x[VEC];
          load_float<VEC>(hid + j * p.Hd + v * VEC, x);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[r][j] = fmaf(w[r][e], x[e], acc[r][j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if (j >= nt) break;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float s = warp_sum(acc[r][j]);
          if (row0 + r < hi && lane == j) {
            if (p.dense != nullptr) {
              p.dense[static_cast<int64_t>(t0 + j) * p.dense_stride + row0 + r] = s;
            } else {
              insert<K>(best, score_key(s, row0 + r));
            }
          }
        }
      }
    }
    if (p.dense != nullptr) continue;
    if (lane < nt) {
#pragma unroll
      for (int i = 0; i < K; ++i) lists[warp][lane][i] = best[i];
    }
    __syncthreads();
    if (threadIdx.x < nt) {
      uint64_t merged[K];
#pragma unroll
      for (int i = 0; i < K; ++i) merged[i] = kEmpty;
      for (int w = 0; w < kWarps; ++w)
#pragma unroll
        for (int i = 0; i < K; ++i) insert<K>(merged, lists[w][threadIdx.x][i]);
      uint64_t* dst = p.partial + (static_cast<int64_t>(blockIdx.x) * p.T + t0 + threadIdx.x) * K;
#pragma unroll
      for (int i = 0; i < K; ++i) dst[i] = merged[i];
    }
  }
}

constexpr int kMergeThreads = 128;

template <int K>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(DenseHeadParams p) {
  __shared__ uint64_t lists[kMergeThreads][K];
  griddep_wait();  // the lists are the rows kernel's output
  const int t = blockIdx.x;
  uint64_t best[K];
#pragma unroll
  for (int i = 0; i < K; ++i) best[i] = kEmpty;
  const int64_t n = static_cast<int64_t>(p.num_ctas) * K;
  for (int64_t c = threadIdx.x; c < n; c += kMergeThreads) {
    const int64_t cta = c / K, i = c % K;
    insert<K>(best, p.partial[(cta * p.T + t) * K + i]);
  }
#pragma unroll
  for (int i = 0; i < K; ++i) lists[threadIdx.x][i] = best[i];
  __syncthreads();
  for (int s = kMergeThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
#pragma unroll
      for (int i = 0; i < K; ++i) insert<K>(best, lists[threadIdx.x + s][i]);
#pragma unroll
      for (int i = 0; i < K; ++i) lists[threadIdx.x][i] = best[i];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      if (i < p.k) {
        p.out_ids[static_cast<int64_t>(t) * p.k + i] = topk_key_index(best[i]);
        p.out_logits[static_cast<int64_t>(t) * p.k + i] = key_score(best[i]);
      }
    }
  }
}

template <class T, int VEC, int K>
cudaError_t launch_k(const DenseHeadParams& p, bool pdl, cudaStream_t stream) {
  const cudaError_t err = launch(rows_kernel<T, VEC, K>, dim3(p.num_ctas), kThreads, smem_bytes(p.Hd, sizeof(T)), pdl,
                                 stream, p);
  if (err != cudaSuccess || p.dense != nullptr) return err;
  return launch(merge_kernel<K>, dim3(p.T), kMergeThreads, 0, pdl, stream, p);
}

template <class T, int VEC>
cudaError_t launch_vec(const DenseHeadParams& p, int K, bool pdl, cudaStream_t stream) {
  switch (K) {
    case 1: return launch_k<T, VEC, 1>(p, pdl, stream);
    case 2: return launch_k<T, VEC, 2>(p, pdl, stream);
    case 4: return launch_k<T, VEC, 4>(p, pdl, stream);
    case 8: return launch_k<T, VEC, 8>(p, pdl, stream);
    case 16: return launch_k<T, VEC, 16>(p, pdl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dense_head

// K of the kernels' lists for a top-k call (a power of two >= k; 1 for the dense output).
inline int dense_head_list_size(int k) {
  int K = 1;
  while (K < k) K *= 2;
  return K;
}

// CTAs of kernel 1: two per SM, at least kRows * kWarps rows each.
inline int dense_head_ctas(int V, int num_sms) {
  const int64_t most = ceil_div(V, dense_head::kRows * dense_head::kWarps);
  return static_cast<int>(max64(1, min64(2 * static_cast<int64_t>(num_sms), most)));
}

// Workspace bytes of a top-k call: the published lists.
inline int64_t dense_head_workspace_bytes(const DenseHeadParams& p) {
  return p.dense != nullptr ? 0
                            : static_cast<int64_t>(p.num_ctas) * p.T * dense_head_list_size(p.k) * sizeof(uint64_t);
}

// Shared memory the hidden rows need (kernel 1 launches with it; <= 48 KiB without an opt-in).
inline size_t dense_head_smem_bytes(int Hd, size_t elem) { return dense_head::smem_bytes(Hd, elem); }

// Launches the head for element type T (float, __half, __nv_bfloat16). p.num_ctas and p.partial must
// be set (dense_head_ctas, dense_head_workspace_bytes).
template <class T>
cudaError_t dense_lm_head(const DenseHeadParams& p, cudaStream_t stream) {
  if (p.T <= 0) return cudaSuccess;
  if (p.V <= 0 || p.Hd < 0 || p.num_ctas <= 0 || p.k < 1 || p.k > kMaxDenseHeadK) return cudaErrorInvalidValue;
  if (p.dense == nullptr && p.partial == nullptr) return cudaErrorInvalidValue;
  DeviceInfo dev;
  const cudaError_t err = device_info(&dev);
  if (err != cudaSuccess) return err;
  const int K = p.dense != nullptr ? 1 : dense_head_list_size(p.k);
  constexpr int V = kVec16<T>;
  const bool vec = p.Hd % V == 0 && p.hidden_stride % V == 0 && p.head_stride % V == 0 && host_aligned16(p.hidden) &&
                   host_aligned16(p.lm_head);
  return vec ? dense_head::launch_vec<T, V>(p, K, dev.pdl, stream) : dense_head::launch_vec<T, 1>(p, K, dev.pdl, stream);
}

}  // namespace gemma4_mtp
