// softmax_sample: q = softmax(logits / temperature) written, and a token per row drawn from it by the
// inverse CDF at a given uniform (the decode loop's sampled draft tokens; the verification takes q as
// its draft probabilities). The Triton backend's design (gemma4_mtp_kernels/triton/softmax_sample.py),
// two launches of (P chunks, B rows) CTAs of 256 threads, 4096 ids per CTA:
// 1. stats_kernel: the chunk's max m of x = logits / temperature and s = sum exp(x - m).
// 2. probs_kernel: every CTA of a row reads the row's P (m, s) pairs in the same order (so all agree on
//    M and Z = sum s exp(m - M)), writes q = exp(x - M) / Z for its chunk and the chunk's fp64 mass; the
//    row's last CTA to arrive (last_to_arrive: bar.sync, fence, atomic; .cg reads after it) finds the
//    chunk where the cumulative mass first exceeds u (a block scan of the masses, 256 at a time), reads
//    that chunk's q back and scans it in fp64: the first id whose cumulative probability exceeds u, or
//    (rounding left the total at or below u) the last id with q > 0, or -1 for a row without a
//    distribution (NaN / all -inf: unchecked on the GPU). It resets the row's counter.
// Loads of logits and stores of q are coalesced (id = chunk + i * 256 + thread); the final scan reads its
// chunk as 16 consecutive ids per thread (a thread's prefix, then a block scan of the thread totals).
#pragma once

#include <climits>
#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
#include "gemma4_mtp/softmax_sample_params.h"

namespace gemma4_mtp {
namespace softmax_sample_detail {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = kSoftmaxSampleChunk / kThreads;

struct Max {
  template <class V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a > b ? a : b; }
};
struct Min {
  template <class V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a < b ? a : b; }
};
struct Sum {
  template <class V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};

// op over the block's values, the same in every thread (the warps' results combined in warp order).
template <class V, class Op>
__device__ __forceinline__ V block_reduce(V v, Op op, V* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // red may still be read by a previous call
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) v = op(v, red[w]);
  return v;
}

// Inclusive prefix sum of the block's values in thread order (Hillis-Steele over buf[kThreads]).
__device__ __forceinline__ double block_inclusive_sum(double v, double* buf) {
  __syncthreads();
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int o = 1; o < kThreads; o <<= 1) {
    const double add = static_cast<int>(threadIdx.x) >= o ? buf[threadIdx.x - o] : 0.0;
    __syncthreads();
    buf[threadIdx.x] += add;
    __syncthreads();
  }
  return buf[threadIdx.x];
}

