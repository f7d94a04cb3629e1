// One query's attention over a long paged context on every SM, the split-softmax merge done in clusters: what a
// drafter's attention at B = 1 could reach against the copy bandwidth, beside today's kernel. The layers priced
// (drafter_shapes; benchmarks/README.md, "Full attention from a ring of bulk copies" and "31B's attention from a
// ring of bulk copies"): E2B's full layer (4 query heads of 512 on one key-value head: 16 MiB at 8K, a 4 µs floor
// at 4.2 TB/s; today's kernel 23.4 µs on 2026-12-04), 31B's full layer (8 query heads of 512 on each of 4
// key-value heads: 64 MiB at 8K, 16 µs) and 31B's sliding layer (2 of 256 on each of 16, a window of 1024 keys:
// 16 MiB, 4 µs).
//
// The programs split evenly over the key-value heads; program p of a head's P takes keys [p ctx / P, (p + 1) ctx /
// P), whole pages of kPage keys. Thread 0 reads the block table entries and bulk-copies each page of the head's keys
// and of its values into a ring of buffers (K page i as chunk 2 i, V page i as chunk 2 i + 1, refilled as consumed:
// 128 KiB in flight, all of a program's bytes of E2B's 8K context from its start): one copy of 16 KiB where the
// cache holds one key-value head (a page is contiguous) and the rows need no padding, else a copy per key row (the
// page's rows interleave the heads: [pages, kPage, heads, D], as vLLM's cache and this project's target hold them;
// the tensor-core path pads its rows, attention_kernel<L, true>). On the CUDA cores, per page: each warp scores
// its keys against its heads (a lane 8 or 16 entries of up to 4 heads' queries, held in registers; 8 heads are two
// groups of warps), warp h folds the page's scores of head h into its running max and exp-sum (the scores become
// their exponentials, the heads' accumulators a rescale factor), then a thread accumulates one or two entries of
// every head's output over the page's values. The partial outputs merge in two levels, neither through a
// grid-wide wait:
// - in the cluster (kCluster programs of one key-value head): each program pushes to program r its partial of the
//   entries r owns (D / kCluster of each head) with its heads' max and exp-sum (st.async, counted by r's
//   mbarrier); r merges the kCluster partials of its entries (rescaled to the common max);
// - across the head's P / kCluster clusters: program r of each cluster writes its merged entries and statistics
//   to the workspace and counts itself on the head's counters[r]; the last of the clusters' programs r to arrive
//   merges the entries r of every cluster, writes them normalised to out and resets its counter for the next
//   launch.
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
constexpr int kPage = 16;               // keys a page: the cache's block size
constexpr int kCluster = 8;             // programs a cluster (a portable size)
constexpr int kInFlight = 128 * 1024;   // bytes of keys and values a program has asked for ahead of its math

// A layer's query heads on one key-value head and their dimension, and the mappings they fix.
template <int kHeads_, int kDim_>
struct Layer {
  static constexpr int kHeads = kHeads_, kDim = kDim_;
  static constexpr int kLane = kDim / 32;                      // a lane's entries of a key in the scores
  static constexpr int kWarpHeads = kHeads < 4 ? kHeads : 4;   // the heads whose queries a lane holds
  static constexpr int kGroups = kHeads / kWarpHeads;          // groups of warps, each scoring its heads
  static constexpr int kWarpKeys = kPage * kGroups / kWarps;   // keys a warp scores a page
  static constexpr int kEntries = kDim / kThreads;             // entries of each head's output a thread sums
  static constexpr int kRowBytes = kDim * 2;                   // a key or value row (bf16)
  static constexpr int kPageBytes = kPage * kRowBytes;         // a page of one head's keys or values
  static constexpr int kRing = kInFlight / kPageBytes;         // 8 pages' buffers at 512, 16 at 256
  static constexpr int kOwned = kDim / kCluster;               // entries of each head a program merges
  static constexpr int kSlot = kHeads * kOwned + 2 * kHeads;   // floats pushed to an owner: entries, max, exp-sum
  static constexpr int kAlpha = (kHeads + 3) / 4 * 4;          // the rescale factors, padded to 16 bytes
  // the tensor-core path (kMma): a warp's k steps of the scores (16 dimensions each) and n8 tiles of the output
  static constexpr int kWarpSteps = kDim / 16 / kWarps;
  static constexpr int kWarpTiles = kDim / 8 / kWarps;
  // a ring buffer's rows: the scalar path's as the cache holds them; the mma path's 16 bytes apart more, so that
  // the 8 rows an ldmatrix reads fall in different banks (a row of 512 or 1024 bytes is a whole number of bank rows)
  template <bool kMma>
  static constexpr int kSlotRow = kRowBytes + (kMma ? 16 : 0);
  template <bool kMma>
  using Ring = BulkRing<kRing, kPage * kSlotRow<kMma>>;
  static_assert(kHeads % kWarpHeads == 0 && kHeads <= kWarps && kHeads % 2 == 0, "a warp's statistics, float2 reads");
  static_assert(kLane % 8 == 0 && kEntries >= 1 && kEntries <= 2 && kDim == kEntries * kThreads, "lane mappings");
  static_assert(kWarps % kGroups == 0 && (kWarps / kGroups) * kWarpKeys == kPage && kOwned % 4 == 0, "the splits");
  static_assert(kHeads <= 8 && kWarpSteps >= 1 && kWarpTiles % 2 == 0, "mma: the heads are rows 0-7 of its tiles");
};
using E2bFull = Layer<4, 512>;     // E2B's full layer (E4B's has the same group and dimension)
using Full31b = Layer<8, 512>;     // 31B's full layer
using Sliding31b = Layer<2, 256>;  // 31B's sliding layer

