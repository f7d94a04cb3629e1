// tree_verify in one launch (SPEC §4.4).
//
// Work. Each node's row of V logits is cut into chunks (one CTA each) and each chunk into 8 granules
// (one warp each, contiguous ids, coalesced 16-byte loads, batches of 4 loads per lane).
// Phase A: every warp publishes its granule's statistics (greedy rows: first argmax; sampling rows:
// max and sum of exp of logits / temperature); no block-wide reduction. The last CTA of a row (a
// per-row counter) merges the granules and decides the row: the target's token t and the child the
// walk continues to (lowest-index child holding t; with draft probabilities the chain child when
// u0 < p(x) / q(x)). Sampling locates the inverse-CDF crossing granule from the granule masses and
// rescans only that granule (<= 4096 ids, one or two passes of the block). The last row of a request to be
// decided (a per-request counter) walks that request's decisions and writes its outputs, so requests
// finish independently.
//
// Draft probabilities. A rejected chain node draws from normalize(max(p - q, 0)), whose mass is only
// known after a second pass over the row's logits and q, which needs the row's softmax maximum and
// normaliser from phase A. Phase B does that pass in parallel: a draft launch has twice the CTAs and
// hands out work items in order from a ticket counter (all phase A items, then one phase B item per
// row chunk); a phase B CTA waits (spinning on the row's state word) for its row's decision, then
// sums the residual of its chunk per granule; the row's last phase B CTA locates the crossing granule
// and rescans it. Waiting is deadlock free because a CTA only waits for items with lower tickets,
// whose CTAs already run and never wait for higher ones (the single-pass scan argument). Rows that
// need no residual (accepted, leaves, greedy, padding) are final after phase A and their phase B CTAs
// only count.
//
// Counters. Row counters (A and B), row states, request counters and the ticket live in a
// caller-owned int32 buffer that must be zero before the first launch; every counter is reset by the
// CTA that consumes it last, so launches need no memset and replay in CUDA graphs. Two launches
// sharing the buffer must not overlap in time.
//
// Cost (bf16, V = 262144): phase A reads B * N * V * 2 bytes once; phase B reads the q of rejected
// rows once and their logits a second time (mostly from L2: the row was read microseconds before). Padding rows are
// read like the others: gating a CTA's loads on parents[u] would put a dependent DRAM round trip in
// front of every load. No fast-math: sampling decisions must match the reference's rules.
#pragma once

#include <cuda/atomic>

#include <cmath>
#include <type_traits>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/tree_logic.h"

