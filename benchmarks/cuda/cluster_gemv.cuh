// A drafter layer's GEMVs in one thread block cluster, as a one-cluster step would run them: what the
// stage boundaries of stage_boundary.cuh and its stream rates compose to, measured directly
// (benchmarks/bench_stage_boundary.py; benchmarks/README.md, "A drafter step in one cluster").
//
// A chain of GEMVs y_s = scale_s * W_s x_s (W_s bf16 [n_s, k_s], x and y fp32) over one cluster of P
// programs. Every program holds the whole input vector in shared memory and computes rows
// [p n_s / P, (p + 1) n_s / P) of y_s, then pushes them into every program's copy of the next input
// (st_async_peer, counted by that program's mbarrier: no barrier between stages). What a layer does
// between its GEMVs needs the whole vector, which every program has: `norm` (scale_s = the input's
// inverse RMS) and `glu` (the pushed vector has 2 k_s entries, folded to gelu(a) * b before use) are
// local work, no extra stage. The weights stream through a ring of kRing 16 KiB buffers filled by bulk
// copies (cp.async.bulk, one mbarrier each): a group of up to kRing chunks is summed once all its bytes
// are in, and its buffers are refilled at once with the chunks kRing further on, across stage boundaries,
// so the next stage's weights arrive while this one pushes and the next waits for its input.
#pragma once

#include <cstdint>

#include "gemma4_mtp/cluster.cuh"
#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/rms_norm_linear.cuh"  // glue::gelu_tanh, the drafter MLP's GELU

namespace cluster_gemv {

using namespace gemma4_mtp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStages = 32;
constexpr int kChunkBytes = 16 * 1024;
constexpr int kRing = 8;
constexpr int kMaxK = 4096;   // input entries of a stage (a glu stage receives 2 k <= 2 kMaxK)
constexpr float kEps = 1e-6f;

struct Stage {
  const __nv_bfloat16* w;  // [n, k], 16-byte aligned
  int n, k;                // n a multiple of 4 * programs, k a multiple of 8, k <= kMaxK
  int norm;                // scale by the input's inverse RMS
  int glu;                 // the pushed input has 2 k entries a, b; use gelu(a) * b
};

struct Chain {
  Stage stage[kMaxStages];
  int stages;
  const float* x;  // the first input (stage 0's k entries, or 2 k with glu)
  float* y;        // the last output, n entries
};

// A chunk's dot products are cut into units of 256 columns (8 a lane of a warp), one partial sum each;
// a group of kRing chunks has kRing * kMaxUnits = 32 units per warp at most.
constexpr int kMaxUnits = 32;
static_assert(kRing * kMaxUnits == 32 * kWarps, "a warp's units of a group fill one transposed reduction");

// Rows of one weight chunk at stage s: the largest power of two that divides the program's rows, fits
// 16 KiB and makes at most kMaxUnits units.
__host__ __device__ inline int chunk_rows(int rows, int k) {
  const int units = (k + 255) / 256;
  int r = 1;
  while (2 * r * k * 2 <= kChunkBytes && 2 * r * units <= kMaxUnits && rows % (2 * r) == 0) r *= 2;
  return r;
}

__host__ __device__ inline int input_len(const Stage& st) { return st.glu ? 2 * st.k : st.k; }

// Whether the chain can run on `programs`: the shapes above, each stage's input what the one before
// it pushes, at most kMaxStages stages.
inline bool valid(const Chain& c, int programs) {
  if (c.stages < 1 || c.stages > kMaxStages || programs < 1 || programs > kMaxCluster) return false;
  for (int s = 0; s < c.stages; ++s) {
    const Stage& st = c.stage[s];
    if (st.n < 4 * programs || st.n % (4 * programs) != 0 || st.k < 8 || st.k % 8 != 0 || st.k > kMaxK)
      return false;
    if (st.n > 2 * kMaxK || (s > 0 && input_len(st) != c.stage[s - 1].n)) return false;
  }
  return true;
}

// The longest vector a stage receives or produces, and the most rows a program computes at one stage.
struct Extent {
  int vec = 0, rows = 0;
};
__host__ __device__ inline Extent extent(const Chain& c, int programs) {
  Extent e;
  for (int s = 0; s < c.stages; ++s) {
    e.vec = max(e.vec, max(input_len(c.stage[s]), c.stage[s].n));
    e.rows = max(e.rows, c.stage[s].n / programs);
  }
  return e;
}

// Shared memory: the weight ring, two input vectors, the program's rows of an output, the chunk's
// partial sums, the warp sums of a norm, the ring's and the inputs' mbarriers.
inline size_t smem_bytes(const Chain& c, int programs) {
  const Extent e = extent(c, programs);
  return static_cast<size_t>(kRing) * kChunkBytes + 2 * static_cast<size_t>(e.vec) * 4 +
         static_cast<size_t>(e.rows) * 4 + (kRing * kMaxUnits + kWarps) * 4 + (kRing + 2) * 8;
}

// Chunk j of the program's whole weight stream (stages in order, each its rows in chunk_rows runs):
// its stage, first row (of the program's rows) and row count; false past the last.
__device__ inline bool find_chunk(const Chain& c, int programs, int j, int* stage, int* row0, int* rows) {
  for (int s = 0; s < c.stages; ++s) {
    const int r = c.stage[s].n / programs, cr = chunk_rows(r, c.stage[s].k), n_chunks = r / cr;
    if (j < n_chunks) {
      *stage = s;
      *row0 = j * cr;
      *rows = cr;
      return true;
    }
    j -= n_chunks;
  }
  return false;
}

// Thread 0: bulk-copies chunk j (if any) of this program's weights into ring buffer j % kRing.
__device__ inline void issue_chunk(const Chain& c, int programs, int rank, int j, unsigned char* ring, uint64_t* full) {
  int s, row0, rows;
  if (!find_chunk(c, programs, j, &s, &row0, &rows)) return;
  const Stage& st = c.stage[s];
  const int first = rank * (st.n / programs) + row0;
  const unsigned bytes = static_cast<unsigned>(rows * st.k * 2);
  uint64_t* bar = &full[j % kRing];
  mbarrier_arrive_expect_tx(bar, bytes);
  bulk_copy_g2s(ring + static_cast<size_t>(j % kRing) * kChunkBytes, st.w + static_cast<size_t>(first) * st.k,
                bytes, bar);
}

// Sum over the block (every thread calls it; `red` holds kWarps floats).
__device__ inline float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();  // red's previous use is over
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w];
  return total;
}