struct Attention {
  const float* q;                // [kv_heads * kHeads, kDim], 16-byte aligned (normed and rotated: the op's input)
  const __nv_bfloat16* k_cache;  // [pages, kPage, kv_heads, kDim], 16-byte aligned
  const __nv_bfloat16* v_cache;
  const int32_t* block_table;    // [ctx / kPage] pages of the request
  int ctx;                       // keys, a multiple of kPage * programs / kv_heads
  int kv_heads;
  float* out;                    // [kv_heads * kHeads, kDim]
  float* workspace;              // [programs, kSlot] (more than kCluster programs a head)
  int32_t* counters;             // [kv_heads * kCluster], zero before the first launch; each launch leaves them zero
};

// What the kernel takes: whole clusters of one key-value head, whole pages a program, the query and the caches
// 16-byte aligned (vector loads, bulk copies' sources).
inline bool valid(const Attention& a, int programs) {
  if (!host_aligned16(a.q) || !host_aligned16(a.k_cache) || !host_aligned16(a.v_cache)) return false;
  if (a.kv_heads < 1 || programs % a.kv_heads != 0) return false;
  const int per_head = programs / a.kv_heads;
  return per_head >= kCluster && per_head % kCluster == 0 && a.ctx > 0 && a.ctx % (kPage * per_head) == 0;
}

// Shared memory: the ring, the heads' statistics, the program's partial output (the mma path's warps' partial
// scores before it), the kCluster partials received, the page's scores (then their exponentials), the heads'
// rescale factors, the ring's and the partials' mbarriers, the merge's election (every array a multiple of 16
// bytes, each start 16-byte aligned).
template <class L, bool kMma>
size_t smem_bytes() {
  static_assert(kWarps * kPage <= L::kDim, "the warps' partial scores fit where the partial output goes");
  return L::template Ring<kMma>::kBytes +
         (2 * L::kHeads + L::kHeads * L::kDim + kCluster * L::kSlot + kPage * L::kHeads + L::kAlpha) * 4 +
         (L::kRing + 1) * 8 + 16;
}

// Two fp32 values of an A fragment register as kParts bf16 pairs whose sum is the pair (each part the rounding of
// what the parts before it left): a product with bf16 keys or values summed over the parts is exact to ~2^-(8
// kParts + 1), fp32's 2^-24 at 3 parts. The query takes 3 (a score's error is its size times that, and softmax
// turns it into a relative error of the weights: 2 parts were 1e-4 off float64 at scores 40x peaked), the
// probabilities, in [0, 1], 2.
template <int kParts>
__device__ __forceinline__ void split(float x0, float x1, uint32_t (&parts)[kParts]) {
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    const float h0 = to_float(from_float<__nv_bfloat16>(x0)), h1 = to_float(from_float<__nv_bfloat16>(x1));
    parts[p] = pack2<__nv_bfloat16>(h0, h1);
    x0 -= h0, x1 -= h1;  // exact in fp32
  }
}