namespace gemma4_mtp {
namespace tree {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Vectors per lane per batch, and batches per chunk. Little's law: streaming at ~4.8 TB/s with
// ~600 ns of DRAM latency needs ~2.9 MB in flight, ~22 KB per SM; a warp keeps a batch (4 x 16 B per
// lane, 2 KB) in flight, a CTA 16 KB, an SM 80 / 48 / 32 KB (5 / 3 / 2 CTAs, see kMinCtasPerSm).
constexpr int kLoads = 4;
constexpr int kMaxTiles = 4;
constexpr int kItems = 8;  // inverse-CDF passes: contiguous ids per thread (a granule of 1024-4096 ids: 1-2 passes)
constexpr int kWindow = kThreads;  // walk: decisions staged in shared memory

template <int VEC>
constexpr int64_t kTile = int64_t{kThreads} * VEC * kLoads;  // ids a CTA loads in one batch

// Row states of draft-probability launches.
constexpr int kPending = 0;   // phase A has not decided the row
constexpr int kFinal = 1;     // decided
constexpr int kResidual = 2;  // rejected: the bonus comes from the residual (phase B)

union GranuleStat {  // a greedy row's or a sampling row's granule
  ArgMax am;
  MaxSum ms;
};

struct Decision {
  int tok;   // the target's token at the node (the bonus if the walk stops there), kNoToken: none
  int next;  // the accepted child, kNoNode: stop
  float m;   // sampling rows: softmax maximum and normaliser of logits / temperature
  float z;
};

struct Counters {
  int* row_a;        // [rows] phase A CTAs done
  int* row_b;        // [rows] phase B CTAs done
  int* state;        // [rows] kPending / kFinal / kResidual
  int* request;      // [B] rows final
  unsigned* ticket;  // work items handed out (draft launches)
};

inline int64_t counter_ints(int64_t rows, int64_t B) { return 3 * rows + B + 1; }

inline Counters carve_counters(int* base, int64_t rows, int64_t B) {
  return {base, base + rows, base + 2 * rows, base + 3 * rows, reinterpret_cast<unsigned*>(base + 3 * rows + B)};
}

struct Scratch {
  Decision* dec;       // [rows]
  GranuleStat* stats;  // [rows, granules]
  float* residual;     // [rows, granules], draft launches
};

inline int64_t scratch_bytes(int64_t rows, int64_t granules, bool draft) {
  return 16 * rows + 8 * rows * granules + (draft ? 4 * rows * granules : 0);
}

inline Scratch carve_scratch(void* ws, int64_t rows, int64_t granules) {
  char* base = static_cast<char*>(ws);
  Scratch s;
  s.dec = reinterpret_cast<Decision*>(base);
  s.stats = reinterpret_cast<GranuleStat*>(base + 16 * rows);
  s.residual = reinterpret_cast<float*>(base + 16 * rows + 8 * rows * granules);
  return s;
}

struct Shared {
  ArgMax am[kWarps];
  MaxSum ms[kWarps];
  double dsum[kWarps];
  int imin[kWarps];
  double before;
  int flag;
  int item;
  int state;
  int tok[kWindow];
  int next[kWindow];
};

// ---------------------------------------------------------------- loads

// VEC consecutive elements of T as raw 16-byte words (VEC == 1: one scalar).
template <class T, int VEC>
struct Raw {
  static_assert(VEC * sizeof(T) % 16 == 0, "vector loads are whole 16-byte words");
  uint4 w[VEC * sizeof(T) / 16];
};
template <class T>
struct Raw<T, 1> {
  T w;
};

template <class T, int VEC>
__device__ __forceinline__ void load_raw(const T* p, Raw<T, VEC>& r) {
  if constexpr (VEC == 1) {
    r.w = *p;
  } else {
#pragma unroll
    for (int k = 0; k < int(sizeof(r.w) / 16); ++k) r.w[k] = reinterpret_cast<const uint4*>(p)[k];
  }
}

template <class T, int VEC>
__device__ __forceinline__ void raw_floats(const Raw<T, VEC>& r, float* out) {
  if constexpr (VEC == 1) {
    out[0] = to_float(r.w);
  } else {
    union {
      uint4 w[VEC * sizeof(T) / 16];
      T e[VEC];
    } v;
#pragma unroll
    for (int k = 0; k < int(sizeof(v.w) / 16); ++k) v.w[k] = r.w[k];
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = to_float(v.e[e]);
  }
}

template <class T>
__device__ __forceinline__ float load1(const T* p) {
  return to_float(*p);
}

// ---------------------------------------------------------------- reductions

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    a = argmax_merge(a, ArgMax{__shfl_xor_sync(0xffffffffu, a.value, o), __shfl_xor_sync(0xffffffffu, a.index, o)});
  return a;
}

__device__ __forceinline__ MaxSum warp_maxsum(MaxSum a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    a = maxsum_merge(a, MaxSum{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)});
  return a;
}

__device__ __forceinline__ ArgMax block_argmax(ArgMax a, Shared& sh) {
  a = warp_argmax(a);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.am[threadIdx.x >> 5] = a;
  __syncthreads();
  ArgMax r = sh.am[0];
  for (int i = 1; i < kWarps; ++i) r = argmax_merge(r, sh.am[i]);
  return r;
}

__device__ __forceinline__ MaxSum block_maxsum(MaxSum a, Shared& sh) {
  a = warp_maxsum(a);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.ms[threadIdx.x >> 5] = a;
  __syncthreads();
  MaxSum r = sh.ms[0];
  for (int i = 1; i < kWarps; ++i) r = maxsum_merge(r, sh.ms[i]);
  return r;
}

__device__ __forceinline__ double block_sum(double x, Shared& sh) {
  x = warp_sum(x);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.dsum[threadIdx.x >> 5] = x;
  __syncthreads();
  double r = 0.0;
  for (int i = 0; i < kWarps; ++i) r += sh.dsum[i];
  return r;
}

