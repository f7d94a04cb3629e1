// Two-stage centroid LM head in ONE launch: `grid` co-resident programs (a cooperative launch, at most
// one per SM) run three phases.
//   1. scores: s[t, c] = hidden[t] . centroids[c] (fp32), one warp per centroid; meanwhile the
//      token_ordering array is prefetched into L2, so that phase 2's id lookups are L2 hits.
//   -- grid-wide barrier (sense-reversing counter) --
//   2. candidates: the K = top_k * V / C candidate rows of every token are cut into items (a cluster's
//      rows, or a chunk of them when T * top_k programs would leave SMs idle). Program p owns a
//      contiguous range of items; for each token of its range it selects that token's top_k clusters
//      itself (radix select over the order bits of the C scores read from L2, then the rank of each
//      selected cluster), then computes the items' logits: each warp loads 8 candidate rows at once,
//      lanes split the hidden dimension. Sparse and dense outputs are written directly; argmax keeps
//      a running (logit, id) per program and token; topk a running list of the k best keys per warp
//      (lane r holds rank r), whose union the program ranks into its k best per token.
//   3. the last program to finish (a counter) reduces the argmax (topk) partials of every token and
//      resets the counters for the next launch.
// Cluster-major phase 2 (argmax and topk once the T * top_k (token, cluster) pairs outnumber the SMs, the
// order the Triton kernel takes there: centroid_logic.h centroid_order). Token-major, a program gathers each
// of its items' rows for one token, so a cluster that several tokens selected is gathered once per token,
// and the last program merges every token alone: 112.6 us at T = 64 on the H200 (2026-12-04) for 33 us of
// bytes. Instead, after phase 1 (which also zeroes the counts below):
//   2a. tokens over programs: each token's top_k clusters (the same radix select), its threshold (the key of
//       its top_k-th cluster: its clusters are those whose key is at least that), a member count on each.
//       -- barrier --
//   2b. the pairs in cluster order, each cluster's members in token order, in equal contiguous shares: a
//       program finds its pairs (the member counts' prefix sum says where each cluster's pairs start; a
//       cluster's members are the tokens whose key for it passes their threshold) and gives each a partial
//       slot of its token; its warps then score the pairs' items (a pair's rows, cut into `chunks` while
//       warps would idle), consecutive items at the same time: a cluster's rows come from DRAM once for all
//       the tokens that selected it. Each item writes one partial. -- barrier --
//   2c. tokens over the warps of the grid: each token's argmax / top-k from its top_k * chunks partials; the
//       last program to finish resets the counters.
// Why one launch: at E2B/E4B shapes the bytes (1 MiB of centroids, 2 MiB of candidate rows per token)
// take < 1 us at H200 bandwidth, so launches and dependent memory latencies are the cost; a program
// selecting for its own tokens replaces a second barrier (the selection is redundant across the
// programs of one token, ~0.5 us each, overlapping nothing but saving a barrier round trip).
// Nothing of size K or V is written for argmax.
#pragma once

#include <cmath>

#include "gemma4_mtp/centroid_logic.h"
#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/grid_barrier.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
#include "gemma4_mtp/params.h"

