// A grid-wide barrier for the programs of a cooperative launch (launch.cuh: launch_cooperative), used by
// the centroid head between its scores and its candidates, and by benchmarks/stage_boundary.cuh, which
// measures what such a barrier costs against a kernel launch.
#pragma once

#include "gemma4_mtp/common.cuh"

namespace gemma4_mtp {

// How an arriving program publishes its block's writes: a release atomic (atom.add.release.gpu, as
// cooperative groups' grid.sync() on sm_70+; sm_90a: MEMBAR.ALL.GPU + ATOM), or __threadfence() and a
// relaxed atomicAdd (the CUDA samples' pattern, and last_to_arrive's in mma_gemv.cuh; sm_90a:
// MEMBAR.SC.GPU + CCTL.IVALL + ATOM). benchmarks/bench_stage_boundary.py times both.
enum class Arrival { kRelease, kFence };

// Every program arrives once; program 0 adds 2^31 - (grid - 1), the others 1, so the top bit of the
// counter flips exactly when all have arrived, whichever it was (cooperative groups' grid sync), provided
// its low 31 bits are zero on arrival: a barrier adds 2^31 in all, so a counter that starts at zero keeps
// them zero through any number of barriers and launches (no reset; a launch that dies between arrivals
// leaves it unusable). Writes before the barrier are visible to every program after it (published by
// the arrival, acquired by the polling load).
template <Arrival kArrival = Arrival::kRelease>
__device__ __forceinline__ void grid_barrier(int32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t* c = reinterpret_cast<uint32_t*>(counter);
    const uint32_t add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
    uint32_t old;
    if constexpr (kArrival == Arrival::kRelease) {
      old = atomic_add_release(c, add);  // the block's writes are ordered before it by bar.sync
    } else {
      __threadfence();
      old = atomicAdd(c, add);
    }
    while (((old ^ load_acquire(c)) & 0x80000000u) == 0) {
    }
  }
  __syncthreads();
}

}  // namespace gemma4_mtp