// kMma false: the scores and the output's sums on the CUDA cores, as above. kMma true: both on tensor cores
// (mma.m16n8k16, bf16 in, fp32 sums), the layer's heads rows 0..kHeads-1 of a 16-row tile (the rest zero): a warp
// scores the page's 16 keys over its kWarpSteps x 16 dimensions (the query split in three, `split`, in registers;
// the keys by ldmatrix from the ring), the warps' partial scores summed through shared memory by the statistics'
// warps; then a warp multiplies the page's probabilities (split in two) by the values of its kWarpTiles x 8
// dimensions (ldmatrix .trans). Far fewer instructions a page than the CUDA cores' path (benchmarks/README.md,
// "31B's attention from a ring of bulk copies", counts both).
template <class L, bool kMma>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(Attention a) {
  if constexpr (!kHasClusters) __trap();
  constexpr int kHeads = L::kHeads, kDim = L::kDim, kLane = L::kLane, kWarpHeads = L::kWarpHeads;
  constexpr int kEntries = L::kEntries, kOwned = L::kOwned, kSlot = L::kSlot, kRing = L::kRing;
  constexpr int kSlotRow = L::template kSlotRow<kMma>;  // bytes from a row of a ring buffer to the next
  using Ring = typename L::template Ring<kMma>;
  const int programs = static_cast<int>(gridDim.x), per_head = programs / a.kv_heads;
  const int head = static_cast<int>(blockIdx.x) / per_head, index = static_cast<int>(blockIdx.x) % per_head;
  const int rank = static_cast<int>(cluster_rank());
  const int pages = a.ctx / kPage / per_head, first_page = index * pages;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;  // the mma path: a lane's row (head) and column pair in its fragments
  // the scalar path: the warp's heads (h0 on) and keys (k0 on) in the scores
  const int h0 = warp / (kWarps / L::kGroups) * kWarpHeads, k0 = warp % (kWarps / L::kGroups) * L::kWarpKeys;
  unsigned char* smem = dynamic_smem();
  float* stat = reinterpret_cast<float*>(smem + Ring::kBytes);  // [2 kHeads] max, exp-sum
  float* own = stat + 2 * kHeads;                                // [kHeads][kDim] the partial output
  float* part = own;  // the mma path, until the partial output: [kWarps][kHeads][kPage] the warps' partial scores
  float* recv = own + kHeads * kDim;                             // [kCluster][kSlot]
  float* scores = recv + kCluster * kSlot;                       // [kPage][kHeads], key-major
  float* alpha = scores + kPage * kHeads;                        // [kHeads] this page's rescale
  uint64_t* full = reinterpret_cast<uint64_t*>(alpha + L::kAlpha);
  uint64_t* pbar = full + kRing;  // the partials pushed to this program
  // whether this program merges the clusters (dynamic shared memory: the emulation runs a cluster's programs
  // at once, and a static __shared__ is one object there)
  int* last = reinterpret_cast<int*>(pbar + 1);
  const Ring ring{smem, full};
  const size_t row_stride = static_cast<size_t>(a.kv_heads) * kDim;  // elements from a key row to the next
  auto fill = [&](int c) {  // thread 0: chunk c of the program's stream, if any
    if (c >= 2 * pages) return;
    const __nv_bfloat16* cache = (c & 1) ? a.v_cache : a.k_cache;
    const __nv_bfloat16* page =
        cache + (static_cast<size_t>(a.block_table[first_page + c / 2]) * kPage * a.kv_heads + head) * kDim;
    ring.fill_rows(c, page, kPage, L::kRowBytes, row_stride * sizeof(__nv_bfloat16), kSlotRow);
  };
  if (threadIdx.x == 0) {
    ring.init();
    mbarrier_init(pbar, 1);
    fence_mbarrier_init();
    for (int c = 0; c < kRing; ++c) fill(c);
    mbarrier_arrive_expect_tx(pbar, static_cast<unsigned>(kCluster * kSlot) * 4u);
  }
  const float* qh = a.q + static_cast<size_t>(head) * kHeads * kDim;  // this key-value head's queries
  // the scalar path: a lane's entries of its warp's heads; the mma path: the A fragments (rows g, in three parts)
  // of the warp's k steps (row g a head: zero past the layer's heads, and rows g + 8 always)
  float q[kMma ? 1 : kWarpHeads][kMma ? 1 : kLane];
  uint32_t qa[kMma ? L::kWarpSteps : 1][2][3];  // [step][cols 2t / 2t + 8][part]
  if constexpr (kMma) {
#pragma unroll
    for (int st = 0; st < L::kWarpSteps; ++st)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = (warp * L::kWarpSteps + st) * 16 + 8 * half + 2 * t;
        const float x0 = g < kHeads ? qh[g * kDim + d] : 0.0f, x1 = g < kHeads ? qh[g * kDim + d + 1] : 0.0f;
        split(x0, x1, qa[st][half]);
      }
  } else {
#pragma unroll
    for (int h = 0; h < kWarpHeads; ++h)
#pragma unroll
      for (int e = 0; e < kLane; e += 4) {
        const float4 v = *reinterpret_cast<const float4*>(qh + (h0 + h) * kDim + kLane * lane + e);
        q[h][e] = v.x, q[h][e + 1] = v.y, q[h][e + 2] = v.z, q[h][e + 3] = v.w;
      }
  }
  float m = -INFINITY, l = 0.0f;  // warp h < kHeads: head h's running statistics (every lane the same)
  float acc[kMma ? 1 : kHeads][kEntries] = {};  // the scalar path: entries kEntries t + j of every head
  float oc[kMma ? L::kWarpTiles : 1][4] = {};   // the mma path: the warp's n8 tiles of the output (rows g: heads)
  cluster_sync();                               // every program's mbarriers initialised before anyone pushes into it
  for (int i = 0; i < pages; ++i) {
    ring.wait(2 * i);
    const unsigned char* kp = ring.template slot<const unsigned char>(2 * i);
    if constexpr (kMma) {
      float sc[2][4] = {};  // keys 0-7 and 8-15: rows g (and g + 8, zero), columns 2t, 2t + 1
#pragma unroll
      for (int st = 0; st < L::kWarpSteps; ++st) {
        // matrices: keys 0-7 then 8-15, each at dimensions d and d + 8: b fragments of both key tiles
        const int d = (warp * L::kWarpSteps + st) * 16 + 8 * ((lane >> 3) & 1);
        uint32_t kb[4];
        ldmatrix_x4(kb, kp + ((lane >> 4) * 8 + (lane & 7)) * kSlotRow + 2 * d);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int p = 0; p < 3; ++p) {  // the query's parts
            const uint32_t av[4] = {qa[st][0][p], 0u, qa[st][1][p], 0u}, bv[2] = {kb[2 * nt], kb[2 * nt + 1]};
            mma_m16n8k16<__nv_bfloat16>(sc[nt], av, bv);
          }
      }
      if (g < kHeads)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) part[(warp * kHeads + g) * kPage + nt * 8 + 2 * t + e] = sc[nt][e];
    } else {
      const __nv_bfloat16* keys = reinterpret_cast<const __nv_bfloat16*>(kp);
      float d[L::kWarpKeys][kWarpHeads];  // the warp's keys, a lane's part of each head's score
#pragma unroll
      for (int kt = 0; kt < L::kWarpKeys; ++kt) {
        const __nv_bfloat16* row = keys + (k0 + kt) * kDim + kLane * lane;
        uint4 raw[kLane / 8];
#pragma unroll
        for (int c = 0; c < kLane / 8; ++c) raw[c] = *reinterpret_cast<const uint4*>(row + 8 * c);
        const __nv_bfloat16* ke = reinterpret_cast<const __nv_bfloat16*>(raw);
#pragma unroll
        for (int h = 0; h < kWarpHeads; ++h) {
          float sum = 0.0f;
#pragma unroll
          for (int e = 0; e < kLane; ++e) sum += to_float(ke[e]) * q[h][e];
          d[kt][h] = sum;
        }
      }
#pragma unroll
      for (int kt = 0; kt < L::kWarpKeys; ++kt)
#pragma unroll
        for (int h = 0; h < kWarpHeads; ++h) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) d[kt][h] += __shfl_xor_sync(0xffffffffu, d[kt][h], o);
          if (lane == 0) scores[(k0 + kt) * kHeads + h0 + h] = d[kt][h];
        }
    }
    __syncthreads();
    if (warp < kHeads) {  // head `warp`'s max and exp-sum over the page, its scores turned into exponentials
      const int h = warp;
      float s = -INFINITY;
      if (lane < kPage) {
        if constexpr (kMma) {  // the warps' partial scores of the key, summed in warp order
          s = 0.0f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) s += part[(w * kHeads + h) * kPage + lane];
        } else {
          s = scores[lane * kHeads + h];
        }
      }
      float top = s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
      const float m_new = fmaxf(m, top), p = lane < kPage ? expf(s - m_new) : 0.0f;
      float sum = p;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float r = expf(m - m_new);  // 0 on the first page (m = -inf)
      l = l * r + sum;
      m = m_new;
      if (lane < kPage) scores[lane * kHeads + h] = p;
      if (lane == 0) alpha[h] = r;
    }
    __syncthreads();
    ring.wait(2 * i + 1);
    const unsigned char* vbytes = ring.template slot<const unsigned char>(2 * i + 1);
    if constexpr (kMma) {
      const float r = g < kHeads ? alpha[g] : 0.0f;
      uint32_t pa[2][2];  // the probabilities' A fragment, rows g: keys 2t, 2t + 1 and 2t + 8, 2t + 9; two parts
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int k = 2 * t + 8 * half;
        split(g < kHeads ? scores[k * kHeads + g] : 0.0f, g < kHeads ? scores[(k + 1) * kHeads + g] : 0.0f, pa[half]);
      }