namespace gemma4_mtp {
namespace centroid {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCentroids = 4096;
constexpr int kCentroidsPerProgram = 16;  // phase 1 wants C / 16 programs
constexpr int kRowBatch = 8;              // candidate rows a warp loads before reducing any
constexpr int kScoreTokens = 32;          // tokens a warp scores per pass over a centroid row
constexpr int kMaxTopK = 16;              // topk answers per token (a warp's lanes hold its list)
// Phase 3 ranks the union of a token's program lists in Shared::cand: topk launches at most this many
// programs (no GPU has more SMs).
constexpr int kMaxTopKPrograms = kMaxCentroids / kMaxTopK;
constexpr int kPassPairs = kMaxCentroids;  // the pairs of a cluster-major pass (Shared::cand)
// Token-major argmax phase 3: partials a lane loads at once (one batch up to 160 programs; 8 made the
// E = 8 kernel spill on sm_90a)
constexpr int kPartialBatch = 5;

struct Workspace {
  float* scores;    // [T, C]
  // token-major: [T, grid], the argmax of program p's candidates of token t; cluster-major: [T, top_k, chunks],
  // of one item (the token's pair of slot s, chunk q). topk: kBadIndex if it met a bad id
  ArgMax* partial;
  uint64_t* keys;     // topk: the k best argmax_keys of each partial, descending (0: none)
  uint64_t* thr;      // cluster-major: [T], the key of the token's top_k-th cluster (its clusters: keys >= it)
  uint32_t* members;  // cluster-major: [C], how many tokens selected the cluster
  uint32_t* slots;    // cluster-major: [T], the token's pairs that took a partial slot so far
};

inline int64_t num_partials(const CentroidParams& p) {
  return p.cluster_major ? int64_t{p.T} * p.top_k * p.chunks : int64_t{p.T} * p.grid;
}

// Byte offsets of the workspace's parts and its size (workspace_bytes and carve read the one layout).
struct Layout {
  int64_t partial, keys, thr, members, slots, bytes;
};

inline Layout layout(const CentroidParams& p) {
  const int64_t n = num_partials(p);
  Layout l;
  l.partial = round_up(int64_t{4} * p.T * p.C, 16);
  l.keys = l.partial + int64_t{8} * n;
  l.thr = l.keys + (p.output == CentroidOutput::kTopK ? int64_t{8} * n * p.k : 0);
  l.members = l.thr + (p.cluster_major ? int64_t{8} * p.T : 0);
  l.slots = l.members + (p.cluster_major ? int64_t{4} * p.C : 0);
  l.bytes = l.slots + (p.cluster_major ? int64_t{4} * p.T : 0);
  return l;
}

inline int64_t workspace_bytes(const CentroidParams& p) { return layout(p).bytes; }

inline Workspace carve(const CentroidParams& p) {
  char* base = static_cast<char*>(p.workspace);
  const Layout l = layout(p);
  return Workspace{reinterpret_cast<float*>(base), reinterpret_cast<ArgMax*>(base + l.partial),
                   reinterpret_cast<uint64_t*>(base + l.keys), reinterpret_cast<uint64_t*>(base + l.thr),
                   reinterpret_cast<uint32_t*>(base + l.members), reinterpret_cast<uint32_t*>(base + l.slots)};
}

struct Shared {  // 43 KiB: within the 48 KiB a launch may use without an opt-in
  // the selected clusters' keys, in index order; topk (phase 3): the programs' lists of a token;
  // cluster-major phase 2b: the pass's pairs (pack_pair)
  uint64_t cand[kMaxCentroids];
  // topk (phase 2): warp w's best keys of the current token at [w * kMaxTopK, + k), descending (0: empty)
  uint64_t lists[kWarps * kMaxTopK];
  // rank -> cluster of the current token; cluster-major phase 2b: the pass's clusters, in order
  int16_t sel[kMaxCentroids];
  uint32_t hist[kRadixBins];     // zero outside a radix pass
  uint32_t warp_total[kWarps];
  RadixStep step;
  ArgMax best[kWarps];
  uint64_t thr;       // the key of the current token's top_k-th cluster
  int64_t first_off;  // cluster-major phase 2b: the pair index of the pass's first cluster's first member
  int first_rank;     // ... that cluster's rank among the selected clusters
  int listed;         // ... how many clusters the pass's pairs touch
  int last;
  int bad;  // topk: a warp met an out-of-range candidate id of the current token
};
static_assert(sizeof(Shared) <= 48 * 1024, "Shared must fit a launch without a shared-memory opt-in");

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Exclusive prefix sum of v over the block's threads in thread order (two barriers); *total: the sum of all.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, Shared& sh, int lane, int warp,
                                                         uint32_t* total = nullptr) {
  const uint32_t incl = warp_inclusive_scan(v, lane);
  if (lane == 31) sh.warp_total[warp] = incl;
  __syncthreads();
  uint32_t before = 0, all = 0;
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? sh.warp_total[w] : 0;
    all += sh.warp_total[w];
  }
  __syncthreads();
  if (total) *total = all;
  return before + incl - v;
}

// Inserts `key` into the warp's list of its k best keys (lane r holds rank r, descending; 0: empty,
// below every key; lanes >= k hold 0). Keys are distinct (candidate ids are).
__device__ __forceinline__ uint64_t warp_top_insert(uint64_t mine, uint64_t key, int lane, int k) {
  const int pos = __popc(__ballot_sync(0xffffffffu, mine > key));
  const uint64_t up = __shfl_up_sync(0xffffffffu, mine, 1);
  if (lane < k && lane >= pos) mine = lane == pos ? key : up;
  return mine;
}

// The rank of key among keys[0, n) (how many are larger; distinct keys, 0 for none), stopping at k.
__device__ __forceinline__ int rank_among(const uint64_t* keys, int n, uint64_t key, int k) {
  int rank = 0;
  for (int j = 0; j < n && rank < k; ++j) rank += keys[j] > key;
  return rank;
}

// Phase 1. Centroid c is scored by global warp c (mod grid * kWarps) for all tokens, 32 at a time,
// each lane a slice of the hidden dimension; one transposed warp reduction gives lane j token j's sum.
template <class T, int VEC>
__device__ void score_centroids(const CentroidParams& p, const Workspace& w, int lane, int warp) {
  const T* hid = static_cast<const T*>(p.hidden);
  for (int c = blockIdx.x * kWarps + warp; c < p.C; c += gridDim.x * kWarps) {
    const T* cen = static_cast<const T*>(p.centroids) + static_cast<int64_t>(c) * p.centroid_stride;
    if (p.T == 1) {
      float acc = 0.f;
      for (int k = lane * VEC; k < p.Hd; k += 32 * VEC) {
        float a[VEC], x[VEC];
        load_float<VEC>(cen + k, a);
        load_float<VEC>(hid + k, x);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc = fmaf(a[e], x[e], acc);
      }
      acc = warp_sum(acc);
      if (lane == 0) w.scores[c] = acc;
      continue;
    }
    for (int t0 = 0; t0 < p.T; t0 += kScoreTokens) {
      const int nt = min(kScoreTokens, p.T - t0);
      float acc[kScoreTokens];
#pragma unroll
      for (int j = 0; j < kScoreTokens; ++j) acc[j] = 0.f;
      for (int k = lane * VEC; k < p.Hd; k += 32 * VEC) {
        float a[VEC];
        load_float<VEC>(cen + k, a);
#pragma unroll
        for (int j = 0; j < kScoreTokens; ++j) {
          if (j < nt) {
            float x[VEC];
            load_float<VEC>(hid + static_cast<int64_t>(t0 + j) * p.hidden_stride + k, x);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[j] = fmaf(a[e], x[e], acc[j]);
          }
        }
      }
      const float s = warp_transpose_sum(acc, lane);
      if (lane < nt) w.scores[static_cast<int64_t>(t0 + lane) * p.C + c] = s;
    }
  }
}