// min (want_min) or max over the block.
__device__ __forceinline__ int block_extreme(int x, bool want_min, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const int y = __shfl_xor_sync(0xffffffffu, x, o);
    x = want_min ? min(x, y) : max(x, y);
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.imin[threadIdx.x >> 5] = x;
  __syncthreads();
  int r = sh.imin[0];
  for (int i = 1; i < kWarps; ++i) r = want_min ? min(r, sh.imin[i]) : max(r, sh.imin[i]);
  return r;
}

// Exclusive prefix sum of one double per thread; *total gets the block's sum.
__device__ __forceinline__ double block_exclusive_scan(double x, Shared& sh, double* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();
  if (lane == 31) sh.dsum[warp] = inc;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int i = 0; i < kWarps; ++i) {
    if (i < warp) before += sh.dsum[i];
    all += sh.dsum[i];
  }
  *total = all;
  return before + inc - x;
}

struct Crossing {
  int index;      // -1: no weight at all
  bool crossed;   // false: the cumulative weight never exceeded the target; index is the last id with weight
  double before;  // cumulative weight before index (crossed only)
};

// The reference's inverse CDF over [begin, end) starting at cumulative weight `carry`: the first
// index whose cumulative weight (summed in double) exceeds target, else the last index with nonzero
// weight. load(i) reads what index i's fp32 weight is computed from (a float2), weight(v) computes
// it: all of a thread's loads are issued before any weight (with the load and the computation in one
// conditional call, ptxas issued one L2 round trip after another). Tiles of kThreads x kItems are
// scanned in order (one or two for a granule); within a tile each thread owns kItems consecutive
// indices.
template <class L, class W>
__device__ Crossing block_inverse_cdf(L load, W weight, int begin, int end, double carry, double target, Shared& sh) {
  constexpr int kTileIds = kThreads * kItems;
  int last_pos = -1;
  for (int base = begin; base < end; base += kTileIds) {
    const int i0 = base + threadIdx.x * kItems;
    float2 v[kItems];
#pragma unroll
    for (int e = 0; e < kItems; ++e) v[e] = i0 + e < end ? load(i0 + e) : float2{0.f, 0.f};
    float w[kItems];
    double tsum = 0.0;
#pragma unroll
    for (int e = 0; e < kItems; ++e) {
      const int i = i0 + e;
      w[e] = i < end ? weight(v[e]) : 0.f;
      tsum += static_cast<double>(w[e]);
      if (w[e] > 0.f) last_pos = i;
    }
    double total, before = 0.0;
    const double excl = block_exclusive_scan(tsum, sh, &total);
    const int local = first_crossing(w, kItems, carry + excl, target, &before);
    const int mine = local == kNoIndex ? kNoIndex : i0 + local;
    const int found = block_extreme(mine, true, sh);
    if (found != kNoIndex) {
      if (mine == found) sh.before = before;
      __syncthreads();
      return {found, true, sh.before};
    }
    carry += total;
  }
  return {block_extreme(last_pos, false, sh), false, 0.0};
}

// ---------------------------------------------------------------- counters

// Called by every thread after its stores: whether this CTA is the total-th to arrive at *counter
// (which it then resets). Release: the barrier orders every thread's stores before thread 0's
// acq_rel increment (cumulativity, as in cooperative groups' grid sync). Acquire: the increment that
// reads total - 1 reads the end of a chain of increments containing every other CTA's release, and
// the barrier passes that on to the other threads, whose later plain loads of the published values
// are then ordered after it (no data race). In sm_90a SASS an acq_rel RMW is MEMBAR.ALL.GPU, the
// atomic, then CCTL.IVALL, which invalidates the SM's L1, so those loads go to L2 (and, being plain
// rather than .cg, which ptxas emits as strong loads it does not batch, they are issued together).
// MEMBAR.ALL.GPU is cheaper than the MEMBAR.SC.GPU of __threadfence(). The reset is relaxed: every
// other increment of this launch came before it, and the next launch starts after this one ends.
__device__ __forceinline__ bool block_arrive_last(int* counter, int total, Shared& sh) {
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<int, cuda::thread_scope_device> c(*counter);
    const bool last = c.fetch_add(1, cuda::memory_order_acq_rel) == total - 1;
    if (last) c.store(0, cuda::memory_order_relaxed);
    sh.flag = last;
  }
  __syncthreads();
  return sh.flag;
}

__device__ __forceinline__ void publish_state(int* state, int value) {
  cuda::atomic_ref<int, cuda::thread_scope_device>(*state).store(value, cuda::memory_order_release);
}