#pragma unroll
      for (int nt = 0; nt < L::kWarpTiles; ++nt) oc[nt][0] *= r, oc[nt][1] *= r;
#pragma unroll
      for (int nt = 0; nt < L::kWarpTiles; nt += 2) {
        // matrices (.trans): keys 0-7 then 8-15 at dimensions n and n + 8: b fragments of two n8 tiles
        const int n = (warp * L::kWarpTiles + nt) * 8 + 8 * (lane >> 4);
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vbytes + (((lane >> 3) & 1) * 8 + (lane & 7)) * kSlotRow + 2 * n);
#pragma unroll
        for (int u = 0; u < 2; ++u)
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            const uint32_t av[4] = {pa[0][p], 0u, pa[1][p], 0u}, bv[2] = {vb[2 * u], vb[2 * u + 1]};
            mma_m16n8k16<__nv_bfloat16>(oc[nt + u], av, bv);
          }
      }
    } else {
      const __nv_bfloat16* vp = reinterpret_cast<const __nv_bfloat16*>(vbytes);
#pragma unroll
      for (int h = 0; h < kHeads; ++h)
#pragma unroll
        for (int j = 0; j < kEntries; ++j) acc[h][j] *= alpha[h];
#pragma unroll 4
      for (int k = 0; k < kPage; ++k) {
        float v[kEntries];
        if constexpr (kEntries == 2) {
          const uint32_t pair = *reinterpret_cast<const uint32_t*>(vp + k * kDim + 2 * threadIdx.x);
          const __nv_bfloat16* ve = reinterpret_cast<const __nv_bfloat16*>(&pair);
          v[0] = to_float(ve[0]), v[1] = to_float(ve[1]);
        } else {
          v[0] = to_float(vp[k * kDim + threadIdx.x]);
        }
#pragma unroll
        for (int h = 0; h < kHeads; h += 2) {  // the key's weights, two heads a load
          const float2 p = *reinterpret_cast<const float2*>(scores + k * kHeads + h);
#pragma unroll
          for (int j = 0; j < kEntries; ++j) acc[h][j] += p.x * v[j], acc[h + 1][j] += p.y * v[j];
        }
      }
    }
    __syncthreads();  // every read of the page's two buffers, its scores, partial scores and rescale done
    if (threadIdx.x == 0) {
      fill(2 * i + kRing);
      fill(2 * i + 1 + kRing);
    }
  }
  // the program's partial: its outputs and its heads' statistics, then to each program r of the cluster the
  // entries r merges
  if constexpr (kMma) {
    if (g < kHeads)
#pragma unroll
      for (int nt = 0; nt < L::kWarpTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) own[g * kDim + (warp * L::kWarpTiles + nt) * 8 + 2 * t + e] = oc[nt][e];
  } else {
#pragma unroll
    for (int h = 0; h < kHeads; ++h)
#pragma unroll
      for (int j = 0; j < kEntries; ++j) own[h * kDim + kEntries * threadIdx.x + j] = acc[h][j];
  }
  if (warp < kHeads && lane == 0) stat[warp] = m, stat[kHeads + warp] = l;
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
  // this program's entries (an item one of a head's kOwned entries) merged over the cluster
  constexpr int kItems = kHeads * kOwned;
  const float* rs = recv + kHeads * kOwned;  // a sender's statistics, at p * kSlot
  const int groups = per_head / kCluster;
  float* slot = a.workspace + static_cast<size_t>(blockIdx.x) * kSlot;
  for (int it = static_cast<int>(threadIdx.x); it < kItems; it += kThreads) {
    const int h = it / kOwned, e = it % kOwned;
    float top = -INFINITY;
    for (int p = 0; p < kCluster; ++p) top = fmaxf(top, rs[p * kSlot + h]);
    float o = 0.0f, sum = 0.0f;
    for (int p = 0; p < kCluster; ++p) {
      const float w = expf(rs[p * kSlot + h] - top);
      o += w * recv[p * kSlot + h * kOwned + e];
      sum += w * rs[p * kSlot + kHeads + h];
    }
    if (groups == 1) {
      a.out[(head * kHeads + h) * kDim + rank * kOwned + e] = o / sum;
    } else {  // for the head's last cluster to arrive: this program's merged entries in the workspace
      slot[it] = o;
      if (e == 0) slot[kItems + h] = top, slot[kItems + kHeads + h] = sum;
    }
  }
  if (groups == 1) return;
  int32_t* counter = a.counters + head * kCluster + rank;
  __threadfence();  // the stores visible to the GPU before the count says so
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == groups - 1;
  __syncthreads();
  if (!*last) return;
  __threadfence();  // the other clusters' stores, counted, seen after the count
  const float* ws = a.workspace + static_cast<size_t>(head * per_head + rank) * kSlot;  // cluster g at g kCluster kSlot
  for (int it = static_cast<int>(threadIdx.x); it < kItems; it += kThreads) {
    const int h = it / kOwned, e = it % kOwned;
    float top = -INFINITY;
    for (int g = 0; g < groups; ++g)
      top = fmaxf(top, __ldcg(ws + static_cast<size_t>(g) * kCluster * kSlot + kItems + h));
    float o = 0.0f, sum = 0.0f;
    for (int g = 0; g < groups; ++g) {
      const float* s = ws + static_cast<size_t>(g) * kCluster * kSlot;
      const float w = expf(__ldcg(s + kItems + h) - top);
      o += w * __ldcg(s + it);
      sum += w * __ldcg(s + kItems + kHeads + h);
    }
    a.out[(head * kHeads + h) * kDim + rank * kOwned + e] = o / sum;
  }
  if (threadIdx.x == 0) *counter = 0;  // for the next launch (ordered by the kernel's end)
}