// Phase 2a. The top_k clusters of token t, rank -> cluster in sh.sel. Thread i holds the order bits of
// scores E*i .. E*i + E-1 (index order = thread order, for the tie rule and the compaction).
template <int E>
__device__ void select_clusters(const CentroidParams& p, const Workspace& w, int64_t t, Shared& sh, int lane,
                                int warp) {
  __syncthreads();  // sh.sel of the previous token is no longer read
  const float* row = w.scores + t * p.C;
  const int base = threadIdx.x * E;
  // unpredicated loads (past C: the last score again, keyed 0), which ptxas issues together; guarded, each
  // waited for the previous one (4 dependent L2 loads at E2B's 2048 centroids, sm_90a SASS)
  float score[E];
#pragma unroll
  for (int e = 0; e < E; ++e) score[e] = __ldcg(row + min(base + e, p.C - 1));
  uint32_t key[E];
#pragma unroll
  for (int e = 0; e < E; ++e) key[e] = base + e < p.C ? orderable_bits(score[e]) : 0u;
  RadixState st = radix_init(static_cast<uint32_t>(p.top_k));
  for (int pass = 0; pass < kRadixPasses; ++pass) {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const bool in = base + e < p.C && radix_in_play(st, key[e]);
      const uint32_t d = radix_digit(st, key[e]);
      // lanes with the same digit add once (no same-address atomics within a warp)
      const uint32_t peers = __match_any_sync(0xffffffffu, in ? d : 0xffffffffu);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[d], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      // lane l scans digits 255 - 8l down to 248 - 8l and clears them for the next pass
      const uint32_t d0 = 255u - 8u * lane;
      uint32_t c[8], local = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        c[b] = sh.hist[d0 - b];
        sh.hist[d0 - b] = 0;
        local += c[b];
      }
      const uint32_t above = warp_inclusive_scan(local, lane) - local;
      RadixStep s;
      if (radix_find(c, 8, d0, above, st.need, &s)) sh.step = s;
    }
    __syncthreads();
    st = radix_advance(st, sh.step);
    if (st.done) break;
  }
  // keys still in play after four passes have equal scores: their order among themselves is by index
  uint32_t tie = 0;
  if (!st.done) {
    uint32_t n = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) n += base + e < p.C && key[e] == st.prefix;
    tie = block_exclusive_scan(n, sh, lane, warp);
  }
  // count, then (after the scan gives this thread's first slot) store, the selected keys in index order
  uint32_t n_chosen = 0, tie_run = tie;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const bool valid = base + e < p.C;
    n_chosen += valid && radix_selected(st, key[e], tie_run);
    tie_run += valid && !st.done && key[e] == st.prefix;
  }
  uint32_t at = block_exclusive_scan(n_chosen, sh, lane, warp);
  tie_run = tie;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const bool valid = base + e < p.C;
    if (valid && radix_selected(st, key[e], tie_run)) sh.cand[at++] = topk_key(key[e], static_cast<uint32_t>(base + e));
    tie_run += valid && !st.done && key[e] == st.prefix;
  }
  __syncthreads();
  // rank of each selected key among the top_k: how many selected keys are larger
  for (int m = warp; m < p.top_k; m += kWarps) {
    const uint64_t mine = sh.cand[m];
    uint32_t larger = 0;
    for (int x = lane; x < p.top_k; x += 32) larger += sh.cand[x] > mine;
    larger = __reduce_add_sync(0xffffffffu, larger);
    if (lane == 0) sh.sel[larger] = static_cast<int16_t>(topk_key_index(mine));
    if (lane == 0 && static_cast<int>(larger) == p.top_k - 1) sh.thr = mine;
  }
  __syncthreads();
}

// The vocabulary id of row r of a cluster's candidates (token_ordering, unchecked).
__device__ __forceinline__ int64_t candidate_id(const CentroidParams& p, int64_t cluster, int64_t r) {
  const int64_t o = cluster * (p.V / p.C) + r;
  return p.ordering_int64 ? __ldg(static_cast<const int64_t*>(p.token_ordering) + o)
                          : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(p.token_ordering) + o));
}

// The logits of a cluster's candidate rows r0 + b * step (b < kRowBatch) against hidden row h, every lane
// holding all of them: lane b holds row b's id (`mine`), then the warp loads the rows at once, lanes
// splitting the hidden dimension. ok[b]: a row below r_hi with an id in [0, V) (logit[b] is meaningless
// otherwise).
template <class T, int VEC>
__device__ __forceinline__ void row_logits(const CentroidParams& p, const T* h, int64_t mine, int r0, int step,
                                           int r_hi, int lane, int64_t (&id)[kRowBatch], bool (&ok)[kRowBatch],
                                           float (&logit)[kRowBatch]) {
  const T* lm = static_cast<const T*>(p.lm_head);
  constexpr int B = kRowBatch;
#pragma unroll
  for (int b = 0; b < B; ++b) {
    id[b] = __shfl_sync(0xffffffffu, mine, b);
    ok[b] = r0 + b * step < r_hi && id[b] >= 0 && id[b] < p.V;
  }
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.f;
  // not unrolled: the element-wise kernels (VEC 1) unrolled it and spilled at the 128 registers a 512-thread
  // program may use (sm_90a); the 16-byte kernels run it once at Hd 256
#pragma unroll 1
  for (int k = lane * VEC; k < p.Hd; k += 32 * VEC) {
    Packed<VEC, T> row[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      if (ok[b]) {
        load_packed<VEC>(lm + id[b] * p.lm_head_stride + k, row[b]);
      } else {
        zero_packed<VEC>(row[b]);
      }
    }
    float x[VEC];
    load_float<VEC>(h + k, x);
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[b] = fmaf(to_float(row[b].e[e]), x[e], acc[b]);
  }
#pragma unroll
  for (int b = 0; b < B; ++b) logit[b] = r0 + b * step < r_hi ? warp_sum(acc[b]) : 0.f;  // warp-uniform
}

