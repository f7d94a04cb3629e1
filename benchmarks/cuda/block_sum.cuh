// The one block-wide sum of the benchmarks' kernels (stage_boundary.cuh, cluster_gemv.cuh, stream_gemv.cuh).
#pragma once

// The block's sum of the threads' values, in every thread, through kBlockWarps words of shared memory at
// warp_sums. The next call on the same words must come after a barrier that every thread passes after
// reading them (a later __syncthreads, or the next stage's grid or cluster barrier).
template <int kBlockWarps, class T>
__device__ __forceinline__ T block_sum(T v, T* warp_sums) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  T total = 0;
#pragma unroll
  for (int w = 0; w < kBlockWarps; ++w) total += warp_sums[w];
  return total;
}
