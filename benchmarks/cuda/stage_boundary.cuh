// What one dependent stage of a drafter step costs on a GPU, three ways. Issue 11 asks for an E2B step
// in <= 20 us; the step is 27 dependent kernels whose bytes take ~10 us at the bandwidth, so what each
// boundary between two stages costs decides whether a persistent per-step kernel (grid barriers instead
// of launches) is worth writing, and how few stages it would need. This measures that boundary before
// anyone writes it (benchmarks/bench_stage_boundary.py; its predictions in benchmarks/README.md).
//
// A chain of `stages` stages over two vectors of n uint32. In stage s every program reads all of
// vector s % 2 with 16-byte loads (as every CTA of a GEMV reads its whole activation), sums it, and
// writes its own slice of vector (s + 1) % 2: next[i] = prev[i] + sum + 1. Each stage therefore
// depends on every program of the one before, like the glue stages of a step.
//   kLaunch   one kernel per stage, in stream order
//   kPdl      one kernel per stage with programmatic dependent launch (sm_90+), as the step's kernels:
//             griddepcontrol.wait before the first read, launch_dependents right after it
//   kBarrier  one cooperative kernel, grid_barrier() between stages, as a persistent step would run
//   kBarrierFence  the same with the barrier's fence-and-atomic arrival (grid_barrier.cuh: Arrival), the
//             pattern of last_to_arrive (mma_gemv.cuh), to price its __threadfence() against a release
#pragma once

#include <cstdint>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/grid_barrier.cuh"
#include "gemma4_mtp/launch.cuh"

namespace stage_boundary {

using namespace gemma4_mtp;

enum class Mode { kLaunch, kPdl, kBarrier, kBarrierFence };
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct Chain {
  uint32_t* vec[2];  // n each, 16-byte aligned
  int n;             // a multiple of 4
  int stages;
  int32_t* counter;  // the grid barrier's (kBarrier): its low 31 bits zero, as every barrier leaves them
};

__device__ __forceinline__ void stage(const Chain& c, int s) {
  // selects, not c.vec[s & 1]: a dynamic index into a kernel parameter would copy it to local memory
  const uint32_t* prev = (s & 1) ? c.vec[1] : c.vec[0];
  uint32_t* next = (s & 1) ? c.vec[0] : c.vec[1];
  uint32_t sum = 0;
  for (int i = 4 * static_cast<int>(threadIdx.x); i < c.n; i += 4 * kThreads) {
    const uint4 v = *reinterpret_cast<const uint4*>(prev + i);
    sum += v.x + v.y + v.z + v.w;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // rewritten by the next stage of a kBarrier program only after grid_barrier's __syncthreads
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(dynamic_smem());
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  sum = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += warp_sums[w];
  const int per = (c.n + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  const int end = min(c.n, (static_cast<int>(blockIdx.x) + 1) * per);
  for (int i = static_cast<int>(blockIdx.x) * per + static_cast<int>(threadIdx.x); i < end; i += kThreads)
    next[i] = prev[i] + sum + 1u;
}

__global__ void __launch_bounds__(kThreads) stage_kernel(Chain c, int s) {
  griddep_wait();  // vector s % 2 is the previous kernel's output
  griddep_launch_dependents();
  stage(c, s);
}

template <Arrival kArrival>
__global__ void __launch_bounds__(kThreads) chain_kernel(Chain c) {
  for (int s = 0; s < c.stages; ++s) {
    if (s > 0) grid_barrier<kArrival>(c.counter);
    stage(c, s);
  }
}

constexpr size_t kSmem = kWarps * sizeof(uint32_t);

// Enqueues the whole chain on `stream`: `stages` launches (kLaunch, kPdl) or one cooperative launch.
inline cudaError_t run(Mode mode, const Chain& c, int programs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(programs));
  if (mode == Mode::kBarrier)
    return launch_cooperative(chain_kernel<Arrival::kRelease>, grid, kThreads, kSmem, stream, c);
  if (mode == Mode::kBarrierFence)
    return launch_cooperative(chain_kernel<Arrival::kFence>, grid, kThreads, kSmem, stream, c);
  for (int s = 0; s < c.stages; ++s) {
    const cudaError_t err = launch(stage_kernel, grid, kThreads, kSmem, mode == Mode::kPdl, stream, c, s);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace stage_boundary