// Phase 2b. Rows [r_lo, r_hi) of the cluster of rank j of token t. TOPK: p.output is kTopK (a kernel of
// its own; its lists live in shared memory between batches: in registers across the whole phase they
// made the 128-register element-wise kernels spill).
template <class T, int VEC, bool TOPK>
__device__ void score_candidates(const CentroidParams& p, int64_t t, int j, int r_lo, int r_hi, Shared& sh,
                                 ArgMax& best, int lane, int warp) {
  const int64_t cs = p.V / p.C;
  const T* h = static_cast<const T*>(p.hidden) + t * p.hidden_stride;
  constexpr int B = kRowBatch;
  for (int r0 = r_lo + warp; r0 < r_hi; r0 += kWarps * B) {
    int64_t id[B];
    bool ok[B];
    float logit[B];
    const int r_mine = r0 + lane * kWarps;
    row_logits<T, VEC>(p, h, lane < B && r_mine < r_hi ? candidate_id(p, sh.sel[j], r_mine) : -1, r0, kWarps, r_hi,
                       lane, id, ok, logit);
    uint64_t batch_key = 0;  // topk: lane b holds row b's key until the batch goes into the list
    bool bad = false;
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int r = r0 + b * kWarps;
      if (r >= r_hi) break;
      if (TOPK) {
        if (lane == b && ok[b]) batch_key = argmax_key(ArgMax{logit[b], static_cast<int>(id[b])});
        bad |= !ok[b];  // warp-uniform
      } else if (p.output == CentroidOutput::kArgmax) {
        best = candidate_merge(best, ok[b] ? ArgMax{logit[b], static_cast<int>(id[b])} : ArgMax{NAN, kBadIndex});
      } else if (lane == 0) {
        if (p.output == CentroidOutput::kSparse) {
          const int64_t at = t * p.top_k * cs + j * cs + r;
          p.ids[at] = ok[b] ? id[b] : -1;
          p.logits[at] = ok[b] ? logit[b] : NAN;
        } else if (ok[b]) {
          p.logits[t * p.V + id[b]] = logit[b];
        }
      }
    }
    if (TOPK) {
      if (bad && lane == 0) sh.bad = 1;
      uint64_t* list = sh.lists + warp * kMaxTopK;  // each lane reads and writes its own slot
      uint64_t top = lane < kMaxTopK ? list[lane] : 0;
#pragma unroll 1
      for (int b = 0; b < B; ++b) {  // not unrolled: one insert's registers at a time
        const uint64_t key = __shfl_sync(0xffffffffu, batch_key, b);
        if (key) top = warp_top_insert(top, key, lane, p.k);
      }
      if (lane < kMaxTopK) list[lane] = top;
    }
  }
}

// The program's argmax over token t's candidates it scored, into w.partial[t, program].
__device__ __forceinline__ void flush_argmax(const Workspace& w, int64_t t, ArgMax best, Shared& sh, int lane,
                                             int warp) {
  if (lane == 0) sh.best[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    ArgMax b = sh.best[0];
    for (int i = 1; i < kWarps; ++i) b = candidate_merge(b, sh.best[i]);
    w.partial[t * gridDim.x + blockIdx.x] = b;
  }
  __syncthreads();
}

// The program's k best keys of token t (the union of its warps' lists) into w.keys[t, program], and whether
// a warp met a bad id into w.partial[t, program]; then empties the lists for the next token.
__device__ __forceinline__ void flush_topk(const CentroidParams& p, const Workspace& w, int64_t t, Shared& sh) {
  uint64_t* out = w.keys + (t * gridDim.x + blockIdx.x) * p.k;
  if (static_cast<int>(threadIdx.x) < p.k) out[threadIdx.x] = 0;  // ranks no key reaches stay empty
  __syncthreads();  // every warp's list is complete
  constexpr int n = kWarps * kMaxTopK;
  const uint64_t key = threadIdx.x < n ? sh.lists[threadIdx.x] : 0;
  const int rank = key ? rank_among(sh.lists, n, key, p.k) : p.k;
  if (rank < p.k) out[rank] = key;
  if (threadIdx.x == 0) w.partial[t * gridDim.x + blockIdx.x] = ArgMax{0.f, sh.bad ? kBadIndex : 0};
  __syncthreads();  // every read of the lists is done
  if (threadIdx.x < n) sh.lists[threadIdx.x] = 0;
  if (threadIdx.x == 0) sh.bad = 0;
}

