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
//   kCluster  one kernel, one thread block cluster of all the programs (2-16, sm_90+), cluster_sync()
//             between stages (cluster.cuh): the vectors in global memory as above
//   kClusterShared  the same with the vectors in the programs' shared memory, each holding its slice of
//             both, read by the others through distributed shared memory: the activations of a step
//             that would run in one cluster never leave the SMs
//   kClusterPush  one cluster, no barrier between stages: each program holds the whole vector and
//             pushes its slice of the next into every program's copy (st.async), whose mbarrier counts
//             the bytes; a stage starts when its vector has arrived (Hopper's remote-store path)
// and what a group of programs streams (stream_kernel): the bytes per second `programs` SMs read from L2
// (a slice each, re-read) or from DRAM, which bounds a step run by the SMs of one cluster.
#pragma once

#include <cstdint>

#include "gemma4_mtp/cluster.cuh"
#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/grid_barrier.cuh"
#include "gemma4_mtp/launch.cuh"

#include "block_sum.cuh"

namespace stage_boundary {

using namespace gemma4_mtp;

enum class Mode { kLaunch, kPdl, kBarrier, kBarrierFence, kCluster, kClusterShared, kClusterPush };
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
  sum = block_sum<kWarps>(sum, reinterpret_cast<uint32_t*>(dynamic_smem()));
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

__global__ void __launch_bounds__(kThreads) cluster_chain_kernel(Chain c) {
  if constexpr (!kHasClusters) __trap();
  for (int s = 0; s < c.stages; ++s) {
    if (s > 0) cluster_sync();
    stage(c, s);
  }
}

constexpr size_t kSmem = kWarps * sizeof(uint32_t);

// kClusterShared: elements per program (whole 16-byte vectors, so that a vector lies in one program's slice).
__host__ __device__ inline int shared_slice(int n, int programs) { return (n / 4 + programs - 1) / programs * 4; }
// Its dynamic shared memory: the warp sums, then the program's slice of both vectors.
inline size_t shared_smem(int n, int programs) {
  return kSmem + 2 * static_cast<size_t>(shared_slice(n, programs)) * sizeof(uint32_t);
}

// Program r holds elements [r * per, (r + 1) * per) of both vectors in its shared memory; stage s reads
// every slice of vector s % 2 (the others' through cluster_peer), sums it, and writes its own slice of
// vector (s + 1) % 2. One cluster_sync() after each stage, as kCluster has between stages (the last one
// keeps every program's slice alive until the others have read it), and one after loading the start.
__global__ void __launch_bounds__(kThreads) cluster_shared_chain_kernel(Chain c) {
  if constexpr (!kHasClusters) __trap();
  const int programs = static_cast<int>(gridDim.x), per = shared_slice(c.n, programs);
  const int rank = static_cast<int>(cluster_rank()), lo = rank * per, mine = max(0, min(c.n, lo + per) - lo);
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(dynamic_smem());
  uint32_t* buf[2] = {warp_sums + kWarps, warp_sums + kWarps + per};
  for (int i = static_cast<int>(threadIdx.x); i < mine; i += kThreads) buf[0][i] = c.vec[0][lo + i];
  cluster_sync();
  for (int s = 0; s < c.stages; ++s) {
    uint32_t* prev = (s & 1) ? buf[1] : buf[0];
    uint32_t* next = (s & 1) ? buf[0] : buf[1];
    uint32_t sum = 0;
    for (int i = 4 * static_cast<int>(threadIdx.x); i < c.n; i += 4 * kThreads) {
      const uint4 v = *reinterpret_cast<const uint4*>(cluster_peer(prev + i % per, static_cast<unsigned>(i / per)));
      sum += v.x + v.y + v.z + v.w;
    }
    sum = block_sum<kWarps>(sum, warp_sums);
    for (int i = static_cast<int>(threadIdx.x); i < mine; i += kThreads) next[i] = prev[i] + sum + 1u;
    cluster_sync();  // the slices of vector (s + 1) % 2 written, every read of vector s % 2 done
  }
  const uint32_t* last = (c.stages & 1) ? buf[1] : buf[0];
  uint32_t* out = (c.stages & 1) ? c.vec[1] : c.vec[0];  // a select: see stage()
  for (int i = static_cast<int>(threadIdx.x); i < mine; i += kThreads) out[lo + i] = last[i];
}

// kClusterPush: every program holds both vectors whole (16-byte aligned after two sets of warp sums and two
// mbarriers).
constexpr size_t kPushHeader = 2 * kSmem + 2 * sizeof(uint64_t);
inline size_t push_smem(int n) { return kPushHeader + 2 * static_cast<size_t>(n) * sizeof(uint32_t); }

// Vector v >= 1 arrives in buffer v % 2, counted by mbarrier v % 2, whose ((v - 1) / 2)-th phase it is;
// vector 0 is loaded from global memory. In stage s a program announces the n * 4 bytes of vector s + 1
// on its own mbarrier, waits for vector s (s >= 1), sums it, and pushes its slice of vector s + 1 to every
// program (itself included). No buffer is overwritten early: vector s + 2 reaches a program's buffer
// s % 2 only from programs that have vector s + 1, which needs this program's slice, pushed after it read
// vector s. The program's slice of the last vector goes to global memory after it has arrived.
__global__ void __launch_bounds__(kThreads) cluster_push_chain_kernel(Chain c) {
  if constexpr (!kHasClusters) __trap();
  const int programs = static_cast<int>(gridDim.x), per = shared_slice(c.n, programs);
  const int lo = static_cast<int>(cluster_rank()) * per, mine = max(0, min(c.n, lo + per) - lo);
  unsigned char* smem = dynamic_smem();
  // the warp sums of even and odd stages: a warp may start stage s + 1 (its vector arrived) while a warp
  // that pushes nothing still reads stage s's sums
  uint32_t* warp_sums = reinterpret_cast<uint32_t*>(smem);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 2 * kSmem);
  uint32_t* buf[2] = {reinterpret_cast<uint32_t*>(smem + kPushHeader),
                      reinterpret_cast<uint32_t*>(smem + kPushHeader) + c.n};
  if (threadIdx.x == 0) {
    mbarrier_init(&bars[0], 1);
    mbarrier_init(&bars[1], 1);
    fence_mbarrier_init();
  }
  for (int i = static_cast<int>(threadIdx.x); i < c.n; i += kThreads) buf[0][i] = c.vec[0][i];
  cluster_sync();  // every program's mbarriers initialised before anyone pushes
  for (int s = 0; s < c.stages; ++s) {
    uint32_t* prev = (s & 1) ? buf[1] : buf[0];
    uint32_t* next = (s & 1) ? buf[0] : buf[1];
    uint64_t* next_bar = (s & 1) ? &bars[0] : &bars[1];
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(next_bar, static_cast<unsigned>(c.n) * 4u);
    if (s > 0) mbarrier_wait<Scope::kCluster>((s & 1) ? &bars[1] : &bars[0], static_cast<unsigned>((s - 1) >> 1) & 1u);
    uint32_t sum = 0;
    for (int i = 4 * static_cast<int>(threadIdx.x); i < c.n; i += 4 * kThreads) {
      const uint4 v = *reinterpret_cast<const uint4*>(prev + i);
      sum += v.x + v.y + v.z + v.w;
    }
    // no barrier between stages here to order block_sum's words: two sets, alternating by stage
    sum = block_sum<kWarps>(sum, warp_sums + (s & 1) * kWarps);
    // each 16 bytes of this program's slice to each program: (vector, program) pairs over the threads
    for (int j = static_cast<int>(threadIdx.x); j < (mine / 4) * programs; j += kThreads) {
      const int i = lo + 4 * (j / programs);
      uint4 v = *reinterpret_cast<const uint4*>(prev + i);
      v = make_uint4(v.x + sum + 1u, v.y + sum + 1u, v.z + sum + 1u, v.w + sum + 1u);
      st_async_peer(next + i, static_cast<unsigned>(j % programs), v, next_bar);
    }
  }
  if (c.stages > 0) mbarrier_wait<Scope::kCluster>((c.stages & 1) ? &bars[1] : &bars[0],
                                          static_cast<unsigned>((c.stages - 1) >> 1) & 1u);
  const uint32_t* last = (c.stages & 1) ? buf[1] : buf[0];
  uint32_t* out = (c.stages & 1) ? c.vec[1] : c.vec[0];  // a select: see stage()
  for (int i = static_cast<int>(threadIdx.x); i < mine; i += kThreads) out[lo + i] = last[lo + i];
}