// Thread 0 spins until phase A decided the row (acquire loads, each followed by CCTL.IVALL in SASS,
// pairing with publish_state's release); the barrier hands the state, and the ordering, to every thread.
__device__ __forceinline__ int wait_state(int* state, Shared& sh) {
  if (threadIdx.x == 0) {
    cuda::atomic_ref<int, cuda::thread_scope_device> ref(*state);
    int s;
    while ((s = ref.load(cuda::memory_order_acquire)) == kPending) __nanosleep(100);
    sh.state = s;
  }
  __syncthreads();
  return sh.state;
}

// ---------------------------------------------------------------- one launch

// The launch's kind, the kernel's second template parameter: GreedyOnly (no temperatures), void
// (greedy and sampling rows, no draft probabilities), or the element type of draft_probs. Greedy-only
// launches compile without the sampling code (fewer registers, more CTAs per SM).
struct GreedyOnly {};

template <class Q>
constexpr bool kSamples = !std::is_same_v<Q, GreedyOnly>;
template <class Q>
constexpr bool kDrafts = kSamples<Q> && !std::is_void_v<Q>;

// One CTA's row: its node, pointers and the candidate children it prefetched.
template <class T, class Q>
struct Row {
  using QElem = std::conditional_t<kDrafts<Q>, Q, float>;
  TreeVerifyParams p;
  Counters cnt;
  Scratch s;
  int row, b, u;
  float temp;  // > 0: a sampling row
  // this thread's candidate child u + 1 + threadIdx.x, loaded at the start (off the critical path)
  int cand_parent;
  int64_t cand_draft;

  // Row pointers are recomputed from the parameters where used rather than kept in registers
  // across the streaming loops (the draft kernels spilled at 80 registers otherwise).
  __device__ const T* logits() const {
    return static_cast<const T*>(p.logits) + b * p.logits_stride[0] + u * p.logits_stride[1];
  }
  __device__ const QElem* q() const {
    return static_cast<const QElem*>(p.draft_probs) + b * p.draft_probs_stride[0] + u * p.draft_probs_stride[1];
  }
  __device__ GranuleStat* stats() const { return s.stats + static_cast<int64_t>(row) * p.granules; }
  __device__ float* residual() const { return s.residual + static_cast<int64_t>(row) * p.granules; }

  __device__ int64_t draft_token(int c) const {
    const int64_t i = static_cast<int64_t>(b) * p.N + c;
    return p.draft_int64 ? static_cast<const int64_t*>(p.draft_tokens)[i]
                         : static_cast<int64_t>(static_cast<const int32_t*>(p.draft_tokens)[i]);
  }
  __device__ void load_candidate(int c) {
    cand_parent = c < p.N ? p.parents[static_cast<int64_t>(b) * p.N + c] : -2;
    cand_draft = c < p.N ? draft_token(c) : -1;
  }
  // The lowest child c of u with accepts(parent_c, draft_c), kNoNode if none (each thread tests
  // every kThreads-th node, in ascending order).
  template <class F>
  __device__ int find_child(F accepts, Shared& sh) {
    int best = kNoIndex;
    int c = u + 1 + threadIdx.x;
    int par = cand_parent;
    int64_t dr = cand_draft;
    while (c < p.N) {
      if (accepts(par, dr)) {
        best = c;
        break;
      }
      c += kThreads;
      if (c < p.N) {
        par = p.parents[static_cast<int64_t>(b) * p.N + c];
        dr = draft_token(c);
      }
    }
    best = block_extreme(best, true, sh);
    return best == kNoIndex ? kNoNode : best;
  }
  // p of a logit x (the same operations as phase B's residual pass)
  __device__ float prob(float x, float m, float z) const { return expf(x / temp - m) / z; }
};

