// One query's attention over a long paged context on every SM, the split-softmax merge done in clusters:
// what E2B's full layer at B = 1 could reach against the copy bandwidth (4 query heads of 512 entries, one
// key-value head; 16 MiB of keys and values at 8K, a 4 µs floor at 4.2 TB/s), beside today's kernel (23.4 µs on
// 2026-12-04, ~3.7 µs a tile of 64 KiB whatever its pipeline: benchmarks/README.md, "Attention's K/V tiles
// pipelined past the block table", and "Full attention from a ring of bulk copies").
//
// Program p of P takes keys [p ctx / P, (p + 1) ctx / P), whole pages of kPage keys. Thread 0 reads the block
// table entries and bulk-copies each page of keys and of values (16 KiB each, as the cache holds them) into
// a ring of kRing buffers, K page i as chunk 2 i and V page i as chunk 2 i + 1, refilled as consumed: all of a
// program's bytes of an 8K context are in flight from its start. Per page: a warp scores two keys against the
// 4 heads (a lane 16 entries, the queries in registers), warp 0 folds the 16 scores into each head's running
// max and exp-sum (the scores become their exponentials, the heads' accumulators a rescale factor), then a
// thread accumulates two entries of the 4 heads' outputs over the page's values. The partial outputs merge
// in two levels, neither through a grid-wide wait:
// - in the cluster (kCluster programs): each program pushes to program r its partial of the entries r owns
//   (64 of each head) with its heads' max and exp-sum (st.async, counted by r's mbarrier); r merges the
//   kCluster partials of its entries (rescaled to the common max);
// - across the P / kCluster clusters: program r of each cluster writes its merged entries and statistics to
//   the workspace and counts itself on counters[r]; the last of the clusters' programs r to arrive merges
//   the entries r of every cluster, writes them normalised to out and resets counters[r] for the next launch.
#pragma once

#include <cstdint>

#include "gemma4_mtp/cluster.cuh"
#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"

#include "bulk_ring.cuh"