// What `programs` SMs stream: program p sums the 16-byte words of its slice of `per_vec` words of buf,
// `passes` times (loads through L2, 8 a thread in flight: 64 KiB a program), into sums[p]. A slice re-read
// is served by L2 after the first pass when all slices fit in it; the slope between passes gives the
// rate with the launch taken out.
constexpr int kStreamThreads = 512;
constexpr int kStreamUnroll = 8;

__global__ void __launch_bounds__(kStreamThreads) stream_kernel(const uint4* buf, int per_vec, int passes,
                                                                uint32_t* sums) {
  const uint4* mine = buf + static_cast<size_t>(blockIdx.x) * static_cast<size_t>(per_vec);
  uint32_t acc = 0;
  for (int p = 0; p < passes; ++p) {
    for (int i = static_cast<int>(threadIdx.x); i < per_vec; i += kStreamThreads * kStreamUnroll) {
      uint4 v[kStreamUnroll];
#pragma unroll
      for (int u = 0; u < kStreamUnroll; ++u) {
        const int j = i + u * kStreamThreads;
        v[u] = j < per_vec ? __ldcg(mine + j) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < kStreamUnroll; ++u) acc += v[u].x + v[u].y + v[u].z + v[u].w;
    }
  }
  acc = block_sum<kStreamThreads / 32>(acc, reinterpret_cast<uint32_t*>(dynamic_smem()));
  if (threadIdx.x == 0) sums[blockIdx.x] = acc;
}