// Phase A, one warp: statistics of ids [g0, g1) of the row.
template <class T, int VEC, bool SAMPLES>
__device__ __forceinline__ GranuleStat granule_stats(const T* logits, int64_t g0, int64_t g1, float temp) {
  const int lane = threadIdx.x & 31;
  constexpr int64_t kStep = 32 * VEC, kBatch = kStep * kLoads;
  const bool sampling = SAMPLES && temp > 0.f;
  ArgMax am = argmax_identity();
  MaxSum ms = maxsum_identity();
  Raw<T, VEC> cur[kLoads];
  // One batch of kLoads independent 16-byte loads per lane, then its consumption: a second buffer
  // (loads of the next batch in flight while consuming) needs 16 more registers, which costs a CTA
  // per SM (more warps with one batch each hide the latency as well, and the extra CTA overlaps the
  // others' counter tails).
  auto load = [&](Raw<T, VEC>(&r)[kLoads], int64_t base) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t i = base + l * kStep + lane * VEC;
      if (i < g1) load_raw<T, VEC>(logits + i, r[l]);
    }
  };
  // Each lane visits its ids in ascending order (argmax_push relies on it). Sampling adds one vector
  // at a time (one exp more per vector than per batch, but 3 x VEC fewer live registers).
  auto consume = [&](const Raw<T, VEC>(&r)[kLoads], int64_t base) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t i = base + l * kStep + lane * VEC;
      if (i < g1) {
        float y[VEC];
        raw_floats<T, VEC>(r[l], y);
        if (sampling) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) y[e] /= temp;
          ms = maxsum_add(ms, y, VEC);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) am = argmax_push(am, y[e], static_cast<int>(i + e));
        }
      }
    }
  };
  for (int64_t base = g0; base < g1; base += kBatch) {
    load(cur, base);
    consume(cur, base);
  }
  GranuleStat st;
  if (sampling) {
    st.ms = warp_maxsum(ms);
  } else {
    st.am = warp_argmax(am);
  }
  return st;
}

// Phase B, one warp: sum of max(p - q, 0) over ids [g0, g1) of the row. Batches of half as many
// logit vectors, each with its q vector(s): the same bytes in flight per lane as phase A for bf16 q.
template <class T, class Q, int VEC>
__device__ __forceinline__ float granule_residual(const Row<T, Q>& r, int64_t g0, int64_t g1, float m, float z) {
  const int lane = threadIdx.x & 31;
  constexpr int64_t kStep = 32 * VEC;
  constexpr int kPairs = kLoads / 2;
  const T* logits = r.logits();
  const Q* q = r.q();
  float acc = 0.f;
  for (int64_t base = g0; base < g1; base += kStep * kPairs) {
    Raw<T, VEC> x[kPairs];
    Raw<Q, VEC> qv[kPairs];
#pragma unroll
    for (int l = 0; l < kPairs; ++l) {
      const int64_t i = base + l * kStep + lane * VEC;
      if (i < g1) {
        load_raw<T, VEC>(logits + i, x[l]);
        load_raw<Q, VEC>(q + i, qv[l]);
      }
    }
#pragma unroll
    for (int l = 0; l < kPairs; ++l) {
      const int64_t i = base + l * kStep + lane * VEC;
      if (i < g1) {
        float xf[VEC], qf[VEC];
        raw_floats<T, VEC>(x[l], xf);
        raw_floats<Q, VEC>(qv[l], qf);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc += fmaxf(r.prob(xf[e], m, z) - qf[e], 0.f);
      }
    }
  }
  return warp_sum(acc);
}

// Inverse CDF of p (temperature-scaled softmax with maximum m and normaliser z) with uniform uni:
// the crossing granule from the granule masses, then the crossing id inside it.
template <class T, class Q>
__device__ int sample_p(const Row<T, Q>& r, float m, float z, double uni, Shared& sh) {
  const GranuleStat* stats = r.stats();
  const Crossing g = block_inverse_cdf(
      [&](int k) {
        const MaxSum st = stats[k].ms;
        return float2{st.m, st.s};
      },
      [&](float2 st) { return st.y > 0.f ? st.y * expf(st.x - m) / z : 0.f; }, 0, r.p.granules, 0.0, uni, sh);
  if (g.index < 0) return kNoToken;
  const int64_t lo = static_cast<int64_t>(g.index) * r.p.granule;
  const int hi = static_cast<int>(min64(r.p.V, lo + r.p.granule));
  // no crossing among the granules (rounding left the total at or below uni): the last id with mass
  const double target = g.crossed ? uni : INFINITY;
  const T* logits = r.logits();
  const Crossing t = block_inverse_cdf([&](int i) { return float2{load1(logits + i), 0.f}; },
                                       [&](float2 v) { return r.prob(v.x, m, z); }, static_cast<int>(lo), hi,
                                       g.before, target, sh);
  return t.index;
}

