// dense_lm_head: the 26B / 31B drafters' 262144 x 1024 LM head read once in its own dtype, with the
// top-k of each token's fp32 logits kept on the fly (no fp32 copy of the head, no [T, V] logits, no
// sort over V), or the dense fp32 logits for sampling.
//
// Memory bound on the head (512 MiB in bf16). Kernel 1 (each CTA owns a contiguous run of rows), in one
// of two forms: for bf16 / fp16 rows of 16-byte vectors, mma_rows_kernel (tensor cores, 16 or 32 tokens
// a pass over the rows, below); otherwise (fp32, unaligned or odd rows) rows_kernel: a warp takes kRows
// rows at a time, its lanes stride the Hd dimension with 16-byte loads (all kRows * Hd / (32 * VEC)
// loads of a lane issued before any is consumed), the hidden rows of up to kTokens tokens sit in shared
// memory, fp32 FMAs, one warp_sum per (row, token). Lane j keeps token j's best K (score, row) pairs as
// 64-bit keys (topk_logic.h: higher score first, then lower index; -0 ties +0, NaN ranks first as in
// torch's sort) in registers; the CTA's warps merge their lists in shared memory and publish one list per
// token. More than kTokens tokens: another pass over the CTA's rows per group of kTokens. Kernel 2: one
// CTA per token merges the published lists (threads scan, then a tree of pairwise list merges) and
// writes ids (int64) and logits (fp32), best first.
// Little's law as in fused_concat_down_proj.cuh: rows_kernel's 2 rows x 4 vectors of 16 bytes per lane
// (Hd 1024, bf16), mma_rows_kernel's 2 k steps x 4 rows of 16 bytes, and 8 warps give 32 KiB in flight
// per CTA, 2 CTAs per SM: ~64 KiB per SM (H200 needs ~22; k = 16: one CTA an SM, 32 KiB).
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/dense_lm_head_params.h"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
#include "gemma4_mtp/topk_logic.h"

namespace gemma4_mtp {

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
  return topk_key(orderable_bits(s), static_cast<uint32_t>(row));
}

// Thread t < tokens merges the warps' lists of token t0 + t (lists[w][t], each best first) into the CTA's
// list and publishes it to p.partial; a key enters only when it beats the list's last.
template <int N, int K>
__device__ __forceinline__ void publish_cta_lists(const uint64_t (&lists)[kWarps][N][K], int tokens, int t0,
                                                  const DenseHeadParams& p) {
  if (static_cast<int>(threadIdx.x) >= tokens) return;
  uint64_t merged[K];
#pragma unroll
  for (int i = 0; i < K; ++i) merged[i] = kEmpty;
  for (int w = 0; w < kWarps; ++w)
#pragma unroll
    for (int i = 0; i < K; ++i)
      if (lists[w][threadIdx.x][i] > merged[K - 1]) insert<K>(merged, lists[w][threadIdx.x][i]);
  uint64_t* dst = p.partial + (static_cast<int64_t>(blockIdx.x) * p.T + t0 + threadIdx.x) * K;
#pragma unroll
  for (int i = 0; i < K; ++i) dst[i] = merged[i];
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
    publish_cta_lists(lists, nt, t0, p);
  }
}

// Tensor-core rows kernel (bf16 / fp16 rows of 16-byte vectors): the glue's mma.m16n8k16 GEMV step
// (mma_gemv.cuh) with the tokens as A (16 per m16 tile, read from global memory: a few KiB, L1-resident)
// and 32 head rows as B. A warp owns 32-row blocks of its CTA's rows and runs the whole of Hd for each,
// U k steps of loads in flight (2 KiB a step per warp; no reduction between warps). Its lanes
// keep lists for the tokens of their accumulator rows (lane / 4 and lane / 4 + 8 of each m16 tile) over
// the rows they hold, insert a key only when it beats the list's last, merge the lists of a quad's four
// lanes by shuffles and the warps' in shared memory, and publish one list per token, as rows_kernel.
// More than 16 MT tokens: another pass over the rows. Registers (128 a thread at 2 CTAs an SM, sm_80 /
// sm_90 compiles): U k steps of loads in flight (24 + 8 MT registers each), 16 MT accumulators, 2 MT
// lists of K keys (4 K MT registers); MT = 2 (32 tokens a pass) only for K <= 4 with U = 1, else MT = 1
// with U = 2; K = 16 (64 registers of lists) at one CTA an SM. Every other choice spilled 8-56 bytes a
// thread.
template <int K>
constexpr int mma_most_token_tiles() {
  return K <= 4 ? 2 : 1;
}