namespace stream_attention {

using namespace gemma4_mtp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeads = 4;                         // E2B's query heads on its one key-value head
constexpr int kDim = 512;                         // the full layer's head dimension
constexpr int kPage = 16;                         // keys a page: the cache's block size
constexpr int kPageBytes = kPage * kDim * 2;      // a page of keys or of values: 16 KiB
constexpr int kRing = 8;                          // 4 pages of keys and values in flight
constexpr int kCluster = 8;                       // programs a cluster (a portable size)
constexpr int kOwned = kDim / kCluster;           // entries of each head a program merges
constexpr int kSlot = kHeads * kOwned + 2 * kHeads;  // floats pushed to an owner: its entries, max, exp-sum
using Ring = BulkRing<kRing, kPageBytes>;
static_assert(kPage == 2 * kWarps && kDim == 32 * 16 && kDim == 2 * kThreads, "the thread mappings below");

struct Attention {
  const float* q;                // [kHeads, kDim], 16-byte aligned (normed and rotated: the op's input)
  const __nv_bfloat16* k_cache;  // [pages, kPage, kDim], one key-value head, 16-byte aligned
  const __nv_bfloat16* v_cache;
  const int32_t* block_table;    // [ctx / kPage] pages of the request
  int ctx;                       // keys, a multiple of kPage * programs
  float* out;                    // [kHeads, kDim]
  float* workspace;              // [programs, kSlot] (programs > kCluster)
  int32_t* counters;             // [kCluster], zero before the first launch; each launch leaves them zero
};

// What the kernel takes: whole clusters, whole pages a program, the query and the caches 16-byte aligned
// (vector loads, bulk copies' sources).
inline bool valid(const Attention& a, int programs) {
  if (!host_aligned16(a.q) || !host_aligned16(a.k_cache) || !host_aligned16(a.v_cache)) return false;
  return programs >= kCluster && programs % kCluster == 0 && a.ctx > 0 && a.ctx % (kPage * programs) == 0;
}

// Shared memory: the ring, the page's scores (then their exponentials), the heads' rescale factors and
// statistics, the program's partial output, the kCluster partials received, the ring's and the partials'
// mbarriers, the merge's election. (Every offset 16-byte aligned: 3 kHeads + kPage kHeads floats before own.)
inline size_t smem_bytes() {
  return Ring::kBytes + (kPage * kHeads + 3 * kHeads + kHeads * kDim + kCluster * kSlot) * 4 + (kRing + 1) * 8 + 16;
}

__global__ void __launch_bounds__(kThreads, 1) attention_kernel(Attention a) {
  if constexpr (!kHasClusters) __trap();
  const int programs = static_cast<int>(gridDim.x), rank = static_cast<int>(cluster_rank());
  const int pages = a.ctx / kPage / programs, first_page = static_cast<int>(blockIdx.x) * pages;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  unsigned char* smem = dynamic_smem();
  float* scores = reinterpret_cast<float*>(smem + Ring::kBytes);  // [kPage][kHeads], key-major
  float* alpha = scores + kPage * kHeads;                          // [kHeads] this page's rescale
  float* stat = alpha + kHeads;                                    // [2 kHeads] max, exp-sum
  float* own = stat + 2 * kHeads;                                  // [kHeads][kDim] the partial output
  float* recv = own + kHeads * kDim;                               // [kCluster][kSlot]
  uint64_t* full = reinterpret_cast<uint64_t*>(recv + kCluster * kSlot);
  uint64_t* pbar = full + kRing;  // the partials pushed to this program
  // whether this program merges the clusters (dynamic shared memory: the emulation runs a cluster's programs
  // at once, and a static __shared__ is one object there)
  int* last = reinterpret_cast<int*>(pbar + 1);
  const Ring ring{smem, full};
  auto fill = [&](int c) {  // thread 0: chunk c of the program's stream, if any
    if (c >= 2 * pages) return;
    const __nv_bfloat16* cache = (c & 1) ? a.v_cache : a.k_cache;
    ring.fill(c, cache + static_cast<size_t>(a.block_table[first_page + c / 2]) * kPage * kDim, kPageBytes);
  };
  if (threadIdx.x == 0) {
    ring.init();
    mbarrier_init(pbar, 1);
    fence_mbarrier_init();
    for (int c = 0; c < kRing; ++c) fill(c);
    mbarrier_arrive_expect_tx(pbar, static_cast<unsigned>(kCluster * kSlot) * 4u);
  }
  float q[kHeads][16];  // a lane's 16 entries of every head
#pragma unroll
  for (int h = 0; h < kHeads; ++h)
#pragma unroll
    for (int e = 0; e < 16; e += 4) {
      const float4 v = *reinterpret_cast<const float4*>(a.q + h * kDim + 16 * lane + e);
      q[h][e] = v.x, q[h][e + 1] = v.y, q[h][e + 2] = v.z, q[h][e + 3] = v.w;
    }
  float m[kHeads], l[kHeads];  // warp 0's running statistics (every lane the same)
#pragma unroll
  for (int h = 0; h < kHeads; ++h) m[h] = -INFINITY, l[h] = 0.0f;
  float acc[kHeads][2] = {};  // entries 2 t, 2 t + 1 of every head
  cluster_sync();             // every program's mbarriers initialised before anyone pushes into it
  for (int i = 0; i < pages; ++i) {
    ring.wait(2 * i);
    const __nv_bfloat16* kp = ring.slot<const __nv_bfloat16>(2 * i);
    float d[2][kHeads];  // keys 2 warp and 2 warp + 1, a lane's part of each head's score
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const __nv_bfloat16* row = kp + (2 * warp + t) * kDim + 16 * lane;
      const uint4 k0 = *reinterpret_cast<const uint4*>(row), k1 = *reinterpret_cast<const uint4*>(row + 8);
      const __nv_bfloat16* ke[2] = {reinterpret_cast<const __nv_bfloat16*>(&k0),
                                    reinterpret_cast<const __nv_bfloat16*>(&k1)};
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < 16; ++e) s += to_float(ke[e / 8][e % 8]) * q[h][e];
        d[t][h] = s;
      }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) d[t][h] += __shfl_xor_sync(0xffffffffu, d[t][h], o);
        if (lane == 0) scores[(2 * warp + t) * kHeads + h] = d[t][h];
      }
    __syncthreads();
    if (warp == 0) {  // each head's max and exp-sum over the page, the scores turned into exponentials
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float s = lane < kPage ? scores[lane * kHeads + h] : -INFINITY;
        float top = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        const float m_new = fmaxf(m[h], top), p = lane < kPage ? expf(s - m_new) : 0.0f;
        float sum = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float r = expf(m[h] - m_new);  // 0 on the first page (m = -inf)
        l[h] = l[h] * r + sum;
        m[h] = m_new;
        if (lane < kPage) scores[lane * kHeads + h] = p;
        if (lane == 0) alpha[h] = r;
      }
    }
    __syncthreads();
    ring.wait(2 * i + 1);
    const __nv_bfloat16* vp = ring.slot<const __nv_bfloat16>(2 * i + 1);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) acc[h][0] *= alpha[h], acc[h][1] *= alpha[h];