__global__ void __launch_bounds__(kThreads) chain_kernel(Chain c) {
  if constexpr (!kHasClusters) __trap();
  const int programs = static_cast<int>(gridDim.x), rank = static_cast<int>(cluster_rank());
  const Extent e = extent(c, programs);
  const int vec = e.vec;
  unsigned char* smem = dynamic_smem();
  unsigned char* ring = smem;
  float* xbuf[2] = {reinterpret_cast<float*>(smem + static_cast<size_t>(kRing) * kChunkBytes),
                    reinterpret_cast<float*>(smem + static_cast<size_t>(kRing) * kChunkBytes) + vec};
  float* y_rows = xbuf[1] + vec;
  float* partial = y_rows + e.rows;
  float* red = partial + kRing * kMaxUnits;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + kWarps);  // 8-byte aligned: an even count of floats before
  uint64_t* xbar = full + kRing;
  if (threadIdx.x == 0) {
    for (int b = 0; b < kRing; ++b) mbarrier_init(&full[b], 1);
    mbarrier_init(&xbar[0], 1);
    mbarrier_init(&xbar[1], 1);
    fence_mbarrier_init();
    for (int j = 0; j < kRing; ++j) issue_chunk(c, programs, rank, j, ring, full);
  }
  for (int i = static_cast<int>(threadIdx.x); i < input_len(c.stage[0]); i += kThreads) xbuf[0][i] = c.x[i];
  cluster_sync();  // every program's mbarriers initialised before anyone pushes into it
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  int j = 0;  // the next chunk of the weight stream
  for (int s = 0; s < c.stages; ++s) {
    const Stage st = c.stage[s];
    float* x = (s & 1) ? xbuf[1] : xbuf[0];
    float* next = (s & 1) ? xbuf[0] : xbuf[1];
    uint64_t* next_bar = (s & 1) ? &xbar[0] : &xbar[1];
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(next_bar, static_cast<unsigned>(st.n) * 4u);
    if (s > 0) mbarrier_wait<Scope::kCluster>((s & 1) ? &xbar[1] : &xbar[0], static_cast<unsigned>((s - 1) >> 1) & 1u);
    if (st.glu) {  // in place: entry i reads i and k + i, and only i is written
      for (int i = static_cast<int>(threadIdx.x); i < st.k; i += kThreads) x[i] = glue::gelu_tanh(x[i]) * x[st.k + i];
      __syncthreads();
    }
    float scale = 1.0f;
    if (st.norm) {
      float sq = 0.0f;
      for (int i = static_cast<int>(threadIdx.x); i < st.k; i += kThreads) sq += x[i] * x[i];
      scale = rsqrtf(block_sum(sq, red) / static_cast<float>(st.k) + kEps);
    }
    // the stage's chunks in groups of up to kRing (one group unless the program's rows exceed the ring):
    // once the group's bytes are in, each warp takes every kWarps-th 256-column unit of it, keeps a partial
    // sum per unit (32 at most), and sums them across the warp in one transposed reduction
    const int rows = st.n / programs, cr = chunk_rows(rows, st.k), upr = (st.k + 255) / 256;
    const int chunks = rows / cr;
    for (int c0 = 0; c0 < chunks; c0 += kRing) {
      const int group = min(kRing, chunks - c0), units = group * cr * upr;
      for (int g = 0; g < group; ++g)  // the group's bytes first: then its loads need no wait between them
        mbarrier_wait(&full[(j + c0 + g) % kRing], static_cast<unsigned>((j + c0 + g) / kRing) & 1u);
      float acc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        acc[i] = 0.0f;
        const int u = warp + kWarps * i;
        if (u < units) {
          const int r = u % (cr * upr) / upr, col = u % upr * 256 + 8 * lane;
          const int jc = j + c0 + u / (cr * upr);  // the unit's chunk's place in the weight stream
          if (col < st.k) {
            const auto* w =
                reinterpret_cast<const __nv_bfloat16*>(ring + static_cast<size_t>(jc % kRing) * kChunkBytes);
            const uint4 wv = *reinterpret_cast<const uint4*>(w + static_cast<size_t>(r) * st.k + col);
            const __nv_bfloat16* we = reinterpret_cast<const __nv_bfloat16*>(&wv);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[i] += to_float(we[e]) * x[col + e];
          }
        }
      }
      const float total = warp_transpose_sum(acc, lane);  // lane i: unit warp + kWarps i
      if (warp + kWarps * lane < units) partial[warp + kWarps * lane] = total;
      __syncthreads();  // every partial written, every read of the group's ring buffers done
      for (int t = static_cast<int>(threadIdx.x); t < group * cr; t += kThreads) {
        float sum = 0.0f;
        for (int q = 0; q < upr; ++q) sum += partial[t * upr + q];
        y_rows[c0 * cr + t] = scale * sum;
      }
      if (threadIdx.x == 0)  // the group's buffers refilled with the chunks kRing further on
        for (int g = 0; g < group; ++g) issue_chunk(c, programs, rank, j + c0 + g + kRing, ring, full);
      __syncthreads();  // partial is rewritten by the next group
    }
    j += chunks;
    // this program's rows of y_s to every program's copy of the next input (itself included)
    for (int t = static_cast<int>(threadIdx.x); t < (rows / 4) * programs; t += kThreads) {
      const int v = t / programs, dst = rank * rows + 4 * v;
      const uint4 val = *reinterpret_cast<const uint4*>(y_rows + 4 * v);
      st_async_peer(next + dst, static_cast<unsigned>(t % programs), val, next_bar);
    }
  }
  // the last output, complete in every program: each stores its rows
  mbarrier_wait<Scope::kCluster>((c.stages & 1) ? &xbar[1] : &xbar[0], static_cast<unsigned>((c.stages - 1) >> 1) & 1u);
  const float* last = (c.stages & 1) ? xbuf[1] : xbuf[0];
  const int rows = c.stage[c.stages - 1].n / programs;
  for (int i = static_cast<int>(threadIdx.x); i < rows; i += kThreads) c.y[rank * rows + i] = last[rank * rows + i];
}

// One cluster of `programs` runs the chain; cudaErrorInvalidValue for a chain `valid` refuses.
inline cudaError_t run(const Chain& c, int programs, cudaStream_t stream) {
  if (!valid(c, programs)) return cudaErrorInvalidValue;
  const size_t smem = smem_bytes(c, programs);
  const cudaError_t err = opt_in_smem<chain_kernel>(static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_cluster<chain_kernel>(dim3(static_cast<unsigned>(programs)), programs, kThreads, smem, stream, c);
}

}  // namespace cluster_gemv