template <class T, int K, int MT>
__global__ void __launch_bounds__(kThreads, K == 16 ? 1 : 2) mma_rows_kernel(DenseHeadParams p) {
  constexpr int kTok = 16 * MT;
  constexpr int U = MT == 2 ? 1 : 2;  // k steps of loads issued before their mmas (2: 4 KiB a warp)
  __shared__ uint64_t lists[kWarps][kTok][K];
  griddep_wait();  // the hidden states are the previous kernel's output
  griddep_launch_dependents();
  const T* hidden = static_cast<const T*>(p.hidden);
  const T* head = static_cast<const T*>(p.lm_head);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_cta = static_cast<int>(ceil_div(p.V, p.num_ctas));
  const int lo = blockIdx.x * per_cta, hi = min(p.V, lo + per_cta);
  const int lk = mma_lane_k(lane);
  const int steps = static_cast<int>(ceil_div(p.Hd, kMmaStepK));

  for (int t0 = 0; t0 < p.T; t0 += kTok) {
    const T* trow[MT][2];  // A rows of this lane: tokens t0 + 16 mt + lane / 4 (+ 8), null past T
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = t0 + mt * 16 + mma_a_row(lane, h);
        trow[mt][h] = t < p.T ? hidden + static_cast<int64_t>(t) * p.hidden_stride : nullptr;
      }
    uint64_t best[MT][2][K];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < K; ++i) best[mt][h][i] = kEmpty;

    for (int row0 = lo + warp * kMmaRowsPerCta; row0 < hi; row0 += kWarps * kMmaRowsPerCta) {
      const T* wrow[kMmaRowTiles];
#pragma unroll
      for (int nt = 0; nt < kMmaRowTiles; ++nt) {
        const int r = row0 + nt * 8 + mma_b_row(lane);
        wrow[nt] = r < hi ? head + static_cast<int64_t>(r) * p.head_stride : nullptr;
      }
      float acc[MT][kMmaRowTiles][4] = {};
      for (int s0 = 0; s0 < steps; s0 += U) {
        uint4 wf[U][kMmaRowTiles], xa[U][MT], xb[U][MT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int k = (s0 + u) * kMmaStepK + lk;
          const bool live = s0 + u < steps && k < p.Hd;  // Hd % 8 == 0: a live vector is whole
          load_gemv_weights(wf[u], wrow, k, live);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            xa[u][mt] = live && trow[mt][0] != nullptr ? __ldg(reinterpret_cast<const uint4*>(trow[mt][0] + k)) : zero;
            xb[u][mt] = live && trow[mt][1] != nullptr ? __ldg(reinterpret_cast<const uint4*>(trow[mt][1] + k)) : zero;
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_gemv_step<T>(acc[mt], xa[u][mt], xb[u][mt], wf[u]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int t = t0 + mt * 16 + mma_c_token(lane, c), r = row0 + nt * 8 + mma_c_row(lane, c);
            if (t >= p.T || r >= hi) continue;
            if (p.dense != nullptr) {
              p.dense[static_cast<int64_t>(t) * p.dense_stride + r] = acc[mt][nt][c];
            } else {
              const uint64_t key = score_key(acc[mt][nt][c], r);
              if (key > best[mt][c >> 1][K - 1]) insert<K>(best[mt][c >> 1], key);
            }
          }
    }
    if (p.dense != nullptr) continue;
    // the quad's four lanes hold disjoint rows of the same tokens: after two exchanges each has all four
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint64_t theirs[K];
#pragma unroll
          for (int i = 0; i < K; ++i) theirs[i] = __shfl_xor_sync(0xffffffffu, best[mt][h][i], off);
#pragma unroll
          for (int i = 0; i < K; ++i)
            if (theirs[i] > best[mt][h][K - 1]) insert<K>(best[mt][h], theirs[i]);
        }
    __syncthreads();  // the previous pass's merge is done with lists
    if ((lane & 3) == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int i = 0; i < K; ++i) lists[warp][mt * 16 + mma_a_row(lane, h)][i] = best[mt][h][i];
    }
    __syncthreads();
    publish_cta_lists(lists, min(kTok, p.T - t0), t0, p);
  }
}

constexpr int kMergeThreads = 128;
// Published keys a merge thread loads before inserting any: inserted as they came, under ptxas's 32-register
// target, each load waited for the previous key's insertion (over the 264 lists of an H100 / H200, 3
// dependent loads a thread at top-1, 17 at top-8; sm_90a SASS)
constexpr int kMergeBatch = 8;

template <int K>
__global__ void __launch_bounds__(kMergeThreads, 1) merge_kernel(DenseHeadParams p) {
  __shared__ uint64_t lists[kMergeThreads][K];
  griddep_wait();  // the lists are the rows kernel's output
  const int t = blockIdx.x;
  uint64_t best[K];
#pragma unroll
  for (int i = 0; i < K; ++i) best[i] = kEmpty;
  const int64_t n = static_cast<int64_t>(p.num_ctas) * K;
  for (int64_t c0 = threadIdx.x; c0 < n; c0 += kMergeThreads * kMergeBatch) {
    uint64_t keys[kMergeBatch];
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {  // past the end: the last key again (unpredicated loads), not inserted
      const int64_t c = min(c0 + j * kMergeThreads, n - 1);
      keys[j] = p.partial[(c / K * p.T + t) * K + c % K];
    }
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) insert<K>(best, c0 + j * kMergeThreads < n ? keys[j] : kEmpty);
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
        p.out_logits[static_cast<int64_t>(t) * p.k + i] = topk_key_value(best[i]);
      }
    }
  }
}

template <class T, int VEC, int K>
cudaError_t launch_k(const DenseHeadParams& p, bool pdl, cudaStream_t stream) {
  // 16-byte rows of a 16-bit type: the tensor-core kernel; fp32 or unaligned rows: the CUDA-core one
  cudaError_t err;
  if constexpr (VEC == 8 && sizeof(T) == 2) {
    constexpr int MT = mma_most_token_tiles<K>();
    err = p.T > 16 && MT == 2 ? launch(mma_rows_kernel<T, K, MT>, dim3(p.num_ctas), kThreads, 0, pdl, stream, p)
                              : launch(mma_rows_kernel<T, K, 1>, dim3(p.num_ctas), kThreads, 0, pdl, stream, p);
  } else {
    err = launch(rows_kernel<T, VEC, K>, dim3(p.num_ctas), kThreads, smem_bytes(p.Hd, sizeof(T)), pdl, stream, p);
  }
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
