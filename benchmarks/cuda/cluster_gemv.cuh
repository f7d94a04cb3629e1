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
//
// A stage may instead be a sliding layer's attention (`window` > 0), so that a chain is a whole E2B sliding
// layer: its input is the n / k query heads (k = 256 entries each; `norm` scales each head by its own inverse
// RMS, the q_norm), attending over `window` keys and values of one key-value head ([2, window, k] bf16 at w,
// keys first). Program p scores the heads against keys [p window / P, (p + 1) window / P), streamed through
// the same ring as the weights (and fetched as early), and pushes to each program its partial output for the
// entries that program owns, with every head's max score and exp-sum; the owner merges the P partials (the
// split-softmax merge) and pushes its merged entries to every program, as a GEMV pushes its rows: two pushed
// exchanges, no barrier.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "gemma4_mtp/cluster.cuh"
#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/rms_norm_linear.cuh"  // glue::gelu_tanh, the drafter MLP's GELU

#include "block_sum.cuh"
#include "bulk_ring.cuh"

namespace cluster_gemv {

using namespace gemma4_mtp;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxStages = 32;
constexpr int kChunkBytes = 16 * 1024;
constexpr int kRing = 8;
constexpr int kMaxK = 4096;   // input entries of a stage (a glu stage receives 2 k <= 2 kMaxK)
constexpr float kEps = 1e-6f;
using Ring = BulkRing<kRing, kChunkBytes>;

struct Stage {
  const __nv_bfloat16* w;  // [n, k], 16-byte aligned (attention: keys then values, [2, window, k])
  int n, k;                // n a multiple of 4 * programs, k a multiple of 8, k <= kMaxK (attention: n = heads * k)
  int norm;                // scale by the input's inverse RMS (attention: each head's by its own)
  int glu;                 // the pushed input has 2 k entries a, b; use gelu(a) * b
  int window = 0;          // > 0: attention of n / k heads over `window` keys (k = 256, window a multiple of P)
};

constexpr int kHeadDim = 256;  // an attention stage's k: a key row is one 256-column unit, a column a thread

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

__host__ __device__ inline int input_len(const Stage& st) { return st.window ? st.n : st.glu ? 2 * st.k : st.k; }

// Bf16 entries a stage reads from w: its weights, or its keys and values.
__host__ __device__ inline size_t weight_count(const Stage& st) {
  return static_cast<size_t>(st.window ? 2 * st.window : st.n) * static_cast<size_t>(st.k);
}

// An attention stage's statistics pushed with each partial: every head's max score and exp-sum, padded to
// whole 16-byte pushes.
__host__ __device__ inline int stat_len(int heads) { return (2 * heads + 3) / 4 * 4; }

// The program's stream at a stage: its rows of W, or its keys and then its values, in chunks of
// stage_chunk_rows rows (a chunk never holds keys and values both).
__host__ __device__ inline int stage_chunk_rows(const Stage& st, int programs) {
  return chunk_rows(st.window ? st.window / programs : st.n / programs, st.k);
}
__host__ __device__ inline int stage_chunks(const Stage& st, int programs) {
  return (st.window ? 2 * (st.window / programs) : st.n / programs) / stage_chunk_rows(st, programs);
}

// Appends the stages written in `spec` ("n:k:norm:glu[:window],...", the form in which the benchmark's
// and the emulation's command lines take a chain) to c; false when an entry is not 4 or 5 integers or c
// would hold more than kMaxStages stages. What the shapes must be is valid's to say.
inline bool append_stages(const std::string& spec, Chain* c) {
  size_t pos = 0;
  while (pos < spec.size()) {
    const size_t end = std::min(spec.find(',', pos), spec.size());
    const std::string entry = spec.substr(pos, end - pos);
    int f[5] = {0, 0, 0, 0, 0}, fields = 0;
    const char* s = entry.c_str();
    for (;;) {  // an integer, then ':' and another or the entry's end
      char* next = nullptr;
      const long v = std::strtol(s, &next, 10);
      if (next == s || fields == 5) return false;
      f[fields++] = static_cast<int>(v);
      if (*next == '\0') break;
      if (*next != ':') return false;
      s = next + 1;
    }
    if (fields < 4 || c->stages >= kMaxStages) return false;
    c->stage[c->stages++] = Stage{nullptr, f[0], f[1], f[2], f[3], f[4]};
    pos = end + 1;
  }
  return true;
}

// Whether the chain can run on `programs`: the shapes above, each stage's input what the one before
// it pushes, at most kMaxStages stages, every stage's weights 16-byte aligned (bulk copies' sources).
inline bool valid(const Chain& c, int programs) {
  if (c.stages < 1 || c.stages > kMaxStages || programs < 1 || programs > kMaxCluster) return false;
  for (int s = 0; s < c.stages; ++s) {
    const Stage& st = c.stage[s];
    if (!host_aligned16(st.w)) return false;
    if (st.n < 4 * programs || st.n % (4 * programs) != 0 || st.k < 8 || st.k % 8 != 0 || st.k > kMaxK)
      return false;
    if (st.n > 2 * kMaxK || (s > 0 && input_len(st) != c.stage[s - 1].n)) return false;
    if (st.window) {  // its keys and values in the ring at once, a head count the scores' reduction takes
      const int heads = st.n / st.k;
      if (st.k != kHeadDim || st.n % st.k != 0 || st.glu || 32 % heads != 0 || heads > 8) return false;
      if (st.window % programs != 0) return false;
      if (stage_chunks(st, programs) > kRing) return false;
    }
  }
  return true;
}

// An attention stage's floats in shared memory: the P partials received (each its owner's entries and the
// statistics), the program's own partial output, its scores, its statistics; a multiple of 4.
__host__ __device__ inline int attention_floats(const Stage& st, int programs) {
  if (!st.window) return 0;
  const int heads = st.n / st.k, stats = stat_len(heads);
  return programs * (st.n / programs + stats) + st.n + (heads * (st.window / programs) + 3) / 4 * 4 + stats;
}

// The longest vector a stage receives or produces, the most rows a program computes at one stage, and the
// most floats an attention stage needs.
struct Extent {
  int vec = 0, rows = 0, attention = 0;
};
__host__ __device__ inline Extent extent(const Chain& c, int programs) {
  Extent e;
  for (int s = 0; s < c.stages; ++s) {
    e.vec = max(e.vec, max(input_len(c.stage[s]), c.stage[s].n));
    e.rows = max(e.rows, c.stage[s].n / programs);
    e.attention = max(e.attention, attention_floats(c.stage[s], programs));
  }
  return e;
}

// Shared memory: the weight ring, two input vectors, the program's rows of an output, an attention stage's
// buffers, the chunk's partial sums, the warp sums of a norm, the ring's, the inputs' and the attention
// partials' mbarriers.
inline size_t smem_bytes(const Chain& c, int programs) {
  const Extent e = extent(c, programs);
  return Ring::kBytes + 2 * static_cast<size_t>(e.vec) * 4 +
         static_cast<size_t>(e.rows) * 4 + static_cast<size_t>(e.attention) * 4 + (kRing * kMaxUnits + kWarps) * 4 +
         (kRing + 3) * 8;
}

// Chunk j of the program's whole weight stream (stages in order, each its rows in chunk_rows runs):
// its stage, first row (of the program's rows) and row count; false past the last.
__device__ inline bool find_chunk(const Chain& c, int programs, int j, int* stage, int* row0, int* rows) {
  for (int s = 0; s < c.stages; ++s) {
    const int cr = stage_chunk_rows(c.stage[s], programs), n_chunks = stage_chunks(c.stage[s], programs);
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

// Thread 0: bulk-copies chunk j (if any) of this program's weights into the ring.
__device__ inline void issue_chunk(const Chain& c, int programs, int rank, int j, const Ring& ring) {
  int s, row0, rows;
  if (!find_chunk(c, programs, j, &s, &row0, &rows)) return;
  const Stage& st = c.stage[s];
  int first = rank * (st.n / programs) + row0;
  if (st.window) {  // the program's keys, then its values (the second half of its stream)
    const int keys = st.window / programs;
    first = (row0 < keys ? 0 : st.window) + rank * keys + row0 % keys;
  }
  ring.fill(j, st.w + static_cast<size_t>(first) * st.k, static_cast<unsigned>(rows * st.k * 2));
}

// An attention stage's scores and partial output for H heads (x: H * kHeadDim query entries) over the
// program's `keys` keys and values, chunks j, j + 1, ... of its stream (cr rows a chunk; the keys' chunks,
// then the values'; scores: keys x H, key-major): every head's max score and exp-sum to stat (the H max
// scores first), its exp-weighted sum of the values to out (H * kHeadDim). Ends with the ring's buffers read
// and out, stat written.
template <int H>
__device__ void attend(const float* x, const Ring& ring, int j, int cr, int keys,
                       float* scores, float* stat, float* out) {
  static_assert(32 % H == 0 && kHeadDim == kThreads, "32 / H keys a transposed reduction; a column a thread");
  constexpr int kPer = 32 / H;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int kc = keys / cr;  // chunks of keys (as many of values follow)
  auto row = [&](int chunk, int r) {  // row r of the stream's chunk j + chunk in the ring
    return ring.slot<const __nv_bfloat16>(j + chunk) + static_cast<size_t>(r) * kHeadDim;
  };
  for (int g = 0; g < 2 * kc; ++g)  // every chunk's bytes first, as a GEMV's group
    ring.wait(j + g);
  // scores: a warp takes every kWarps-th key, 8 columns a lane, kPer keys' H dot products summed at once
  float q[H][8];
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) q[h][e] = x[h * kHeadDim + 8 * lane + e];
  for (int b = 0; b * kWarps * kPer < keys; ++b) {
    float acc[32];
#pragma unroll
    for (int t = 0; t < kPer; ++t) {
      const int u = warp + kWarps * (b * kPer + t);
      float kf[8] = {};
      if (u < keys) {
        const uint4 kv = *reinterpret_cast<const uint4*>(row(u / cr, u % cr) + 8 * lane);
        const __nv_bfloat16* ke = reinterpret_cast<const __nv_bfloat16*>(&kv);
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = to_float(ke[e]);
      }
#pragma unroll
      for (int h = 0; h < H; ++h) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d += kf[e] * q[h][e];
        acc[t * H + h] = d;
      }
    }
    const float total = warp_transpose_sum(acc, lane);  // lane i: key t = i / H's score for head i % H
    const int u = warp + kWarps * (b * kPer + lane / H);
    if (u < keys) scores[u * H + lane % H] = total;  // key-major: the values' pass reads a key's H at once
  }
  __syncthreads();
  // each head's max and exp-sum (a warp a head), the scores turned into their exponentials
  for (int h = warp; h < H; h += kWarps) {
    float m = -INFINITY, l = 0.0f;
    for (int u = lane; u < keys; u += 32) m = fmaxf(m, scores[u * H + h]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int u = lane; u < keys; u += 32) {
      const float p = expf(scores[u * H + h] - m);
      scores[u * H + h] = p;
      l += p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      stat[h] = m;
      stat[H + h] = l;
    }
  }
  // the padding pushed with them
  if (static_cast<int>(threadIdx.x) < stat_len(H) - 2 * H) stat[2 * H + threadIdx.x] = 0.0f;
  __syncthreads();
  // the values: a thread a column, every head's sum over the keys
  float o[H] = {};
  for (int u = 0; u < keys; ++u) {
    const float v = to_float(row(kc + u / cr, u % cr)[threadIdx.x]);
    if constexpr (H % 4 == 0) {  // the key's H weights in H / 4 broadcast loads
#pragma unroll
      for (int h = 0; h < H; h += 4) {
        const float4 p = *reinterpret_cast<const float4*>(scores + u * H + h);
        o[h] += p.x * v;
        o[h + 1] += p.y * v;
        o[h + 2] += p.z * v;
        o[h + 3] += p.w * v;
      }
    } else {
#pragma unroll
      for (int h = 0; h < H; ++h) o[h] += scores[u * H + h] * v;
    }
  }
#pragma unroll
  for (int h = 0; h < H; ++h) out[h * kHeadDim + threadIdx.x] = o[h];
  __syncthreads();
}

// An attention stage (the header says how), chunks j, j + 1, ... of the stream its keys and values, abar's
// phase `phase`: the program's merged entries of the output to y_rows. x is the program's copy of the input
// (each head's q_norm applied in place); att, attention_floats(st) floats.
__device__ void attention_stage(const Chain& c, const Stage& st, int programs, int rank, int j, unsigned phase,
                                float* x, float* att, float* y_rows, const Ring& ring, uint64_t* abar) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int rows = st.n / programs;
  const int heads = st.n / st.k, keys = st.window / programs, cr = stage_chunk_rows(st, programs);
  const int stats = stat_len(heads), slot = rows + stats;  // a sender's floats in recv
  float* recv = att;
  float* own = recv + programs * slot;
  float* scores = own + st.n;
  float* stat = scores + (heads * keys + 3) / 4 * 4;
  if (threadIdx.x == 0) mbarrier_arrive_expect_tx(abar, static_cast<unsigned>(programs * slot) * 4u);
  if (st.norm) {  // q_norm: each head's query by its own inverse RMS, in place (a warp a head)
    for (int h = warp; h < heads; h += kWarps) {
      float sq = 0.0f;
      for (int i = lane; i < st.k; i += 32) sq += x[h * st.k + i] * x[h * st.k + i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      const float r = rsqrtf(sq / static_cast<float>(st.k) + kEps);
      for (int i = lane; i < st.k; i += 32) x[h * st.k + i] *= r;
    }
    __syncthreads();
  }
  switch (heads) {  // valid() admits these
    case 1: attend<1>(x, ring, j, cr, keys, scores, stat, own); break;
    case 2: attend<2>(x, ring, j, cr, keys, scores, stat, own); break;
    case 4: attend<4>(x, ring, j, cr, keys, scores, stat, own); break;
    default: attend<8>(x, ring, j, cr, keys, scores, stat, own); break;
  }
  if (threadIdx.x == 0)  // the keys' and values' buffers refilled with the chunks kRing further on
    for (int g = 0; g < stage_chunks(st, programs); ++g) issue_chunk(c, programs, rank, j + g + kRing, ring);
  // to each program its entries of this partial output, and every head's statistics
  const int per = rows / 4 + stats / 4;
  for (int t = static_cast<int>(threadIdx.x); t < programs * per; t += kThreads) {
    const int to = t / per, v = t % per;
    const float* src = v < rows / 4 ? own + to * rows + 4 * v : stat + 4 * (v - rows / 4);
    st_async_peer(recv + rank * slot + 4 * v, static_cast<unsigned>(to), *reinterpret_cast<const uint4*>(src),
                  abar);
  }
  // the P partials of this program's entries merged: rescaled to the heads' common max, summed, divided
  mbarrier_wait<Scope::kCluster>(abar, phase);
  for (int i = static_cast<int>(threadIdx.x); i < rows; i += kThreads) {
    const int h = (rank * rows + i) / st.k;
    float m = -INFINITY;
    for (int p = 0; p < programs; ++p) m = fmaxf(m, recv[p * slot + rows + h]);
    float l = 0.0f, sum = 0.0f;
    for (int p = 0; p < programs; ++p) {
      const float* r = recv + p * slot;
      const float w = expf(r[rows + h] - m);
      l += w * r[rows + heads + h];
      sum += w * r[i];
    }
    y_rows[i] = sum / l;
  }
  __syncthreads();
}

// A GEMV stage (the header says how), chunks j, j + 1, ... of the stream its weights: the program's rows
// of the output to y_rows. x is the program's copy of the input (the GLU folded in place).
__device__ void gemv_stage(const Chain& c, const Stage& st, int programs, int rank, int j, float* x, float* y_rows,
                           float* partial, float* red, const Ring& ring) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  if (st.glu) {  // in place: entry i reads i and k + i, and only i is written
    for (int i = static_cast<int>(threadIdx.x); i < st.k; i += kThreads) x[i] = glue::gelu_tanh(x[i]) * x[st.k + i];
    __syncthreads();
  }
  float scale = 1.0f;
  if (st.norm) {
    float sq = 0.0f;
    for (int i = static_cast<int>(threadIdx.x); i < st.k; i += kThreads) sq += x[i] * x[i];
    // red's last reads (the previous norm) are behind the previous stage's barriers
    scale = rsqrtf(block_sum<kWarps>(sq, red) / static_cast<float>(st.k) + kEps);
  }
  // the stage's chunks in groups of up to kRing (one group unless the program's rows exceed the ring):
  // once the group's bytes are in, each warp takes every kWarps-th 256-column unit of it, keeps a partial
  // sum per unit (32 at most), and sums them across the warp in one transposed reduction
  const int cr = stage_chunk_rows(st, programs), upr = (st.k + 255) / 256;
  const int chunks = stage_chunks(st, programs);
  for (int c0 = 0; c0 < chunks; c0 += kRing) {
    const int group = min(kRing, chunks - c0), units = group * cr * upr;
    for (int g = 0; g < group; ++g)  // the group's bytes first: then its loads need no wait between them
      ring.wait(j + c0 + g);
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      acc[i] = 0.0f;
      const int u = warp + kWarps * i;
      if (u < units) {
        const int r = u % (cr * upr) / upr, col = u % upr * 256 + 8 * lane;
        const int jc = j + c0 + u / (cr * upr);  // the unit's chunk's place in the weight stream
        if (col < st.k) {
          const __nv_bfloat16* w = ring.slot<const __nv_bfloat16>(jc);
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
      for (int g = 0; g < group; ++g) issue_chunk(c, programs, rank, j + c0 + g + kRing, ring);
    __syncthreads();  // partial is rewritten by the next group
  }
}

// One program an SM (its shared memory holds the ring): ptxas may use every register, not target two.
__global__ void __launch_bounds__(kThreads, 1) chain_kernel(Chain c) {
  if constexpr (!kHasClusters) __trap();
  const int programs = static_cast<int>(gridDim.x), rank = static_cast<int>(cluster_rank());
  const Extent e = extent(c, programs);
  const int vec = e.vec;
  unsigned char* smem = dynamic_smem();
  float* xbuf[2] = {reinterpret_cast<float*>(smem + Ring::kBytes), reinterpret_cast<float*>(smem + Ring::kBytes) + vec};
  float* y_rows = xbuf[1] + vec;
  float* att = y_rows + e.rows;  // an attention stage's buffers (attention_floats)
  float* partial = att + e.attention;
  float* red = partial + kRing * kMaxUnits;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + kWarps);  // 8-byte aligned: an even count of floats before
  uint64_t* xbar = full + kRing;
  uint64_t* abar = xbar + 2;  // the attention partials received
  const Ring ring{smem, full};
  if (threadIdx.x == 0) {
    ring.init();
    mbarrier_init(&xbar[0], 1);
    mbarrier_init(&xbar[1], 1);
    mbarrier_init(abar, 1);
    fence_mbarrier_init();
    for (int j = 0; j < kRing; ++j) issue_chunk(c, programs, rank, j, ring);
  }
  for (int i = static_cast<int>(threadIdx.x); i < input_len(c.stage[0]); i += kThreads) xbuf[0][i] = c.x[i];
  cluster_sync();  // every program's mbarriers initialised before anyone pushes into it
  int j = 0;           // the next chunk of the stream
  int attentions = 0;  // attention stages so far: the phase of abar
  for (int s = 0; s < c.stages; ++s) {
    const Stage st = c.stage[s];
    float* x = (s & 1) ? xbuf[1] : xbuf[0];
    float* next = (s & 1) ? xbuf[0] : xbuf[1];
    uint64_t* next_bar = (s & 1) ? &xbar[0] : &xbar[1];
    if (threadIdx.x == 0) mbarrier_arrive_expect_tx(next_bar, static_cast<unsigned>(st.n) * 4u);
    if (s > 0) mbarrier_wait<Scope::kCluster>((s & 1) ? &xbar[1] : &xbar[0], static_cast<unsigned>((s - 1) >> 1) & 1u);
    const int rows = st.n / programs;
    if (st.window) {
      attention_stage(c, st, programs, rank, j, static_cast<unsigned>(attentions++) & 1u, x, att, y_rows, ring, abar);
    } else {
      gemv_stage(c, st, programs, rank, j, x, y_rows, partial, red, ring);
    }
    j += stage_chunks(st, programs);
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