// The same for the residual max(p - q, 0), whose granule sums phase B left in r.residual().
template <class T, class Q>
__device__ int sample_residual(const Row<T, Q>& r, float m, float z, float total, double uni, Shared& sh) {
  const float* res = r.residual();
  const Crossing g = block_inverse_cdf([&](int k) { return float2{res[k], 0.f}; },
                                       [&](float2 v) { return v.x / total; }, 0, r.p.granules, 0.0, uni, sh);
  if (g.index < 0) return kNoToken;
  const int64_t lo = static_cast<int64_t>(g.index) * r.p.granule;
  const int hi = static_cast<int>(min64(r.p.V, lo + r.p.granule));
  const double target = g.crossed ? uni : INFINITY;
  const T* logits = r.logits();
  const Q* q = r.q();
  const Crossing t = block_inverse_cdf([&](int i) { return float2{load1(logits + i), load1(q + i)}; },
                                       [&](float2 v) { return fmaxf(r.prob(v.x, m, z) - v.y, 0.f) / total; },
                                       static_cast<int>(lo), hi, g.before, target, sh);
  return t.index;
}

// The last CTA of a request's rows walks its decisions.
__device__ void walk(const TreeVerifyParams& p, const Decision* dec, int b, Shared& sh) {
  const int N = p.N;
  const Decision* d = dec + static_cast<int64_t>(b) * N;
  for (int i = threadIdx.x; i < N && i < kWindow; i += kThreads) {
    sh.tok[i] = d[i].tok;
    sh.next[i] = d[i].next;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    auto node = [&](int u, int64_t* tok, int* next) {
      *tok = u < kWindow ? sh.tok[u] : d[u].tok;
      *next = u < kWindow ? sh.next[u] : d[u].next;
    };
    const int64_t off = static_cast<int64_t>(b) * N;
    p.accept_len[b] = follow_path(node, N, p.accepted_nodes + off, p.output_tokens + off, p.last_node + b);
  }
}

// Publishes a final decision of the row and, if it is the request's last, walks the request.
template <class T, class Q>
__device__ void finish_row(const Row<T, Q>& r, int tok, int next, Shared& sh) {
  if (threadIdx.x == 0) {
    r.s.dec[r.row].tok = tok;
    r.s.dec[r.row].next = next;
  }
  if (block_arrive_last(&r.cnt.request[r.b], r.p.N, sh)) walk(r.p, r.s.dec, r.b, sh);
}

// The row's decision from its granule statistics, by its last phase A CTA.
template <class T, class Q>
__device__ void decide(Row<T, Q>& r, bool used, Shared& sh) {
  constexpr bool kDraft = kDrafts<Q>;
  int tok = kNoToken, next = kNoNode, state = kFinal;
  float m = 0.f, z = 0.f;
  if (used) {
    const int G = r.p.granules;
    if (!kSamples<Q> || !(r.temp > 0.f)) {  // greedy: the first maximum over the granules
      const GranuleStat* stats = r.stats();
      ArgMax am = argmax_identity();
      for (int k = threadIdx.x; k < G; k += kThreads)
        am = argmax_merge(am, stats[k].am);
      tok = block_argmax(am, sh).index;
      const int t = tok;
      next = r.find_child([&](int par, int64_t dr) { return token_accepts(par, dr, r.u, t); }, sh);
    } else if constexpr (kSamples<Q>) {
      const GranuleStat* stats = r.stats();
      MaxSum ms = maxsum_identity();
      for (int k = threadIdx.x; k < G; k += kThreads)
        ms = maxsum_merge(ms, stats[k].ms);
      ms = block_maxsum(ms, sh);
      m = ms.m;
      z = ms.s;
      const float* uni = r.p.uniforms + static_cast<int64_t>(r.row) * 2;
      if (!has_distribution(ms)) {
        // its probabilities would all be NaN (see has_distribution): bonus kNoToken, accept nothing
      } else if constexpr (kDraft) {
        const int child = r.find_child([&](int par, int64_t) { return par == r.u; }, sh);
        if (child == kNoNode) {  // the leaf: the bonus comes from p with uniform 1
          tok = sample_p(r, m, z, uni[1], sh);
        } else {
          const int64_t x = r.draft_token(child);
          bool accept = false;
          if (x >= 0 && x < r.p.V) {  // an unchecked bad draft token is rejected, never read
            const float qx = load1(r.q() + x);
            accept = qx > 0.f && uni[0] < r.prob(load1(r.logits() + x), m, z) / qx;
          }
          if (accept) {
            tok = static_cast<int>(x);
            next = child;
          } else {
            state = kResidual;
          }
        }
      } else {
        tok = sample_p(r, m, z, uni[0], sh);
        const int t = tok;
        next = r.find_child([&](int par, int64_t dr) { return token_accepts(par, dr, r.u, t); }, sh);
      }
    }
  }
  if (threadIdx.x == 0) {
    r.s.dec[r.row].m = m;
    r.s.dec[r.row].z = z;
  }
  if constexpr (kDraft) {
    if (threadIdx.x == 0) publish_state(&r.cnt.state[r.row], state);
    if (state == kResidual) return;  // phase B finishes the row
  }
  finish_row(r, tok, next, sh);
}