// Phase 3 of topk: token t's k best from the lists of the programs [lo, hi] that own its items.
__device__ __forceinline__ void reduce_topk(const CentroidParams& p, const Workspace& w, int64_t t, int64_t lo,
                                            int64_t hi, int64_t items, Shared& sh) {
  const int n = static_cast<int>(hi - lo + 1) * p.k;  // <= kMaxTopKPrograms * kMaxTopK = kMaxCentroids
  if (threadIdx.x == 0) sh.bad = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int64_t q = lo + i / p.k;  // programs without items wrote nothing
    const bool owns = items_begin(q, gridDim.x, items) < items_begin(q + 1, gridDim.x, items);
    sh.cand[i] = owns ? __ldcg(w.keys + (t * gridDim.x + q) * p.k + i % p.k) : 0;
    if (owns && i % p.k == 0 && __ldcg(&w.partial[t * gridDim.x + q].index) == kBadIndex) atomicOr(&sh.bad, 1);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const uint64_t key = sh.cand[i];
    const int rank = key && !sh.bad ? rank_among(sh.cand, n, key, p.k) : p.k;
    if (rank < p.k) {
      const ArgMax a = argmax_of_key(key);
      p.ids[t * p.k + rank] = a.index;
      p.logits[t * p.k + rank] = a.value;
    }
  }
  if (sh.bad && static_cast<int>(threadIdx.x) < p.k) {
    p.ids[t * p.k + threadIdx.x] = -1;
    p.logits[t * p.k + threadIdx.x] = NAN;
  }
  __syncthreads();  // sh.cand is the next token's
}

__device__ __forceinline__ ArgMax load_partial(const ArgMax* a) {
  const uint2 v = __ldcg(reinterpret_cast<const uint2*>(a));
  return ArgMax{__uint_as_float(v.x), static_cast<int>(v.y)};
}

// Token t's argmax: the merge of the warp's lanes' partial merges b, stored by lane 0 ((-1, NaN) for a bad id
// or no candidate).
__device__ __forceinline__ void store_argmax(const CentroidParams& p, int64_t t, ArgMax b, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const ArgMax other{__shfl_xor_sync(0xffffffffu, b.value, o), __shfl_xor_sync(0xffffffffu, b.index, o)};
    b = candidate_merge(b, other);
  }
  if (lane == 0) {
    const bool none = b.index == kBadIndex || b.index == kNoIndex;
    p.ids[t] = none ? -1 : b.index;
    p.logits[t] = none ? NAN : b.value;
  }
}

// Cluster-major phase 2a, tokens over programs: each token's top_k clusters, its threshold (the key of the
// top_k-th: its clusters are those whose key is at least that) and a member count on each of them.
template <int E>
__device__ void select_all(const CentroidParams& p, const Workspace& w, Shared& sh, int lane, int warp) {
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    select_clusters<E>(p, w, t, sh, lane, warp);  // sh.cand[0, top_k): the keys; the next call syncs first
    for (int i = threadIdx.x; i < p.top_k; i += kThreads) atomicAdd(w.members + topk_key_index(sh.cand[i]), 1u);
    if (threadIdx.x == 0) w.thr[t] = sh.thr;
  }
}

// A cluster-major pair in 64 bits: its token, cluster (< 4096) and the token's partial slot (< top_k <= 4096,
// its low 16 bits).
__device__ __forceinline__ uint64_t pack_pair(int64_t t, int cluster, uint32_t slot) {
  return (static_cast<uint64_t>(t) << 32) | (static_cast<uint64_t>(cluster) << 16) | slot;
}

// One cluster-major item, by one warp: rows [r_lo, r_hi) of `cluster` against token t, into partial `part`
// (argmax: the best (logit, id), or kBadIndex; topk: the k best keys, and kBadIndex in partial if it met a
// bad id). The ids come 32 rows at a time (lane l: row s0 + l, one load for four batches), so that each
// batch of 8 consecutive rows then waits for its rows only.
template <class T, int VEC, bool TOPK>
__device__ void score_item(const CentroidParams& p, const Workspace& w, int64_t t, int cluster, int r_lo, int r_hi,
                           int64_t part, int lane) {
  const T* h = static_cast<const T*>(p.hidden) + t * p.hidden_stride;
  ArgMax best = argmax_identity();
  uint64_t top = 0;  // topk: lane r holds rank r
  bool bad = false;  // warp-uniform
  int64_t held = -1;
  for (int r0 = r_lo; r0 < r_hi; r0 += kRowBatch) {
    const int s = (r0 - r_lo) & 31;  // the batch's first row among the held ids
    if (s == 0) held = r0 + lane < r_hi ? candidate_id(p, cluster, r0 + lane) : -1;
    int64_t id[kRowBatch];
    bool ok[kRowBatch];
    float logit[kRowBatch];
    row_logits<T, VEC>(p, h, __shfl_sync(0xffffffffu, held, (s + lane) & 31), r0, 1, r_hi, lane, id, ok, logit);
#pragma unroll
    for (int b = 0; b < kRowBatch; ++b) {
      if (r0 + b >= r_hi) break;
      bad |= !ok[b];
      if (!ok[b]) continue;
      const ArgMax a{logit[b], static_cast<int>(id[b])};
      if (TOPK) {
        top = warp_top_insert(top, argmax_key(a), lane, p.k);
      } else {
        best = candidate_merge(best, a);
      }
    }
  }
  if (TOPK && lane < p.k) w.keys[part * p.k + lane] = top;
  if (lane == 0) w.partial[part] = bad ? ArgMax{NAN, kBadIndex} : TOPK ? ArgMax{0.f, 0} : best;
}

