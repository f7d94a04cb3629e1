// Thread block clusters (sm_90+): the programs of one cluster run at once on neighbouring SMs, meet at
// a hardware barrier and read each other's shared memory (distributed shared memory). A grid-wide
// barrier between two dependent stages cost as much as a kernel launch on the H200 (1.4-2.0 µs,
// benchmarks/README.md, "Stage boundaries"); a cluster barrier stays inside a GPC. Used by
// benchmarks/cuda/stage_boundary.cuh to price a stage boundary inside one cluster before any kernel is
// built on it (a drafter step in one cluster: benchmarks/README.md, "A drafter step in one cluster").
// Launch with launch.cuh's launch_cluster. tests/cuda_emulator/gemma4_mtp/cluster.cuh is the CPU twin.
#pragma once

#include <cstdint>

#include "gemma4_mtp/common.cuh"

namespace gemma4_mtp {

// Whether this compile has clusters (sm_90+; also the host pass). A kernel built on them begins with
// `if constexpr (!kHasClusters) __trap();`: below sm_90 it is never launched (launch_cluster needs sm_90)
// and compiles to nothing else, rather than to code around the primitives' traps.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kHasClusters = false;
#else
constexpr bool kHasClusters = true;
#endif

// Every thread of every program of the cluster arrives, then waits for all the others: the shared and
// global memory writes before it (release) are visible to every program of the cluster after it
// (acquire). Also what a program must pass before it exits while others may still read its shared
// memory. Every thread calls it (.aligned: the whole warp executes it together).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
  __trap();  // clusters need sm_90; the launchers never launch a cluster kernel below it
#endif
}

// This program's rank in its cluster (0 .. cluster size - 1).
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  __trap();
  return 0;
#endif
}

// The address of `p` (this program's shared memory) in the shared memory of the cluster's program `rank`
// (a generic address: plain loads and stores reach the other SM).
template <class T>
__device__ __forceinline__ T* cluster_peer(T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<T*>(out);
#else
  __trap();
  return p;
#endif
}

// Stores 16 bytes at `local_dst` of the cluster's program `rank` (local_dst and local_bar: addresses in
// this program's shared memory, mapped to that program's) and counts them as transaction bytes on its
// mbarrier at `local_bar` (st.async: no fence, no barrier; the complete_tx releases the bytes at cluster
// scope, mbarrier_wait<Scope::kCluster> acquires them). The receiving program announces the bytes of a
// phase with mbarrier_arrive_expect_tx (common.cuh), before or after they arrive.
__device__ __forceinline__ void st_async_peer(void* local_dst, unsigned rank, uint4 v, uint64_t* local_bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned dst, bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem_addr(local_dst)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(smem_addr(local_bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar)
               : "memory");
#else
  __trap();
#endif
}

}  // namespace gemma4_mtp