// CTAs per SM the register cap guarantees (ptxas then fits every variant without spilling, nvcc 13.0,
// sm_80 / sm_90a; counts per variant in csrc/README.md): greedy-only launches need ~48 registers and
// get 5 CTAs (51 registers at most); sampling launches 3 (80); draft launches, whose phase B and
// residual sampling add live state, 2 (128: at 80 they spilled a few bytes, variant by variant).
template <class Q>
constexpr int kMinCtasPerSm = !kSamples<Q> ? 5 : (kDrafts<Q> ? 2 : 3);

template <class T, class Q, int VEC>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<Q>) kernel(TreeVerifyParams p, Counters cnt, Scratch s) {
  __shared__ Shared sh;
  constexpr bool kDraft = kDrafts<Q>;
  const int S = p.num_chunks;
  const int items = p.B * p.N * S;
  int item = static_cast<int>(blockIdx.x);
  bool phase_b = false;
  if constexpr (kDraft) {
    if (threadIdx.x == 0) sh.item = static_cast<int>(atomicInc(cnt.ticket, 2u * static_cast<unsigned>(items) - 1u));
    __syncthreads();
    item = sh.item;
    phase_b = item >= items;
    if (phase_b) item -= items;
  }
  const int row = item / S, chunk = item % S;
  const int b = row / p.N, u = row % p.N;
  const int64_t row64 = row;
  Row<T, Q> r{p, cnt, s, row, b, u, kSamples<Q> ? p.temperature[b] : 0.f, 0, 0};
  const int warp = threadIdx.x >> 5;
  const int64_t g = static_cast<int64_t>(chunk) * kWarps + warp;  // this warp's granule
  const int64_t g0 = min64(p.V, g * p.granule), g1 = min64(p.V, g0 + p.granule);

  if (!phase_b) {
    const bool used = u == 0 || p.parents[row64] >= 0;  // padding slots are never visited by the walk
    r.load_candidate(u + 1 + threadIdx.x);
    const GranuleStat st = granule_stats<T, VEC, kSamples<Q>>(r.logits(), g0, g1, r.temp);
    if ((threadIdx.x & 31) == 0) r.stats()[g] = st;
    if (block_arrive_last(&cnt.row_a[row], S, sh)) decide(r, used, sh);
    return;
  }
  if constexpr (kDraft) {
    const int state = wait_state(&cnt.state[row], sh);
    float m = 0.f, z = 0.f;
    if (state == kResidual) {
      m = s.dec[row].m;
      z = s.dec[row].z;
      const float res = granule_residual<T, Q, VEC>(r, g0, g1, m, z);
      if ((threadIdx.x & 31) == 0) r.residual()[g] = res;
    }
    if (!block_arrive_last(&cnt.row_b[row], S, sh)) return;
    if (threadIdx.x == 0) cnt.state[row] = kPending;  // every phase B CTA of the row has read it
    if (state != kResidual) return;  // final since phase A
    double part = 0.0;
    const float* res = r.residual();
    for (int k = threadIdx.x; k < p.granules; k += kThreads) part += res[k];
    const float total = static_cast<float>(block_sum(part, sh));
    const float* uni = p.uniforms + row64 * 2;
    // p == q leaves no residual (rejection is then impossible in exact arithmetic): sample from p
    const int tok = total > 0.f ? sample_residual(r, m, z, total, uni[1], sh) : sample_p(r, m, z, uni[1], sh);
    finish_row(r, tok, kNoNode, sh);
  }
}