#pragma unroll 4
    for (int k = 0; k < kPage; ++k) {
      const uint32_t pair = *reinterpret_cast<const uint32_t*>(vp + k * kDim + 2 * threadIdx.x);
      const __nv_bfloat16* ve = reinterpret_cast<const __nv_bfloat16*>(&pair);
      const float v0 = to_float(ve[0]), v1 = to_float(ve[1]);
      const float4 p = *reinterpret_cast<const float4*>(scores + k * kHeads);  // the key's 4 weights at once
      acc[0][0] += p.x * v0, acc[0][1] += p.x * v1;
      acc[1][0] += p.y * v0, acc[1][1] += p.y * v1;
      acc[2][0] += p.z * v0, acc[2][1] += p.z * v1;
      acc[3][0] += p.w * v0, acc[3][1] += p.w * v1;
    }
    __syncthreads();  // every read of the page's two buffers, its scores and its rescale done
    if (threadIdx.x == 0) {
      fill(2 * i + kRing);
      fill(2 * i + 1 + kRing);
    }
  }
  // the program's partial: its outputs and its heads' statistics, then to each program r of the cluster the
  // entries r merges
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    own[h * kDim + 2 * threadIdx.x] = acc[h][0];
    own[h * kDim + 2 * threadIdx.x + 1] = acc[h][1];
  }
  if (threadIdx.x == 0)
#pragma unroll
    for (int h = 0; h < kHeads; ++h) stat[h] = m[h], stat[kHeads + h] = l[h];
  __syncthreads();
  constexpr int kPushes = kSlot / 4;  // 16-byte pushes to each owner
  for (int t = static_cast<int>(threadIdx.x); t < kCluster * kPushes; t += kThreads) {
    const int to = t / kPushes, v = t % kPushes, vec = kOwned / 4;  // v: a head's 4 entries, or 4 statistics
    const float* src = v < kHeads * vec ? own + (v / vec) * kDim + to * kOwned + 4 * (v % vec)
                                        : stat + 4 * (v - kHeads * vec);
    st_async_peer(recv + rank * kSlot + 4 * v, static_cast<unsigned>(to), *reinterpret_cast<const uint4*>(src),
                  pbar);
  }
  mbarrier_wait<Scope::kCluster>(pbar, 0u);
  // this program's entries (a thread one of a head's kOwned entries) merged over the cluster
  const int h = static_cast<int>(threadIdx.x) / kOwned, e = static_cast<int>(threadIdx.x) % kOwned;
  const float* rs = recv + kHeads * kOwned;  // a sender's statistics, at p * kSlot
  float top = -INFINITY;
  for (int p = 0; p < kCluster; ++p) top = fmaxf(top, rs[p * kSlot + h]);
  float o = 0.0f, sum = 0.0f;
  for (int p = 0; p < kCluster; ++p) {
    const float w = expf(rs[p * kSlot + h] - top);
    o += w * recv[p * kSlot + h * kOwned + e];
    sum += w * rs[p * kSlot + kHeads + h];
  }
  const int groups = programs / kCluster;
  float* out = a.out + h * kDim + rank * kOwned + e;
  if (groups == 1) {
    *out = o / sum;
    return;
  }
  // across the clusters: this program's merged entries to the workspace, the last cluster's program r merges
  float* slot = a.workspace + static_cast<size_t>(blockIdx.x) * kSlot;
  slot[h * kOwned + e] = o;
  if (e == 0) slot[kHeads * kOwned + h] = top, slot[kHeads * kOwned + kHeads + h] = sum;
  __threadfence();  // the stores visible to the GPU before the count says so
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(&a.counters[rank], 1) == groups - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();  // the other clusters' stores, counted, seen after the count
  top = -INFINITY;
  for (int g = 0; g < groups; ++g)
    top = fmaxf(top, __ldcg(a.workspace + static_cast<size_t>(g * kCluster + rank) * kSlot + kHeads * kOwned + h));
  o = 0.0f, sum = 0.0f;
  for (int g = 0; g < groups; ++g) {
    const float* s = a.workspace + static_cast<size_t>(g * kCluster + rank) * kSlot;
    const float w = expf(__ldcg(s + kHeads * kOwned + h) - top);
    o += w * __ldcg(s + h * kOwned + e);
    sum += w * __ldcg(s + kHeads * kOwned + kHeads + h);
  }
  *out = o / sum;
  if (threadIdx.x == 0) a.counters[rank] = 0;  // for the next launch (ordered by the kernel's end)
}

// `programs` programs (clusters of kCluster) run the attention; cudaErrorInvalidValue for what `valid` refuses.
inline cudaError_t run(const Attention& a, int programs, cudaStream_t stream) {
  if (!valid(a, programs)) return cudaErrorInvalidValue;
  const size_t smem = smem_bytes();
  const cudaError_t err = opt_in_smem<attention_kernel>(static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_cluster<attention_kernel>(dim3(static_cast<unsigned>(programs)), kCluster, kThreads, smem, stream, a);
}

}  // namespace stream_attention
