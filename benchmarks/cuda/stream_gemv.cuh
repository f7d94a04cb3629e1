// One GEMV y = scale * W x (W bf16 [n, k] row-major, x and y fp32, one token) on every SM, each program's
// rows streamed through a ring of bulk copies: what the 31B drafter's glue GEMVs (8-32 MiB of weights, one
// token) could reach against the copy bandwidth, beside today's kernels (benchmarks/bench_stage_boundary.py,
// benchmarks/README.md "31B's GEMVs from a ring of bulk copies").
//
// Program p owns rows [p n / P, (p + 1) n / P): one contiguous block of W, read as 16 KiB chunks in order
// (one smaller chunk when the block is smaller: E2B's 1 MiB GEMVs give a program 8 KiB)
// by cp.async.bulk into a ring of kRing buffers (an mbarrier each), a buffer refilled with the chunk kRing
// further on as soon as every warp has summed it, so that ~kRing chunks are always in flight. A warp sums
// 256 consecutive weights of one row against x (held whole in shared memory), one of the chunk's 32 units;
// after the chunk's barrier a thread a row adds its units to the row's total (no atomics: the units' sums
// alternate between two buffers by chunk parity). `norm` scales by x's inverse RMS, the glue's prologue.
#pragma once

#include <cstdint>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"

#include "block_sum.cuh"
#include "bulk_ring.cuh"