// Cluster-major phase 2b. The T * top_k (token, cluster) pairs in cluster order (each cluster's members in
// token order) are dealt out in equal contiguous shares; the program takes its share in passes of at most
// kPassPairs: it lists the selected clusters the pass touches (from the member counts and their prefix
// sums), finds their members (key >= the token's threshold) and the pass's pairs among them (the members'
// prefix sum is the pair index), gives each pair a partial slot of its token (a counter per token: slots are
// distinct, their order does not matter), then its warps take the pairs' items one after another,
// consecutive items (the same cluster's rows) at the same time.
template <class T, int VEC, int E, bool TOPK>
__device__ void score_pairs(const CentroidParams& p, const Workspace& w, Shared& sh, int lane, int warp) {
  const int base = threadIdx.x * E;
  const int64_t pairs = static_cast<int64_t>(p.T) * p.top_k;  // the sum of the member counts
  const int64_t cs = p.V / p.C;
  const int64_t q_end = items_begin(blockIdx.x + 1, gridDim.x, pairs);
  for (int64_t qa = items_begin(blockIdx.x, gridDim.x, pairs); qa < q_end; qa += kPassPairs) {
    const int64_t qb = min64(q_end, qa + kPassPairs);
    // the thread's clusters' member counts, where their pairs start and their ranks among the selected
    // clusters (read again each pass: held across the items below, they made the kernel spill)
    uint32_t count[E], n_pairs = 0, n_selected = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      count[e] = base + e < p.C ? __ldcg(w.members + base + e) : 0u;
      n_pairs += count[e];
      n_selected += count[e] > 0;
    }
    const int64_t off0 = block_exclusive_scan(n_pairs, sh, lane, warp);
    const int rank0 = static_cast<int>(block_exclusive_scan(n_selected, sh, lane, warp));
    // the cluster holding pair qa, then every cluster holding a pair of [qa, qb) in sh.sel from 0
    int64_t off = off0;
    int rank = rank0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (count[e] && off <= qa && qa < off + count[e]) {
        sh.first_off = off;
        sh.first_rank = rank;
      }
      off += count[e];
      rank += count[e] > 0;
    }
    __syncthreads();
    off = off0;
    rank = rank0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (count[e] && off < qb && qa < off + count[e]) sh.sel[rank - sh.first_rank] = static_cast<int16_t>(base + e);
      if (count[e] && off < qb && qb <= off + count[e]) sh.listed = rank - sh.first_rank + 1;
      off += count[e];
      rank += count[e] > 0;
    }
    __syncthreads();
    // members, (listed cluster, token) in order; the pass's pairs into sh.cand
    const int64_t flat = static_cast<int64_t>(sh.listed) * p.T;
    int64_t before = sh.first_off;  // pair index of the chunk's first member
    for (int64_t f0 = 0; f0 < flat; f0 += kThreads) {
      const int64_t f = f0 + threadIdx.x;
      bool member = false;
      int cluster = 0;
      int64_t t = 0;
      if (f < flat) {
        cluster = sh.sel[f / p.T];
        t = f % p.T;
        const uint64_t key = topk_key(orderable_bits(__ldcg(w.scores + t * p.C + cluster)), cluster);
        member = key >= __ldcg(w.thr + t);
      }
      uint32_t members;
      const int64_t q = before + block_exclusive_scan(member, sh, lane, warp, &members);
      if (member && qa <= q && q < qb) sh.cand[q - qa] = pack_pair(t, cluster, 0);
      before += members;
    }
    __syncthreads();
    // the slots, all at once (inside the loop above, each chunk's scan would wait for the last one's atomics)
    for (int64_t i = threadIdx.x; i < qb - qa; i += kThreads)
      sh.cand[i] |= atomicAdd(w.slots + (sh.cand[i] >> 32), 1u);
    __syncthreads();
    const int64_t items = (qb - qa) * p.chunks;
    for (int64_t i = warp; i < items; i += kWarps) {
      const uint64_t pair = sh.cand[i / p.chunks];
      const int q = static_cast<int>(i % p.chunks);
      const int64_t t = static_cast<int64_t>(pair >> 32);
      const int r_lo = q * p.rows;
      score_item<T, VEC, TOPK>(p, w, t, static_cast<int>((pair >> 16) & 0xffffu), r_lo,
                               static_cast<int>(min64(cs, r_lo + p.rows)),
                               (t * p.top_k + static_cast<int64_t>(pair & 0xffffu)) * p.chunks + q, lane);
    }
    __syncthreads();  // sh.sel, sh.cand and the pass's scalars are the next pass's
  }
}

