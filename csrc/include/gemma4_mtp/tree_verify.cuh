// tree_verify in one launch. CTA (row, chunk) reduces one chunk of one node's logits (argmax for greedy
// rows, softmax max/sum for sampling rows), so all B * N rows are scanned in parallel across the grid.
// The last CTA of a row (atomic counter) merges the chunk statistics and makes the row's decision
// (the target's token, or the accept/resample decision with draft probabilities; the inverse-CDF
// scans run in that CTA). The last row to finish walks every request's tree. Counters are reset by
// the CTAs that consume them, so the launch can be replayed (CUDA graphs) without a memset.
// No fast-math: sampling decisions must match the reference's rules.
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/plan.h"
#include "gemma4_mtp/tree_logic.h"

namespace gemma4_mtp {
namespace tree {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 16;  // inverse CDF: contiguous probabilities per thread per tile
constexpr int64_t kMinChunk = 4096;
// Independent 16-byte logit loads each thread issues before consuming any. Little's law: to stream at
// H200's ~4.8 TB/s with ~600 ns of DRAM latency, ~4.8e12 B/s * 600e-9 s ~ 2.9 MB must be in flight,
// ~22 KB per SM over 132 SMs. The plan gives ~2 CTAs per SM: with one load per thread per iteration
// that is 2 * 256 * 16 B = 8 KB (about a third of the need); with 4 it is 32 KB.
constexpr int kLoadsInFlight = 4;

struct ChunkStat {
  ArgMax am;
  MaxSum ms;
};

struct Workspace {
  int* row_count;  // [B * N]
  int* done;       // [1]
  int* row_tok;    // [B * N]
  int* row_acc;    // [B * N]
  ChunkStat* stats;  // [B * N, num_chunks]
};

inline int64_t workspace_bytes(int64_t rows, int64_t chunks) {
  return round_up(4 * (rows + 1), 16) + round_up(4 * rows, 16) * 2 + int64_t{16} * rows * chunks;
}

inline Workspace carve(void* ws, int64_t rows) {
  char* base = static_cast<char*>(ws);
  Workspace w;
  w.row_count = reinterpret_cast<int*>(base);
  w.done = w.row_count + rows;
  base += round_up(4 * (rows + 1), 16);
  w.row_tok = reinterpret_cast<int*>(base);
  base += round_up(4 * rows, 16);
  w.row_acc = reinterpret_cast<int*>(base);
  base += round_up(4 * rows, 16);
  w.stats = reinterpret_cast<ChunkStat*>(base);
  return w;
}

struct Shared {
  ArgMax am[kWarps];
  MaxSum ms[kWarps];
  double dsum[kWarps];
  float fsum[kWarps];
  int imin[kWarps];
  int flag;
};

__device__ __forceinline__ ArgMax block_argmax(ArgMax a, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    a = argmax_merge(a, ArgMax{__shfl_xor_sync(0xffffffffu, a.value, o), __shfl_xor_sync(0xffffffffu, a.index, o)});
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.am[threadIdx.x >> 5] = a;
  __syncthreads();
  ArgMax r = sh.am[0];
  for (int i = 1; i < kWarps; ++i) r = argmax_merge(r, sh.am[i]);
  return r;
}

__device__ __forceinline__ MaxSum block_maxsum(MaxSum a, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    a = maxsum_merge(a, MaxSum{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)});
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.ms[threadIdx.x >> 5] = a;
  __syncthreads();
  MaxSum r = sh.ms[0];
  for (int i = 1; i < kWarps; ++i) r = maxsum_merge(r, sh.ms[i]);
  return r;
}

__device__ __forceinline__ float block_sum(float x, Shared& sh) {
  x = warp_sum(x);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.fsum[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = 0.f;
  for (int i = 0; i < kWarps; ++i) r += sh.fsum[i];
  return r;
}

// min (want_min) or max over the block.
__device__ __forceinline__ int block_extreme(int x, bool want_min, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(0xffffffffu, x, o);
    x = want_min ? min(x, y) : max(x, y);
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.imin[threadIdx.x >> 5] = x;
  __syncthreads();
  int r = sh.imin[0];
  for (int i = 1; i < kWarps; ++i) r = want_min ? min(r, sh.imin[i]) : max(r, sh.imin[i]);
  return r;
}

// Exclusive prefix sum of one double per thread; *total gets the block's sum.
__device__ __forceinline__ double block_exclusive_scan(double x, Shared& sh, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();
  if (lane == 31) sh.dsum[warp] = inc;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int i = 0; i < kWarps; ++i) {
    if (i < warp) before += sh.dsum[i];
    all += sh.dsum[i];
  }
  *total = all;
  return before + inc - x;
}

// The reference's inverse CDF over ids [0, V): the first id whose cumulative probability (summed in
// double) exceeds u, else the last id with nonzero probability (-1 if there is none). prob(i) gives
// the fp32 probability of id i. Tiles are scanned in order; within a tile each thread owns kItems
// consecutive ids.
template <class F>
__device__ int block_inverse_cdf(F prob, int V, double u, Shared& sh) {
  constexpr int kTile = kThreads * kItems;
  double carry = 0.0;
  int last_pos = -1;
  for (int base = 0; base < V; base += kTile) {
    const int i0 = base + threadIdx.x * kItems;
    float pv[kItems];
    double tsum = 0.0;
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int i = i0 + e;
      pv[e] = i < V ? prob(i) : 0.f;
      tsum += static_cast<double>(pv[e]);
      if (pv[e] > 0.f) last_pos = i;
    }
    double total;
    const double excl = block_exclusive_scan(tsum, sh, &total);
    const int local = first_crossing(pv, kItems, carry + excl, u);
    const int found = block_extreme(local == kNoIndex ? kNoIndex : i0 + local, true, sh);
    if (found != kNoIndex) return found;
    carry += total;
  }
  return block_extreme(last_pos, false, sh);
}