namespace stream_gemv {

using namespace gemma4_mtp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChunkBytes = 16 * 1024;
constexpr int kChunkElems = kChunkBytes / 2;
constexpr int kRing = 8;
constexpr int kMaxK = 16384;
constexpr float kEps = 1e-6f;
using Ring = BulkRing<kRing, kChunkBytes>;

struct Gemv {
  const __nv_bfloat16* w;  // [n, k], 16-byte aligned
  const float* x;          // [k], 16-byte aligned
  float* y;                // [n]
  int n, k;
  int norm;  // scale by x's inverse RMS
};

constexpr int kUnits = kChunkElems / 256;  // a chunk's 256-weight units

// Weights of a chunk: 16 KiB, or the whole block when it is smaller.
__host__ __device__ inline int chunk_elems(const Gemv& g, int programs) {
  return min(kChunkElems, g.n / programs * g.k);
}

// What the kernel takes: rows split evenly, k a multiple of 256 (a warp's 256 weights in one row) and
// at most kMaxK, each program's block whole chunks, W and x 16-byte aligned (bulk copies' sources).
inline bool valid(const Gemv& g, int programs) {
  if (programs < 1 || g.n < programs || g.n % programs != 0 || g.k < 256 || g.k % 256 != 0 || g.k > kMaxK)
    return false;
  if (!host_aligned16(g.w) || !host_aligned16(g.x)) return false;
  return static_cast<int64_t>(g.n / programs) * g.k % chunk_elems(g, programs) == 0;
}

// Shared memory: the ring, x, the program's row totals, two chunks' unit sums, a norm's warp sums, the
// ring's and x's mbarriers.
inline size_t smem_bytes(const Gemv& g, int programs) {
  return Ring::kBytes + static_cast<size_t>(g.k) * 4 +
         static_cast<size_t>((g.n / programs + 1) / 2 * 2) * 4 + (2 * kUnits + kWarps) * 4 + (kRing + 1) * 8;
}

__global__ void __launch_bounds__(kThreads) wide_kernel(Gemv g) {
  if constexpr (!kHasBulkCopy) __trap();
  const int rows = g.n / static_cast<int>(gridDim.x), elems = chunk_elems(g, static_cast<int>(gridDim.x));
  const int chunks = rows * g.k / elems, units_per_chunk = elems / 256;
  const __nv_bfloat16* block = g.w + static_cast<size_t>(blockIdx.x) * rows * g.k;
  unsigned char* smem = dynamic_smem();
  float* x = reinterpret_cast<float*>(smem + Ring::kBytes);
  float* total = x + g.k;
  float* units = total + (rows + 1) / 2 * 2;  // [2][kUnits]
  float* red = units + 2 * kUnits;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + kWarps);  // 8-byte aligned: even float counts before
  uint64_t* xbar = full + kRing;
  const Ring ring{smem, full};
  auto issue = [&](int c) {  // thread 0: chunk c of the block
    ring.fill(c, block + static_cast<size_t>(c) * elems, static_cast<unsigned>(elems) * 2u);
  };
  if (threadIdx.x == 0) {  // x by a bulk copy too: one request, not a round trip per thread's loads
    ring.init();
    mbarrier_init(xbar, 1);
    fence_mbarrier_init();
    mbarrier_arrive_expect_tx(xbar, static_cast<unsigned>(g.k) * 4u);
    bulk_copy_g2s(x, g.x, static_cast<unsigned>(g.k) * 4u, xbar);
    for (int c = 0; c < min(kRing, chunks); ++c) issue(c);
  }
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads) total[r] = 0.0f;
  __syncthreads();  // the totals and the mbarriers ready
  mbarrier_wait(xbar, 0u);
  float scale = 1.0f;
  if (g.norm) {
    float sq = 0.0f;
    for (int i = static_cast<int>(threadIdx.x); i < g.k; i += kThreads) sq += x[i] * x[i];
    scale = rsqrtf(block_sum<kWarps>(sq, red) / static_cast<float>(g.k) + kEps);
  }
  constexpr int kPasses = kUnits / kWarps;  // a warp's units of a chunk
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int upr = min(g.k / 256, units_per_chunk);  // a row's units in one chunk (a chunk may hold part of a row)
  for (int c = 0; c < chunks; ++c) {
    ring.wait(c);
    const __nv_bfloat16* buf = ring.slot<const __nv_bfloat16>(c);
    float* sums = units + (c & 1) * kUnits;
    uint4 wv[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p)  // the loads first, then the sums
      if (p * kWarps + warp < units_per_chunk)
        wv[p] = *reinterpret_cast<const uint4*>(buf + ((p * kWarps + warp) * 32 + lane) * 8);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int u = p * kWarps + warp, col = (c * elems + u * 256) % g.k + 8 * lane;
      if (u >= units_per_chunk) break;
      const __nv_bfloat16* we = reinterpret_cast<const __nv_bfloat16*>(&wv[p]);
      const float4 xa = *reinterpret_cast<const float4*>(x + col), xb = *reinterpret_cast<const float4*>(x + col + 4);
      float d = to_float(we[0]) * xa.x + to_float(we[1]) * xa.y + to_float(we[2]) * xa.z + to_float(we[3]) * xa.w;
      d += to_float(we[4]) * xb.x + to_float(we[5]) * xb.y + to_float(we[6]) * xb.z + to_float(we[7]) * xb.w;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (lane == 0) sums[u] = d;
    }
    __syncthreads();  // every unit summed, every read of the buffer done
    if (threadIdx.x == 0 && c + kRing < chunks) issue(c + kRing);
    if (static_cast<int>(threadIdx.x) < units_per_chunk / upr) {  // a thread a row of the chunk: its units
      float t = 0.0f;
      for (int q = 0; q < upr; ++q) t += sums[static_cast<int>(threadIdx.x) * upr + q];
      total[(c * elems) / g.k + static_cast<int>(threadIdx.x)] += t;
    }
  }
  __syncthreads();  // every row's last units added
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads)
    g.y[static_cast<size_t>(blockIdx.x) * rows + r] = scale * total[r];
}

// `programs` programs run the GEMV; cudaErrorInvalidValue for a shape `valid` refuses or below sm_90 (no
// bulk copies).
inline cudaError_t run(const Gemv& g, int programs, cudaStream_t stream) {
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  if (!valid(g, programs) || major < 9) return cudaErrorInvalidValue;
  const size_t smem = smem_bytes(g, programs);
  err = opt_in_smem<wide_kernel>(static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch(wide_kernel, dim3(static_cast<unsigned>(programs)), kThreads, smem, false, stream, g);
}

}  // namespace stream_gemv