template <class X>
struct Tag {
  using type = X;
};

}  // namespace tree

// Whether the 16-byte loads of logits (and draft_probs) are aligned for every row: otherwise the
// launch takes the scalar-load kernel.
template <class T>
bool tree_verify_vectorized(const TreeVerifyParams& p) {
  constexpr int kV = kVec16<T>;
  bool ok = p.V % kV == 0 && p.logits_stride[0] % kV == 0 && p.logits_stride[1] % kV == 0 && host_aligned16(p.logits);
  if (p.draft_probs != nullptr) {
    const int64_t q_bytes = p.draft_probs_fp32 ? 4 : static_cast<int64_t>(sizeof(T));
    ok = ok && host_aligned16(p.draft_probs) && p.draft_probs_stride[0] * q_bytes % 16 == 0 &&
         p.draft_probs_stride[1] * q_bytes % 16 == 0;
  }
  return ok;
}

// Fills p.num_chunks, p.chunk, p.granule and p.granules for this device and layout; returns the
// workspace size in bytes. p.counters needs tree_verify_counter_ints() zeroed int32.
template <class T>
int64_t tree_verify_prepare(TreeVerifyParams& p, int num_sms) {
  const int64_t tile = tree_verify_vectorized<T>(p) ? tree::kTile<kVec16<T>> : tree::kTile<1>;
  const TreePlan plan = tree_plan(static_cast<int64_t>(p.B) * p.N, p.V, num_sms, tile, tree::kMaxTiles, tree::kWarps);
  p.num_chunks = plan.num_chunks;
  p.chunk = plan.chunk;
  p.granule = plan.granule;
  p.granules = plan.granules;
  return tree::scratch_bytes(static_cast<int64_t>(p.B) * p.N, plan.granules, p.draft_probs != nullptr);
}

inline int64_t tree_verify_counter_ints(int B, int N) {
  return tree::counter_ints(static_cast<int64_t>(B) * N, B);
}

// Launches tree_verify for logits of element type T (float, __half, __nv_bfloat16); draft_probs are
// fp32 or T. p comes from tree_verify_prepare(); p.workspace holds its bytes (any contents).
template <class T>
cudaError_t tree_verify(const TreeVerifyParams& p, cudaStream_t stream) {
  if (p.B <= 0) return cudaSuccess;
  const bool vec = tree_verify_vectorized<T>(p);
  const int64_t tile = vec ? tree::kTile<kVec16<T>> : tree::kTile<1>;
  const int64_t rows = static_cast<int64_t>(p.B) * p.N;
  const int64_t items = rows * p.num_chunks * (p.draft_probs != nullptr ? 2 : 1);
  if (p.N < 1 || p.V < 1 || p.V > 0x7fffffff || p.num_chunks < 1 || p.chunk < tile || p.chunk % tile ||
      p.granule * tree::kWarps != p.chunk || p.granules != p.num_chunks * tree::kWarps || items > 0x7fffffff ||
      static_cast<int64_t>(p.num_chunks) * p.chunk < p.V ||  // the chunks must cover the vocabulary
      p.workspace == nullptr || p.counters == nullptr ||
      (p.temperature != nullptr && p.uniforms == nullptr) ||  // sampling rows read uniforms
      (p.draft_probs != nullptr && p.temperature == nullptr))
    return cudaErrorInvalidValue;
  const tree::Counters cnt = tree::carve_counters(p.counters, rows, p.B);
  const tree::Scratch s = tree::carve_scratch(p.workspace, rows, p.granules);
  const unsigned grid = static_cast<unsigned>(items);
  constexpr int kV = kVec16<T>;
  auto run = [&](auto q_tag) {
    using Q = typename decltype(q_tag)::type;
    return vec ? launch(tree::kernel<T, Q, kV>, dim3(grid), tree::kThreads, 0, false, stream, p, cnt, s)
               : launch(tree::kernel<T, Q, 1>, dim3(grid), tree::kThreads, 0, false, stream, p, cnt, s);
  };
  if (p.temperature == nullptr) return run(tree::Tag<tree::GreedyOnly>{});
  if (p.draft_probs == nullptr) return run(tree::Tag<void>{});
  if (p.draft_probs_fp32 || std::is_same_v<T, float>) return run(tree::Tag<float>{});
  return run(tree::Tag<T>{});
}

}  // namespace gemma4_mtp