// Cluster-major phase 2c, tokens over the warps of the grid: token t's answer from its top_k * chunks
// partials. topk: the warp's list (lane r holds rank r) takes the partials' keys 32 at a time, inserting
// those above its k-th (all while it has fewer than k).
template <bool TOPK>
__device__ void merge_pairs(const CentroidParams& p, const Workspace& w, int lane, int warp) {
  const int64_t n = static_cast<int64_t>(p.top_k) * p.chunks;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.T; t += warps) {
    const ArgMax* part = w.partial + t * n;
    if (TOPK) {
      bool bad = false;
      for (int64_t i = lane; i < n; i += 32) bad |= __ldcg(&part[i].index) == kBadIndex;
      bad = __ballot_sync(0xffffffffu, bad) != 0;
      const uint64_t* keys = w.keys + t * n * p.k;
      uint64_t top = 0;
      for (int64_t j0 = 0; j0 < n * p.k && !bad; j0 += 32) {
        const uint64_t key = j0 + lane < n * p.k ? __ldcg(keys + j0 + lane) : 0;
        const uint64_t kth = __shfl_sync(0xffffffffu, top, p.k - 1);
        for (uint32_t pending = __ballot_sync(0xffffffffu, key > kth); pending; pending &= pending - 1)
          top = warp_top_insert(top, __shfl_sync(0xffffffffu, key, __ffs(pending) - 1), lane, p.k);
      }
      if (lane < p.k) {
        const ArgMax a = argmax_of_key(top);
        const bool none = bad || top == 0;
        p.ids[t * p.k + lane] = none ? -1 : a.index;
        p.logits[t * p.k + lane] = none ? NAN : a.value;
      }
    } else {
      ArgMax b = argmax_identity();
      for (int64_t i = lane; i < n; i += 32) b = candidate_merge(b, load_partial(part + i));
      store_argmax(p, t, b, lane);
    }
  }
}

template <class T, int VEC, int E, bool TOPK>
__global__ void __launch_bounds__(kThreads, 1) head_kernel(CentroidParams p, Workspace w) {
  // dynamic shared memory (43 KiB, no opt-in): the CPU emulation, which runs a cooperative launch's
  // programs at once, gives each its own block of it (a static __shared__ is one object there)
  Shared& sh = *reinterpret_cast<Shared*>(dynamic_smem());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kRadixBins; i += kThreads) sh.hist[i] = 0;
  if (TOPK) {  // empty lists (flush_topk empties them after each token)
    for (int i = threadIdx.x; i < kWarps * kMaxTopK; i += kThreads) sh.lists[i] = 0;
    if (threadIdx.x == 0) sh.bad = 0;
  }

  // Phase 1 (+ the L2 prefetch of token_ordering: its lines are 128 bytes)
  const int64_t order_bytes = p.V * (p.ordering_int64 ? 8 : 4);
  for (int64_t off = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * 128; off < order_bytes;
       off += static_cast<int64_t>(gridDim.x) * kThreads * 128)
    prefetch_l2(static_cast<const char*>(p.token_ordering) + off);
  score_centroids<T, VEC>(p, w, lane, warp);
  if (p.output == CentroidOutput::kDense && p.fill_dense) {  // before the barrier that precedes phase 2's writes
    const int64_t n = static_cast<int64_t>(p.T) * p.V;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
      p.logits[i] = -INFINITY;
  }
  if (p.cluster_major) {  // the member counts and the token slots start at zero
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < p.C + p.T;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
      (i < p.C ? w.members[i] : w.slots[i - p.C]) = 0;
  }
  grid_barrier(p.counters);

  const int64_t per_token = static_cast<int64_t>(p.top_k) * p.chunks;
  const int64_t items = p.T * per_token;
  if (p.cluster_major) {
    select_all<E>(p, w, sh, lane, warp);
    grid_barrier(p.counters);
    score_pairs<T, VEC, E, TOPK>(p, w, sh, lane, warp);
    grid_barrier(p.counters);
    merge_pairs<TOPK>(p, w, lane, warp);
  } else {  // Phase 2
    const int64_t cs = p.V / p.C;
    const int64_t i1 = items_begin(blockIdx.x + 1, gridDim.x, items);
    int64_t current = -1;
    ArgMax best = argmax_identity();
    const auto flush = [&](int64_t t) {
      if (TOPK) {
        flush_topk(p, w, t, sh);
      } else if (p.output == CentroidOutput::kArgmax) {
        flush_argmax(w, t, best, sh, lane, warp);
      }
    };
    for (int64_t i = items_begin(blockIdx.x, gridDim.x, items); i < i1; ++i) {
      const int64_t t = i / per_token;
      const int j = static_cast<int>((i % per_token) / p.chunks);
      const int q = static_cast<int>(i % p.chunks);
      if (t != current) {
        if (current >= 0) flush(current);
        best = argmax_identity();
        select_clusters<E>(p, w, t, sh, lane, warp);
        current = t;
      }
      const int r_lo = q * p.rows;
      score_candidates<T, VEC, TOPK>(p, t, j, r_lo, static_cast<int>(min64(cs, r_lo + p.rows)), sh, best, lane,
                                     warp);
    }
    if (current >= 0) flush(current);
  }

  // Phase 3: the last program to get here has every partial, and every program is past every barrier;
  // token-major, it merges the partials of every token (cluster-major 2c merged them already)
  if (!last_to_arrive(p.counters + 1, static_cast<int>(gridDim.x), &sh.last)) return;
  if (!p.cluster_major && !TOPK && p.output == CentroidOutput::kArgmax) {
    for (int64_t t = warp; t < p.T; t += kWarps) {
      const int64_t lo = program_of_item(t * per_token, gridDim.x, items);
      const int64_t hi = program_of_item((t + 1) * per_token - 1, gridDim.x, items);
      ArgMax b = argmax_identity();
      // kPartialBatch partials a lane loads before merging any (merged as they came, each load waited for
      // the previous merge: ~5 dependent loads a lane over 132 programs, sm_90a SASS); a program without
      // items wrote no partial, and a slot past hi loads hi's again: neither is merged
      for (int64_t q0 = lo + lane; q0 <= hi; q0 += 32 * kPartialBatch) {
        ArgMax got[kPartialBatch];
#pragma unroll
        for (int j = 0; j < kPartialBatch; ++j) got[j] = load_partial(w.partial + t * gridDim.x + min(q0 + 32 * j, hi));
#pragma unroll
        for (int j = 0; j < kPartialBatch; ++j) {
          const int64_t q = q0 + 32 * j;
          if (q <= hi && items_begin(q, gridDim.x, items) < items_begin(q + 1, gridDim.x, items))
            b = candidate_merge(b, got[j]);
        }
      }
      store_argmax(p, t, b, lane);
    }
  }
  if (!p.cluster_major && TOPK) {
    for (int64_t t = 0; t < p.T; ++t)
      reduce_topk(p, w, t, program_of_item(t * per_token, gridDim.x, items),
                  program_of_item((t + 1) * per_token - 1, gridDim.x, items), items, sh);
  }
  if (threadIdx.x == 0) {
    p.counters[0] = 0;
    p.counters[1] = 0;
  }
}