inline cudaError_t stream(const uint4* buf, int per_vec, int passes, uint32_t* sums, int programs, cudaStream_t st) {
  return launch(stream_kernel, dim3(static_cast<unsigned>(programs)), kStreamThreads,
                kStreamThreads / 32 * sizeof(uint32_t), false, st, buf, per_vec, passes, sums);
}

// Enqueues the whole chain on `stream`: `stages` launches (kLaunch, kPdl), one cooperative launch (kBarrier,
// kBarrierFence) or one cluster of `programs` (kCluster, kClusterShared, kClusterPush).
inline cudaError_t run(Mode mode, const Chain& c, int programs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(programs));
  if (mode == Mode::kBarrier)
    return launch_cooperative(chain_kernel<Arrival::kRelease>, grid, kThreads, kSmem, stream, c);
  if (mode == Mode::kBarrierFence)
    return launch_cooperative(chain_kernel<Arrival::kFence>, grid, kThreads, kSmem, stream, c);
  if (mode == Mode::kCluster) return launch_cluster<cluster_chain_kernel>(grid, programs, kThreads, kSmem, stream, c);
  if (mode == Mode::kClusterShared) {
    const size_t smem = shared_smem(c.n, programs);
    const cudaError_t err = opt_in_smem<cluster_shared_chain_kernel>(static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    return launch_cluster<cluster_shared_chain_kernel>(grid, programs, kThreads, smem, stream, c);
  }
  if (mode == Mode::kClusterPush) {
    const size_t smem = push_smem(c.n);
    const cudaError_t err = opt_in_smem<cluster_push_chain_kernel>(static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    return launch_cluster<cluster_push_chain_kernel>(grid, programs, kThreads, smem, stream, c);
  }
  for (int s = 0; s < c.stages; ++s) {
    const cudaError_t err = launch(stage_kernel, grid, kThreads, kSmem, mode == Mode::kPdl, stream, c, s);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace stage_boundary