// The explicit minimum of 1 CTA per SM keeps ptxas from squeezing the scalar-load (VEC = 1) variants
// into 64 registers, where they spill (observed with nvcc 13.0, sm_90a).
template <class T, int VEC>
__global__ void __launch_bounds__(kThreads, 1) kernel(TreeVerifyParams p, Workspace w) {
  __shared__ Shared sh;
  const int S = p.num_chunks;
  const int row = blockIdx.x / S, chunk = blockIdx.x % S;
  const int b = row / p.N, u = row % p.N;
  const int V = static_cast<int>(p.V);
  const int32_t* parents = p.parents + static_cast<int64_t>(b) * p.N;
  const bool used = u == 0 || parents[u] >= 0;  // padding slots are never visited by the walk
  const float temp = p.temperature != nullptr ? p.temperature[b] : 0.f;
  const bool sampling = temp > 0.f;
  const T* logits = static_cast<const T*>(p.logits) + b * p.logits_stride[0] + u * p.logits_stride[1];

  // Phase 1: this chunk's statistics.
  if (used) {
    const int64_t c0 = static_cast<int64_t>(chunk) * p.chunk, c1 = min64(p.V, c0 + p.chunk);
    ArgMax am = argmax_identity();
    MaxSum ms = maxsum_identity();
    // Each thread still visits its ids in ascending order (argmax_push relies on it), in the same
    // sequence as a one-load loop, so the statistics are bit-identical; only the loads are batched.
    // The chunk and, on the vector path, V are multiples of VEC, so every vector lies inside [c0, c1).
    auto consume = [&](const float* x, int64_t i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (sampling) {
          ms = maxsum_add(ms, x[e] / temp);
        } else {
          am = argmax_push(am, x[e], static_cast<int>(i + e));
        }
      }
    };
    constexpr int64_t kStep = kThreads * VEC;
    int64_t i = c0 + threadIdx.x * VEC;
    for (; i + (kLoadsInFlight - 1) * kStep < c1; i += kLoadsInFlight * kStep) {
      float x[kLoadsInFlight][VEC];
#pragma unroll
      for (int l = 0; l < kLoadsInFlight; ++l) load_float<VEC>(logits + i + l * kStep, x[l]);
#pragma unroll
      for (int l = 0; l < kLoadsInFlight; ++l) consume(x[l], i + l * kStep);
    }
    for (; i < c1; i += kStep) {  // the last < kLoadsInFlight vectors of this thread
      float x[VEC];
      load_float<VEC>(logits + i, x);
      consume(x, i);
    }
    // sampling is uniform over the CTA, so both reductions are reached by every thread
    if (sampling) {
      ms = block_maxsum(ms, sh);
    } else {
      am = block_argmax(am, sh);
    }
    if (threadIdx.x == 0) w.stats[static_cast<int64_t>(row) * S + chunk] = ChunkStat{am, ms};
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(&w.row_count[row], 1);
    sh.flag = prev == S - 1;
    if (sh.flag) w.row_count[row] = 0;
  }
  __syncthreads();
  if (!sh.flag) return;
  __threadfence();

  // Phase 2: the row's decision, made by the row's last CTA.
  if (used) {
    ArgMax am = argmax_identity();
    MaxSum ms = maxsum_identity();
    for (int s = threadIdx.x; s < S; s += kThreads) {
      const ChunkStat* st = &w.stats[static_cast<int64_t>(row) * S + s];
      am = argmax_merge(am, ArgMax{__ldcg(&st->am.value), __ldcg(&st->am.index)});
      ms = maxsum_merge(ms, MaxSum{__ldcg(&st->ms.m), __ldcg(&st->ms.s)});
    }
    int tok;
    int acc = 0;
    if (!sampling) {
      tok = block_argmax(am, sh).index;
    } else if (ms = block_maxsum(ms, sh); !has_distribution(ms)) {
      tok = kNoToken;  // its probabilities would all be NaN (see has_distribution)
    } else {
      const float m = ms.m, Z = ms.s;
      auto prob = [&](int i) { return expf(to_float(logits[i]) / temp - m) / Z; };
      const float* uni = p.uniforms + static_cast<int64_t>(row) * 2;
      if (p.draft_probs == nullptr) {
        tok = block_inverse_cdf(prob, V, uni[0], sh);
      } else {
        int child = -1;
        for (int c = u + 1; c < p.N && child < 0; ++c)
          if (parents[c] == u) child = c;
        if (child < 0) {
          tok = block_inverse_cdf(prob, V, uni[1], sh);
        } else {
          const int64_t x = p.draft_int64 ? static_cast<const int64_t*>(p.draft_tokens)[static_cast<int64_t>(b) * p.N + child]
                                          : static_cast<const int32_t*>(p.draft_tokens)[static_cast<int64_t>(b) * p.N + child];
          const float* q = p.draft_probs + b * p.draft_probs_stride[0] + u * p.draft_probs_stride[1];
          if (x >= 0 && x < p.V) {
            const float qx = q[x];
            acc = qx > 0.f && uni[0] < prob(static_cast<int>(x)) / qx;
          }
          if (acc) {
            tok = static_cast<int>(x);
          } else {
            auto residual = [&](int i) { return fmaxf(prob(i) - q[i], 0.f); };
            float part = 0.f;
            for (int i = threadIdx.x; i < V; i += kThreads) part += residual(i);
            const float total = block_sum(part, sh);
            if (total > 0.f) {
              tok = block_inverse_cdf([&](int i) { return residual(i) / total; }, V, uni[1], sh);
            } else {
              // p == q leaves no residual (rejection is then impossible in exact arithmetic)
              tok = block_inverse_cdf(prob, V, uni[1], sh);
            }
          }
        }
      }
    }
    if (threadIdx.x == 0) {
      w.row_tok[row] = tok;
      w.row_acc[row] = acc;
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(w.done, 1);
    sh.flag = prev == p.B * p.N - 1;
    if (sh.flag) *w.done = 0;
  }
  __syncthreads();
  if (!sh.flag) return;
  __threadfence();

  // Phase 3: the walks, one thread per request.
  for (int r = threadIdx.x; r < p.B; r += kThreads) {
    const int64_t off = static_cast<int64_t>(r) * p.N;
    const volatile int* tok = w.row_tok + off;
    const bool dp_rule = p.draft_probs != nullptr && p.temperature != nullptr && p.temperature[r] > 0.f;
    const volatile int* acc = dp_rule ? w.row_acc + off : nullptr;
    int n;
    if (p.draft_int64) {
      n = walk_tree(p.parents + off, static_cast<const int64_t*>(p.draft_tokens) + off, tok, acc, p.N,
                    p.accepted_nodes + off, p.output_tokens + off, p.last_node + r);
    } else {
      n = walk_tree(p.parents + off, static_cast<const int32_t*>(p.draft_tokens) + off, tok, acc, p.N,
                    p.accepted_nodes + off, p.output_tokens + off, p.last_node + r);
    }
    p.accept_len[r] = n;
  }
}

}  // namespace tree