template <class T, int VEC, int E>
cudaError_t launch(const CentroidParams& p, cudaStream_t stream) {
  const auto kernel = p.output == CentroidOutput::kTopK ? head_kernel<T, VEC, E, true> : head_kernel<T, VEC, E, false>;
  return launch_cooperative(kernel, dim3(static_cast<unsigned>(p.grid)), kThreads, sizeof(Shared), stream, p, carve(p));
}

template <class T, int VEC>
cudaError_t launch_keys(const CentroidParams& p, cudaStream_t stream) {
  if (p.C <= 2 * kThreads) return launch<T, VEC, 2>(p, stream);
  if (p.C <= 4 * kThreads) return launch<T, VEC, 4>(p, stream);
  return launch<T, VEC, 8>(p, stream);
}

}  // namespace centroid

// Fills p.grid, p.chunks and p.rows for a device with num_sms SMs; returns the workspace bytes.
inline int64_t centroid_prepare(CentroidParams& p, int num_sms) {
  const bool topk = p.output == CentroidOutput::kTopK;
  const CentroidOrder order =
      centroid_order(p.order, p.T, p.top_k, num_sms, topk || p.output == CentroidOutput::kArgmax);
  // token-major topk: phase 3 ranks a token's program lists together in shared memory (at most
  // kMaxTopKPrograms)
  const int sms = order == CentroidOrder::kTokens && topk && num_sms > centroid::kMaxTopKPrograms
                      ? centroid::kMaxTopKPrograms
                      : num_sms;
  const CentroidPlan plan = centroid_plan(p.T, p.top_k, p.C > 0 ? p.V / p.C : 1, p.C, sms,
                                          centroid::kCentroidsPerProgram, order, centroid::kWarps);
  p.grid = plan.grid;
  p.chunks = plan.chunks;
  p.rows = plan.rows;
  p.cluster_major = plan.cluster_major;
  return centroid::workspace_bytes(p);
}

// Launches the centroid head for element type T (float, __half, __nv_bfloat16). Requires
// 1 <= top_k <= C <= 4096, V a nonzero multiple of C, for topk 1 <= k <= min(top_k * V / C, 16),
// centroid_prepare(p) and its workspace (16-byte aligned), and p.counters zero before the first launch
// (every launch leaves them zero). Launches that overlap in time must not share counters.
template <class T>
cudaError_t centroid_logits(const CentroidParams& p, cudaStream_t stream) {
  if (p.T <= 0) return cudaSuccess;
  if (p.C < 1 || p.C > centroid::kMaxCentroids || p.top_k < 1 || p.top_k > p.C || p.V < p.C || p.V % p.C ||
      p.Hd < 0 || p.workspace == nullptr || p.counters == nullptr || p.grid < 1 || p.chunks < 1 || p.rows < 1 ||
      static_cast<int64_t>(p.chunks) * p.rows < p.V / p.C)
    return cudaErrorInvalidValue;
  if (p.output == CentroidOutput::kTopK &&
      (p.k < 1 || p.k > centroid::kMaxTopK || p.k > static_cast<int64_t>(p.top_k) * (p.V / p.C) ||
       (!p.cluster_major && p.grid > centroid::kMaxTopKPrograms)))
    return cudaErrorInvalidValue;
  if (p.cluster_major && p.output != CentroidOutput::kArgmax && p.output != CentroidOutput::kTopK)
    return cudaErrorInvalidValue;
  if (!host_aligned16(p.workspace)) return cudaErrorMisalignedAddress;  // the partials are read 8 bytes at a time
  // 16-byte loads of hidden, centroids and lm_head rows need aligned pointers and row strides; fp32 (a
  // test dtype) reads element-wise: its 16-byte variant needs more than the 128 registers a 512-thread
  // program may use on sm_80
  constexpr int V = kVec16<T>;
  const bool vec = sizeof(T) == 2 && p.Hd % V == 0 && p.hidden_stride % V == 0 && p.centroid_stride % V == 0 &&
                   p.lm_head_stride % V == 0 && host_aligned16(p.hidden) && host_aligned16(p.centroids) &&
                   host_aligned16(p.lm_head);
  if constexpr (sizeof(T) == 2) {
    if (vec) return centroid::launch_keys<T, V>(p, stream);
  }
  return centroid::launch_keys<T, 1>(p, stream);
}

}  // namespace gemma4_mtp