// `programs` programs (clusters of kCluster, programs / kv_heads a key-value head) run layer L's attention on the
// CUDA cores or (kMma) on tensor cores; cudaErrorInvalidValue for what `valid` refuses.
template <class L, bool kMma>
cudaError_t run(const Attention& a, int programs, cudaStream_t stream) {
  if (!valid(a, programs)) return cudaErrorInvalidValue;
  const size_t smem = smem_bytes<L, kMma>();
  const cudaError_t err = opt_in_smem<attention_kernel<L, kMma>>(static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  return launch_cluster<attention_kernel<L, kMma>>(dim3(static_cast<unsigned>(programs)), kCluster, kThreads, smem,
                                                   stream, a);
}

// f(L{}) with the layer of `heads` query heads of dimension `dim` on a key-value head: false for a pair no layer
// has (the binaries then refuse it).
template <class F>
bool with_layer(int heads, int dim, F&& f) {
  if (heads == E2bFull::kHeads && dim == E2bFull::kDim) return f(E2bFull{}), true;
  if (heads == Full31b::kHeads && dim == Full31b::kDim) return f(Full31b{}), true;
  if (heads == Sliding31b::kHeads && dim == Sliding31b::kDim) return f(Sliding31b{}), true;
  return false;
}

}  // namespace stream_attention