// The thread's kItems logits of a chunk (ids first + i * kThreads; past V the last one again, which the
// callers mask), as fp32, loaded before any is used: computed as they came (a division each, and in
// probs_kernel a store of q that might alias the logits), they were one dependent load each, 16 in a row
// (sm_90a SASS), under ptxas's 32-register target.
template <class T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ x, int first, int V, float (&v)[kItems]) {
  T raw[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int id = first + i * kThreads;
    raw[i] = x[id < V ? id : V - 1];  // unpredicated: ptxas issues them together
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) v[i] = to_float(raw[i]);
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) stats_kernel(SoftmaxSampleParams p) {
  __shared__ float red[kWarps];
  griddep_wait();  // the logits are the previous kernel's output
  griddep_launch_dependents();
  const int c = blockIdx.x, row = blockIdx.y;
  const T* __restrict__ x = static_cast<const T*>(p.logits) + static_cast<int64_t>(row) * p.logit_stride;
  const float temp = p.temperature[static_cast<int64_t>(row) * p.temp_stride];
  float v[kItems];
  load_chunk<T>(x, c * kSoftmaxSampleChunk + static_cast<int>(threadIdx.x), p.V, v);
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    v[i] = c * kSoftmaxSampleChunk + i * kThreads + static_cast<int>(threadIdx.x) < p.V ? v[i] / temp : -INFINITY;
    m = v[i] > m ? v[i] : m;
  }
  m = block_reduce(m, Max{}, red);
  const float shift = m == -INFINITY ? 0.f : m;  // an all -inf chunk has no mass (not NaN)
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kItems; ++i) s += expf(v[i] - shift);
  s = block_reduce(s, Sum{}, red);
  if (threadIdx.x == 0) {
    float* st = p.stats + (static_cast<int64_t>(row) * p.P + c) * 2;
    st[0] = m;
    st[1] = s;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1) probs_kernel(SoftmaxSampleParams p) {
  __shared__ float redf[kWarps];
  __shared__ double redd[kWarps];
  __shared__ int redi[kWarps];
  __shared__ double buf[kThreads];
  __shared__ double before_chunk;
  __shared__ int flag;
  griddep_wait();  // the chunk statistics are stats_kernel's output
  griddep_launch_dependents();
  const int c = blockIdx.x, row = blockIdx.y, P = p.P, tid = static_cast<int>(threadIdx.x);
  const float* st = p.stats + static_cast<int64_t>(row) * P * 2;
  float M = -INFINITY;
  for (int j = tid; j < P; j += kThreads) M = st[2 * j] > M ? st[2 * j] : M;
  M = block_reduce(M, Max{}, redf);
  float Z = 0.f;
  for (int j = tid; j < P; j += kThreads) Z += st[2 * j] == -INFINITY ? 0.f : st[2 * j + 1] * expf(st[2 * j] - M);
  Z = block_reduce(Z, Sum{}, redf);

  const T* __restrict__ x = static_cast<const T*>(p.logits) + static_cast<int64_t>(row) * p.logit_stride;
  const float temp = p.temperature[static_cast<int64_t>(row) * p.temp_stride];
  float* q = p.probs + static_cast<int64_t>(row) * p.probs_stride;
  float xv[kItems];
  load_chunk<T>(x, c * kSoftmaxSampleChunk + tid, p.V, xv);
  double mass = 0.0;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int id = c * kSoftmaxSampleChunk + i * kThreads + tid;
    if (id < p.V) {
      const float qv = expf(xv[i] / temp - M) / Z;
      q[id] = qv;
      mass += qv;
    }
  }
  mass = block_reduce(mass, Sum{}, redd);
  if (tid == 0) p.mass[static_cast<int64_t>(row) * P + c] = mass;
  if (!last_to_arrive(p.counters + row, P, &flag)) return;
  if (tid == 0) p.counters[row] = 0;

  // the chunk where the cumulative mass first exceeds u, 256 chunks at a time
  const double u = p.uniforms[static_cast<int64_t>(row) * p.u_stride];
  const double* rm = p.mass + static_cast<int64_t>(row) * P;
  double carry = 0.0;
  int g = -1, last_chunk = -1;
  for (int base = 0; base < P && g < 0; base += kThreads) {  // g is the same in every thread
    const int j = base + tid;
    const double mj = j < P ? __ldcg(rm + j) : 0.0;
    last_chunk = j < P && mj > 0.0 ? j : last_chunk;
    const double incl = carry + block_inclusive_sum(mj, buf);
    g = block_reduce(j < P && incl > u ? j : INT_MAX, Min{}, redi);
    if (j == g) before_chunk = incl - mj;
    g = g == INT_MAX ? -1 : g;
    carry += buf[kThreads - 1];
  }
  __syncthreads();  // before_chunk
  const bool crossed = g >= 0;
  if (!crossed) g = block_reduce(last_chunk, Max{}, redi);
  if (g < 0) {  // no mass anywhere: no distribution
    if (tid == 0) p.tokens[row] = -1;
    return;
  }
  // inside chunk g, 16 consecutive ids per thread
  const double target = crossed ? u : INFINITY;  // uncrossed: the last id with q > 0
  const int lo = g * kSoftmaxSampleChunk + tid * kItems;
  float w[kItems];  // q as written (fp32), summed in fp64
  double run = 0.0;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    w[i] = lo + i < p.V ? __ldcg(q + lo + i) : 0.f;
    run += w[i];
  }
  double cum = (crossed ? before_chunk : 0.0) + block_inclusive_sum(run, buf) - run;
  int found = INT_MAX, last = -1;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    cum += w[i];
    if (lo + i < p.V) {
      found = found == INT_MAX && cum > target ? lo + i : found;
      last = w[i] > 0.f ? lo + i : last;
    }
  }
  found = block_reduce(found, Min{}, redi);
  last = block_reduce(last, Max{}, redi);
  if (tid == 0) p.tokens[row] = found != INT_MAX ? found : last;
}

}  // namespace softmax_sample_detail

// Launches both kernels for element type T (float, __half, __nv_bfloat16). p.P, the workspace and the
// counters must be set (softmax_sample_chunks, softmax_sample_carve).
template <class T>
cudaError_t softmax_sample(const SoftmaxSampleParams& p, cudaStream_t stream) {
  if (p.B <= 0) return cudaSuccess;
  if (p.V <= 0 || p.P != softmax_sample_chunks(p.V) || p.stats == nullptr || p.mass == nullptr ||
      p.counters == nullptr || p.probs == nullptr || p.tokens == nullptr || p.B > 65535)
    return cudaErrorInvalidValue;
  DeviceInfo dev;
  cudaError_t err = device_info(&dev);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.P), static_cast<unsigned>(p.B));
  err = launch(softmax_sample_detail::stats_kernel<T>, grid, softmax_sample_detail::kThreads, 0, dev.pdl, stream, p);
  if (err != cudaSuccess) return err;
  return launch(softmax_sample_detail::probs_kernel<T>, grid, softmax_sample_detail::kThreads, 0, dev.pdl, stream, p);
}

}  // namespace gemma4_mtp