inline ChunkPlan tree_verify_plan(int B, int N, int64_t V, int num_sms) {
  return plan_row_chunks(V, static_cast<int64_t>(B) * N, num_sms, tree::kMinChunk, 8);
}

inline int64_t tree_verify_workspace_bytes(int B, int N, int num_chunks) {
  return tree::workspace_bytes(static_cast<int64_t>(B) * N, num_chunks);
}

// Launches tree_verify for logits of element type T (float, __half, __nv_bfloat16). p.num_chunks and
// p.chunk come from tree_verify_plan(); p.workspace holds tree_verify_workspace_bytes() bytes whose
// counters are zero.
template <class T>
cudaError_t tree_verify(const TreeVerifyParams& p, cudaStream_t stream) {
  if (p.B <= 0) return cudaSuccess;
  if (p.N < 1 || p.V < 1 || p.V > 0x7fffffff || p.num_chunks < 1 || p.chunk < 1 || p.workspace == nullptr ||
      p.chunk % 8 || static_cast<int64_t>(p.num_chunks) * p.B * p.N > 0x7fffffff ||
      static_cast<int64_t>(p.num_chunks) * p.chunk < p.V ||  // the chunks must cover the vocabulary
      (p.temperature != nullptr && p.uniforms == nullptr))  // sampling rows read uniforms
    return cudaErrorInvalidValue;
  constexpr int V = kVec16<T>;
  const bool vec = p.V % V == 0 && p.logits_stride[0] % V == 0 && p.logits_stride[1] % V == 0 &&
                   host_aligned16(p.logits);
  const tree::Workspace w = tree::carve(p.workspace, static_cast<int64_t>(p.B) * p.N);
  const unsigned grid = static_cast<unsigned>(static_cast<int64_t>(p.num_chunks) * p.B * p.N);
  if (vec) {
    tree::kernel<T, V><<<grid, tree::kThreads, 0, stream>>>(p, w);
  } else {
    tree::kernel<T, 1><<<grid, tree::kThreads, 0, stream>>>(p, w);
  }
  return cudaGetLastError();
}

}  // namespace gemma4_mtp
