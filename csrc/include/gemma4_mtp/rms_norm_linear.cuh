// The fused glue of a drafter layer: rms_norm_linear, rms_norm_gate_up and rms_norm_q_rope (GlueParams
// in params.h says what each computes). One kernel template serves the three ops; they differ in which
// weight rows a tile reads (glue_logic.h) and in the epilogue.
//
// Why a CUDA version beside Triton's: these projections are a third of a 31B step's bytes (q_proj 16-32
// MiB, o_proj 16-32, gate/up 32, down 16 per layer, post_projection 11: ~380 MB a step), the first
// GPU run measured Triton's tl.dot GEMV design at 38% of copy bandwidth (the down projection), and a
// step's 17 glue calls are also what an engine without Triton (C++) needs to run a drafter.
//
// A CTA (256 threads) owns a tile of 32 weight rows x up to 64 tokens and a range of 32-wide k steps
// (the plan of glue_logic.h splits k when the tiles alone cannot fill the GPU):
//  1. Before griddep_wait (programmatic dependent launch, sm_90): it asks L2 for its first 128 KiB of
//     weight (prefetch.global.L2: no register, no dependence on the previous kernel, coherent in L2),
//     so the weight stream starts while the previous kernel of the step finishes.
//  2. Prologue: the CTA's warps split the live token rows (8 / live warps per row) and read each row
//     once into registers (up to 4096 elements for one token, 512 for eight: one L2 round trip),
//     compute 1/rms of x and of h, and write n for the CTA's k range into shared memory (x itself when
//     the op has no prologue), rounded where Hugging Face rounds; the CTAs of split 0 share the
//     residual_out / normed_out writes. Only live tokens are computed: a one-token step pays for one
//     row, not for the m16 tile the mma reads (its other rows are zeros in registers). rms_norm_linear
//     without residual, norm or full-row outputs (o_proj, down_proj) stages its k range alone.
//  3. Main loop, as fused_concat_down_proj's tensor-core path: each warp takes every 8th k step, each
//     lane loads one 16-byte vector per weight row and step straight into mma.m16n8k16 B fragments,
//     U steps' loads in flight before any is consumed; A fragments come from the staged n.
//  4. The warps' tiles are summed in shared memory; with split k each split writes an fp32 partial and
//     the tile's last CTA (a counter, left zero) sums them in split order (deterministic).
//  5. Epilogue: kLinear rounds and stores; kGateUp rounds gate and up, gelu_tanh(gate) (fp32, rounded)
//     times up (rounded), and with down_weight multiplies that m by its 16 columns of down_weight and
//     sums the tiles' fp32 partials in a fixed tree (the whole MLP in one launch: glue_logic.h); kQRope
//     stores the rounded q_proj tile to a workspace and the last tile of each (token tile, head) to
//     finish (a counter) applies q_norm and neox RoPE to the head (cos/sin of the fp32 angle as
//     rms_norm_q_rope's Triton kernel computes them, rounded to the dtype).
// fp32, and rows that 16-byte loads cannot assume (pointer or row stride not 16-byte aligned, H not a
// multiple of 8): the CUDA-core kernel below, with the same tiles, plan and epilogues.
//
// Expected on H100/H200 (bf16, T <= 16): two CTAs per SM with 4 steps x 4 rows of 16-byte loads in
// flight per lane (64 KiB per CTA), enough for copy bandwidth by Little's law (~36 KiB per SM at 4.8
// TB/s and ~1 us of latency); E2B's 0.1-2 MiB weights are latency bound (launch, one L2 round trip
// for the prologue, the reduction), which the L2 prefetch before griddep_wait partly hides.
// Predictions per case: benchmarks/README.md, "CUDA glue".
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/down_proj_logic.h"
#include "gemma4_mtp/glue_logic.h"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
#include "gemma4_mtp/params.h"

namespace gemma4_mtp {
namespace glue {

constexpr int kThreads = kMmaWarps * 32;

template <class T>
__device__ __forceinline__ float rnd(float v) {
  return to_float(from_float<T>(v));
}

template <class T>
__device__ __forceinline__ float elem(const void* base, int64_t i) {
  return to_float(static_cast<const T*>(base)[i]);
}

// torch's gelu(approximate="tanh") in fp32 with the precise tanh, as its CUDA kernel computes it.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
  return 0.5f * x * (1.0f + tanhf(inner));
}

// cos(f), sin(f) of fp32 f to ~1 ulp without a stack frame (cosf / sinf keep a local array for their
// Payne-Hanek path): the quadrant reduction in fp64, then Cephes' fp32 polynomials on [-pi/4, pi/4].
// The same math as triton/rms_norm_q_rope.py's cos_sin.
__device__ __forceinline__ void cos_sin(float f, float& c, float& s) {
  const double fd = f;
  const double q = floor(fd * 0.6366197723675814 + 0.5);
  const float r = static_cast<float>(fd - q * 1.5707963267948966);
  const int quadrant = static_cast<int>(q) & 3;
  const float z = r * r;
  const float sn = r + r * z * (-1.6666654611e-1f + z * (8.3321608736e-3f + z * -1.9515295891e-4f));
  const float cs = 1.0f - 0.5f * z + z * z * (4.166664568298827e-2f + z * (-1.388731625493765e-3f + z * 2.443315711809948e-5f));
  s = quadrant == 0 ? sn : quadrant == 1 ? cs : quadrant == 2 ? -sn : -cs;
  c = quadrant == 0 ? cs : quadrant == 1 ? -sn : quadrant == 2 ? -cs : sn;
}

// The prologue of one element, fp32 holding T values: h from x (and the residual, its norm weight, the
// inverse rms of x and the layer scalar), then n.
template <class T>
struct Prologue {
  bool res, scale, norm;
  float scalar;

  __device__ __forceinline__ float h(float x, float r, float rw, float inv_x) const {
    if (!res) return x;
    const float v = rnd<T>(r + rnd<T>(x * inv_x * rw));
    return scale ? rnd<T>(v * scalar) : v;
  }
  __device__ __forceinline__ float n(float h, float nw, float inv_h) const { return norm ? rnd<T>(h * inv_h * nw) : h; }
};

template <class T>
__device__ __forceinline__ Prologue<T> make_prologue(const GlueParams& p) {
  Prologue<T> pr{p.residual != nullptr, p.layer_scalar != nullptr, p.norm_weight != nullptr, 1.f};
  if (pr.res && pr.scale) pr.scalar = elem<T>(p.layer_scalar, 0);
  return pr;
}

// The loads of one VEC-element vector of a prologue row: x, residual and the two norm weights at k.
template <int VEC, class T>
struct RowVec {
  Packed<VEC, T> x, r, rw, nw;
};

template <int VEC, class T>
__device__ __forceinline__ void load_row_vec(const GlueParams& p, const Prologue<T>& pr, int t, int k,
                                             RowVec<VEC, T>& v) {
  load_packed<VEC>(static_cast<const T*>(p.x) + static_cast<int64_t>(t) * p.x_stride + k, v.x);
  if (pr.res) {
    load_packed<VEC>(static_cast<const T*>(p.residual) + static_cast<int64_t>(t) * p.residual_stride + k, v.r);
    load_packed<VEC>(static_cast<const T*>(p.residual_norm_weight) + k, v.rw);
  }
  if (pr.norm) load_packed<VEC>(static_cast<const T*>(p.norm_weight) + k, v.nw);
}

template <int VEC, class T>
__device__ __forceinline__ float sum_sq_x(const RowVec<VEC, T>& v) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float x = to_float(v.x.e[e]);
    s += x * x;
  }
  return s;
}

template <int VEC, class T>
__device__ __forceinline__ float sum_sq_h(const RowVec<VEC, T>& v, const Prologue<T>& pr, float inv_x) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float h = pr.h(to_float(v.x.e[e]), to_float(v.r.e[e]), to_float(v.rw.e[e]), inv_x);
    s += h * h;
  }
  return s;
}

// h and n of one vector to their destinations: the stage (the CTA's k range), and residual_out /
// normed_out when this CTA writes vector `vi` (vectors are dealt round robin to split 0's CTAs).
template <int VEC, class T>
__device__ __forceinline__ void emit_vec(const GlueParams& p, const Prologue<T>& pr, const RowVec<VEC, T>& v, int t,
                                         int tl, int k, int vi, float inv_x, float inv_h, T* stage, int stage_stride,
                                         int k_lo, int k_hi) {
  const bool staged = stage != nullptr && k >= k_lo && k < k_hi;
  const bool writes = blockIdx.z == 0 && vi % p.plan.row_tiles == static_cast<int>(blockIdx.x);
  if (!staged && !(writes && (p.residual_out != nullptr || p.normed_out != nullptr))) return;
  Packed<VEC, T> hv, nv;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float h = pr.h(to_float(v.x.e[e]), to_float(v.r.e[e]), to_float(v.rw.e[e]), inv_x);
    hv.e[e] = from_float<T>(h);
    nv.e[e] = from_float<T>(pr.n(h, to_float(v.nw.e[e]), inv_h));
  }
  if (staged) *reinterpret_cast<Packed<VEC, T>*>(stage + static_cast<int64_t>(tl) * stage_stride + (k - k_lo)) = nv;
  if (writes && p.residual_out != nullptr)
    *reinterpret_cast<Packed<VEC, T>*>(static_cast<T*>(p.residual_out) + static_cast<int64_t>(t) * p.residual_out_stride + k) = hv;
  if (writes && p.normed_out != nullptr)
    *reinterpret_cast<Packed<VEC, T>*>(static_cast<T*>(p.normed_out) + static_cast<int64_t>(t) * p.normed_out_stride + k) = nv;
}

// Sum of one value per thread over the threads of a group of `wpr` consecutive warps (deterministic:
// warp sums in warp order). Every thread of the CTA calls it.
__device__ __forceinline__ float group_sum(float v, int wpr, float* red_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red_s[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = warp / wpr * wpr; w < (warp / wpr + 1) * wpr; ++w) total += red_s[w];
  __syncthreads();
  return total;
}

// Step 2 of the design: for the live token rows of the tile, inv_x / inv_h (shared), n of [k_lo, k_hi)
// into the stage (when given) and the CTA's share of residual_out / normed_out. The CTA's warps are
// split into groups, one row per group (8 / rows warps a row, as many rows a pass as keep a row in one
// batch), so that a few rows use every thread: a group's thread holds its first kCache vectors in
// registers, and a row of up to
// kCache x (group threads) vectors costs one L2 round trip (one token: 4096 elements; 8 tokens: 512).
// Longer rows are read again per pass, kCache vectors at a time. VEC = 8 (16-byte vectors, the
// tensor-core path) or 1 (the CUDA-core path).
template <int VEC, int kCache, class T>
__device__ void prologue_rows(const GlueParams& p, const Prologue<T>& pr, int t0, int live, float* inv_x_s,
                              float* inv_h_s, float* red_s, T* stage, int stage_stride, int k_lo, int k_hi) {
  const int warp = threadIdx.x >> 5;
  const int nvec = p.H / VEC;  // VEC divides H
  // rows per pass: a power of two <= 8, doubled while a row still fits one batch (each statistic reads the
  // batches after the first again: at 8 tokens the 31B q_rope's rows of 128 vectors took one pass of 4
  // batches, 10 dependent loads; now 4 passes of one)
  int rows = 1;
  while (rows < live && rows < kMmaWarps && nvec * rows * 2 <= kCache * 32 * kMmaWarps) rows *= 2;
  const int wpr = kMmaWarps / rows, gthreads = 32 * wpr;
  const int gtid = threadIdx.x % gthreads;
  const int batches = max(1, static_cast<int>(ceil_div(nvec, int64_t{kCache} * gthreads)));
  for (int base = 0; base < live; base += rows) {
    const int tl = base + warp / wpr;
    const bool active = tl < live;
    const int t = t0 + tl;
    // vector i of batch b of this thread: gtid + gthreads * (kCache * b + i)
    RowVec<VEC, T> cache[kCache] = {};
#pragma unroll
    for (int i = 0; i < kCache; ++i) {
      const int vi = gtid + gthreads * i;
      if (active && vi < nvec) load_row_vec<VEC>(p, pr, t, vi * VEC, cache[i]);
    }
    // f(vector, vi) over this thread's vectors: batch 0 from the registers, later batches loaded again
    auto for_each = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < kCache; ++i) {
        const int vi = gtid + gthreads * i;
        if (active && vi < nvec) f(cache[i], vi);
      }
      for (int b = 1; b < batches; ++b) {
        RowVec<VEC, T> v[kCache] = {};
#pragma unroll
        for (int i = 0; i < kCache; ++i) {
          const int vi = gtid + gthreads * (kCache * b + i);
          if (active && vi < nvec) load_row_vec<VEC>(p, pr, t, vi * VEC, v[i]);
        }
#pragma unroll
        for (int i = 0; i < kCache; ++i) {
          const int vi = gtid + gthreads * (kCache * b + i);
          if (active && vi < nvec) f(v[i], vi);
        }
      }
    };
    float inv_x = 0.f, inv_h = 0.f;
    if (pr.res) {
      float ss = 0.f;
      for_each([&](const RowVec<VEC, T>& v, int) { ss += sum_sq_x(v); });
      inv_x = rsqrtf(group_sum(ss, wpr, red_s) / static_cast<float>(p.H) + p.eps);
    }
    if (pr.norm) {
      float ss = 0.f;
      for_each([&](const RowVec<VEC, T>& v, int) { ss += sum_sq_h(v, pr, inv_x); });
      inv_h = rsqrtf(group_sum(ss, wpr, red_s) / static_cast<float>(p.H) + p.eps);
    }
    if (active && gtid == 0) {
      inv_x_s[tl] = inv_x;
      inv_h_s[tl] = inv_h;
    }
    for_each([&](const RowVec<VEC, T>& v, int vi) {
      emit_vec(p, pr, v, t, tl, vi * VEC, vi, inv_x, inv_h, stage, stage_stride, k_lo, k_hi);
    });
  }
}

// Step 2 without statistics or full-row outputs (no residual, no norm: o_proj, down_proj): n is x, and a
// CTA needs its k range alone, which every thread copies into the stage a 16-byte vector at a time, the
// live rows' vectors dealt round robin: independent loads, one L2 round trip. prologue_rows reads whole
// rows in passes of row groups: 32 passes over 16384 elements a row for the 1984 a 31B o_proj CTA stages
// at 8 tokens (and 8 passes at one token), ~2x the CTA's weight bytes in L2 reads.
template <class T>
__device__ void stage_k_range(const GlueParams& p, int t0, int live, T* stage, int stage_stride, int k_lo, int k_hi) {
  constexpr int V = kVec16<T>;  // V divides H and k_lo (the tensor-core path's condition)
  const int nv = (min(k_hi, p.H) - k_lo) / V;
  for (int i = threadIdx.x; i < live * nv; i += kThreads) {
    const int r = i / nv, v = i % nv;
    Packed<V, T> x;
    load_packed<V>(static_cast<const T*>(p.x) + static_cast<int64_t>(t0 + r) * p.x_stride + k_lo + v * V, x);
    *reinterpret_cast<Packed<V, T>*>(stage + static_cast<int64_t>(r) * stage_stride + v * V) = x;
  }
}

// The weight row that this CTA's tile row r (0..31) reads; null past the weight's rows.
template <class T, GlueKind KIND>
__device__ __forceinline__ const T* weight_row(const GlueParams& p, int r) {
  const int64_t row = glue_weight_row(KIND, blockIdx.x, r);
  if (row >= p.N) return nullptr;
  const bool up = glue_reads_up(KIND, r);
  return static_cast<const T*>(up ? p.up_weight : p.weight) + row * (up ? p.up_weight_stride : p.weight_stride);
}

// cos / sin of token t's rotation angles for the lane's neox pairs (j = lane + 32 i, i < D / 64), as
// rms_norm_q_rope's Triton kernel computes them (fp32 angle), rounded to the dtype. Its loads (the
// position, inv_freq) are issued together, before any store that could alias them.
template <class T, int D>
__device__ __forceinline__ void rope_angles(const GlueParams& p, int64_t t, int lane, float (&c)[D / 64],
                                            float (&s)[D / 64]) {
  const int64_t pi = t / p.per_pos;
  const float pos = static_cast<float>(p.positions_int64 ? static_cast<const int64_t*>(p.positions)[pi]
                                                         : static_cast<const int32_t*>(p.positions)[pi]);
  float f[D / 64];
#pragma unroll
  for (int i = 0; i < D / 64; ++i) f[i] = p.inv_freq[lane + 32 * i];
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    cos_sin(pos * f[i], c[i], s[i]);
    c[i] = rnd<T>(c[i]);
    s[i] = rnd<T>(s[i]);
  }
}

// kQRope's step 5: the CTA stores its rounded q_proj tile to the workspace; the last of a head's CTAs to
// finish (a counter) applies q_norm and RoPE to the head for the live tokens of the tile, a warp per
// token, lane holding elements lane + 32 i (an element's neox partner, j + D/2 mod D, in the same lane).
// What does not depend on the other CTAs' tiles, the lane's q_norm weights and the angles of the warp's
// first token, is loaded and computed before the election (whose atomic is an L2 round trip): after it,
// one wave of loads (the head) instead of a chain of them (the head, then the norm weights, then the
// position and each pair's inv_freq behind the previous pair's stores, which they might alias: 6 waves
// at D 256, 10 at D 512 in the sm_90 SASS).
template <class T, int D>
__device__ void q_rope_tail(const GlueParams& p, float (*tile)[kGlueRows + 1], int t0, int live, int* flag) {
  constexpr int NI = D / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile_n = blockIdx.x;
  T* ws = static_cast<T*>(p.workspace);
  for (int e = tid; e < live * kGlueRows; e += kThreads) {
    const int t = e / kGlueRows, r = e % kGlueRows;
    ws[static_cast<int64_t>(t0 + t) * p.N + glue_weight_row(GlueKind::kQRope, tile_n, r)] = from_float<T>(tile[t][r]);
  }
  const int head = tile_n * kGlueRows / D;  // D is a multiple of 32: a tile lies in one head
  int32_t* counter = p.counters + glue_split_counters(p.plan) + blockIdx.y * (p.N / D) + head;
  float w[NI], c[NI / 2], s[NI / 2];
#pragma unroll
  for (int i = 0; i < NI; ++i) w[i] = elem<T>(p.q_norm_weight, lane + 32 * i);
  if (warp < live) rope_angles<T, D>(p, t0 + warp, lane, c, s);
  if (!last_to_arrive(counter, D / kGlueRows, flag)) return;
  T* out = static_cast<T*>(p.out);
  for (int tl = warp; tl < live; tl += kMmaWarps) {
    const int64_t t = t0 + tl;
    if (tl != warp) rope_angles<T, D>(p, t, lane, c, s);
    const int64_t row = t * p.N + static_cast<int64_t>(head) * D;
    float q[NI];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      q[i] = to_float(__ldcg(ws + row + lane + 32 * i));  // other CTAs wrote it: L2, not L1
      ss += q[i] * q[i];
    }
    const float inv = rsqrtf(warp_sum(ss) / static_cast<float>(D) + p.eps);
#pragma unroll
    for (int i = 0; i < NI; ++i) q[i] = rnd<T>(q[i] * inv * w[i]);  // q_norm
    // the neox pair (j, j + D/2) shares its angle: element j gets q_j c - q_{j+D/2} s, its partner
    // q_{j+D/2} c + q_j s, each product and the sum rounded
#pragma unroll
    for (int i = 0; i < NI / 2; ++i) {
      const int j = lane + 32 * i;
      const float lo = q[i], hi = q[i + NI / 2];
      out[row + j] = from_float<T>(rnd<T>(lo * c[i]) + rnd<T>(-hi * s[i]));
      out[row + j + D / 2] = from_float<T>(rnd<T>(hi * c[i]) + rnd<T>(lo * s[i]));
    }
  }
  if (tid == 0) *counter = 0;
}

constexpr int kMlpCols = 16;  // m columns of a gate_up tile (glue_cols_per_tile)

// m of tile column c (< 16) for token row t: gate and up rounded, gelu_tanh(gate) rounded, the product
// rounded, where Hugging Face's MLP rounds.
template <class T>
__device__ __forceinline__ float gated(const float (*tile)[kGlueRows + 1], int t, int c) {
  return rnd<T>(rnd<T>(gelu_tanh(rnd<T>(tile[t][c]))) * rnd<T>(tile[t][c + kMlpCols]));
}

// The whole MLP's L2 prefetch before griddep_wait: this tile's 16 columns of down_weight (32 or 64 bytes
// of each row), a row a thread, up to kPrefetchLines rows a thread (1024 rows: every drafter's Hd).
template <class T>
__device__ __forceinline__ void prefetch_down_columns(const GlueParams& p) {
  if (p.down_weight == nullptr || blockIdx.z != 0) return;
  const T* col = static_cast<const T*>(p.down_weight) + int64_t{blockIdx.x} * kMlpCols;
#pragma unroll
  for (int j = 0; j < kPrefetchLines; ++j) {
    const int n = threadIdx.x + kThreads * j;
    if (n < p.down_N) prefetch_l2(col + n * p.down_weight_stride);
  }
}

template <class T>
using DownColumns = Packed<kVec16<T>, T>[kMlpCols / kVec16<T>];

// Row n of down_weight at this tile's columns [c0, c0 + cols), zeros past them and past down_N: 16-byte
// vectors when the slice is whole and aligned, elements otherwise.
template <class T>
__device__ __forceinline__ void load_down_columns(const GlueParams& p, int n, int64_t c0, int cols, DownColumns<T>& w) {
  constexpr int V = kVec16<T>;
  const T* row = static_cast<const T*>(p.down_weight) + n * p.down_weight_stride + c0;
  const bool vec = cols == kMlpCols && aligned16(row);
#pragma unroll
  for (int v = 0; v < kMlpCols / V; ++v) {
    if (n < p.down_N && vec) {
      load_packed<V>(row + v * V, w[v]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) w[v].e[e] = n < p.down_N && v * V + e < cols ? row[v * V + e] : from_float<T>(0.f);
    }
  }
}

// W consecutive fp32 partials written by other CTAs of this launch (L2, not L1): a float4 or one float.
template <int W>
__device__ __forceinline__ void load_partials(const float* p, float (&v)[W]) {
  if constexpr (W == 4) {
    const float4 q = __ldcg(reinterpret_cast<const float4*>(p));
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
    v[0] = __ldcg(p);
  }
}

// One level of the MLP's tree: store(e, sum_{j < count} src[j * stride + e]) for the flat elements e < n,
// summed in j order, W consecutive elements a thread (W = 4: float4 loads), the summands kChunk at a time,
// each chunk's loads issued together (predicated, not a remainder loop, which issued a group of 8 one
// load after another). 32 values in flight a thread: more spilled the one-m16-tile kernel (128 registers).
template <int W, class Store>
__device__ __forceinline__ void sum_level_w(const float* src, int64_t stride, int count, int n, Store store) {
  constexpr int kChunk = W == 4 ? 8 : 16;
  for (int e = threadIdx.x * W; e < n; e += kThreads * W) {
    float s[W] = {};
    for (int j0 = 0; j0 < count; j0 += kChunk) {
      float v[kChunk][W];
#pragma unroll
      for (int u = 0; u < kChunk; ++u)
        if (j0 + u < count) load_partials<W>(src + (j0 + u) * stride + e, v[u]);
#pragma unroll
      for (int u = 0; u < kChunk; ++u)
#pragma unroll
        for (int w = 0; w < W; ++w)
          if (j0 + u < count) s[w] += v[u][w];
    }
#pragma unroll
    for (int w = 0; w < W; ++w) store(e + w, s[w]);
  }
}

// A float a thread while the elements fit the threads (E2B at T = 1: a group of 16 in one wave), else
// float4 where the rows allow (down_N % 4 == 0, the workspace 16-byte aligned: `vec`): E2B at T = 4 sums
// a group in two waves of 8 and the groups in one, where a float at a time took four waves of each.
template <class Store>
__device__ __forceinline__ void sum_level(bool vec, const float* src, int64_t stride, int count, int n, Store store) {
  if (vec && n > kThreads) {
    sum_level_w<4>(src, stride, count, n, store);
  } else {
    sum_level_w<1>(src, stride, count, n, store);
  }
}

// kGateUp with down_weight, step 5 (the tree of glue_logic.h): the tile's m [live, 16] replaces gate in
// `tile`, times the tile's columns of down_weight, a row n per thread (their loads issued before m is
// computed), is the tile's fp32 partial [T, down_N]; the last tile of each group to arrive sums the
// group's partials, the last group the group sums, in a fixed order, rounded once into out.
template <class T>
__device__ void mlp_tail(const GlueParams& p, float (*tile)[kGlueRows + 1], int t0, int live, int* flag) {
  constexpr int V = kVec16<T>;
  const int tid = threadIdx.x, tile_n = blockIdx.x;
  const int64_t c0 = int64_t{tile_n} * kMlpCols;
  const int cols = static_cast<int>(min64(kMlpCols, p.N - c0));
  const int Nd = p.down_N;
  const int64_t TN = int64_t{p.T} * Nd;
  float* ws = static_cast<float*>(p.workspace);
  DownColumns<T> w;
  load_down_columns<T>(p, tid, c0, cols, w);
  for (int e = tid; e < live * kMlpCols; e += kThreads) {
    const int t = e / kMlpCols, c = e % kMlpCols;
    tile[t][c] = c < cols ? gated<T>(tile, t, c) : 0.f;
  }
  __syncthreads();
  for (int n0 = 0; n0 < Nd; n0 += kThreads) {
    const int n = n0 + tid;
    if (n0 > 0) load_down_columns<T>(p, n, c0, cols, w);
    for (int t = 0; t < live && n < Nd; ++t) {
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < kMlpCols; ++c) acc = fmaf(tile[t][c], to_float(w[c / V].e[c % V]), acc);
      ws[(tile_n * TN + int64_t{t0 + t} * Nd) + n] = acc;
    }
  }
  const int G = glue_mlp_group(p.plan.row_tiles), groups = glue_mlp_groups(p.plan.row_tiles);
  const int g = tile_n / G, members = min(G, p.plan.row_tiles - g * G);
  int32_t* counter = p.counters + glue_split_counters(p.plan) + int64_t{blockIdx.y} * (groups + 1);
  if (!last_to_arrive(counter + g, members, flag)) return;
  const int64_t i0 = int64_t{t0} * Nd;  // the token tile's rows of a flat [T, down_N]
  const int n = live * Nd;
  float* group_sums = ws + int64_t{p.plan.row_tiles} * TN;
  const bool vec = Nd % 4 == 0 && aligned16(ws);
  sum_level(vec, ws + int64_t{g} * G * TN + i0, TN, members, n,
            [&](int e, float s) { group_sums[g * TN + i0 + e] = s; });
  if (tid == 0) counter[g] = 0;
  if (!last_to_arrive(counter + groups, groups, flag)) return;
  T* out = static_cast<T*>(p.out);
  sum_level(vec, group_sums + i0, TN, groups, n,
            [&](int e, float s) { out[(t0 + e / Nd) * p.out_stride + e % Nd] = from_float<T>(s); });
  if (tid == 0) counter[groups] = 0;
}

// Steps 4-5: `tile` [kTok][33] holds the CTA's sum over its k range.
template <class T, GlueKind KIND, int kTok>
__device__ void finish(const GlueParams& p, float (*tile)[kGlueRows + 1], int t0, int live, int* flag) {
  const int tid = threadIdx.x;
  const int tile_n = blockIdx.x, ty = blockIdx.y;
  if (p.plan.splits > 1) {
    const int64_t W = static_cast<int64_t>(p.plan.row_tiles) * kGlueRows;
    const int64_t col0 = static_cast<int64_t>(tile_n) * kGlueRows;
    for (int e = tid; e < live * kGlueRows; e += kThreads) {
      const int t = e / kGlueRows, r = e % kGlueRows;
      p.partials[(static_cast<int64_t>(blockIdx.z) * p.T + t0 + t) * W + col0 + r] = tile[t][r];
    }
    int32_t* counter = p.counters + ty * p.plan.row_tiles + tile_n;
    if (!last_to_arrive(counter, p.plan.splits, flag)) return;
    for (int e = tid; e < live * kGlueRows; e += kThreads) {
      const int t = e / kGlueRows, r = e % kGlueRows;
      float sum = 0.f;
      for (int s = 0; s < p.plan.splits; ++s) sum += __ldcg(p.partials + (static_cast<int64_t>(s) * p.T + t0 + t) * W + col0 + r);
      tile[t][r] = sum;
    }
    if (tid == 0) *counter = 0;
    __syncthreads();
  }
  T* out = static_cast<T*>(p.out);
  if constexpr (KIND == GlueKind::kLinear) {
    for (int e = tid; e < live * kGlueRows; e += kThreads) {
      const int t = e / kGlueRows, r = e % kGlueRows;
      const int64_t col = glue_weight_row(KIND, tile_n, r);
      if (col < p.N) out[(t0 + t) * p.out_stride + col] = from_float<T>(tile[t][r]);
    }
  } else if constexpr (KIND == GlueKind::kGateUp) {
    if (p.down_weight != nullptr) {
      mlp_tail<T>(p, tile, t0, live, flag);
      return;
    }
    for (int e = tid; e < live * kMlpCols; e += kThreads) {
      const int t = e / kMlpCols, c = e % kMlpCols;
      const int64_t col = glue_weight_row(KIND, tile_n, c);
      if (col < p.N) out[(t0 + t) * p.out_stride + col] = from_float<T>(gated<T>(tile, t, c));
    }
  } else {
    switch (p.D) {
      case 64: q_rope_tail<T, 64>(p, tile, t0, live, flag); break;
      case 128: q_rope_tail<T, 128>(p, tile, t0, live, flag); break;
      case 256: q_rope_tail<T, 256>(p, tile, t0, live, flag); break;
      default: q_rope_tail<T, 512>(p, tile, t0, live, flag); break;
    }
  }
}

// The k range of this CTA's split, in elements: [k_lo, k_hi) with k_hi a step boundary (may pass H).
__device__ __forceinline__ void split_range(const GlueParams& p, int& s_lo, int& s_end) {
  const int steps = max(1, static_cast<int>(ceil_div(p.H, kMmaStepK)));
  s_lo = blockIdx.z * p.plan.steps_per_split;
  s_end = min(steps, s_lo + p.plan.steps_per_split);
}

// ---------------------------------------------------------------- tensor-core path (bf16 / fp16)

template <class T, GlueKind KIND, int MT>
__global__ void __launch_bounds__(kThreads, MT == 1 ? 2 : 1) mma_kernel(GlueParams p) {
  constexpr int kTok = 16 * MT;
  constexpr int U = MT == 1 ? 4 : 2;  // steps of weight loads in flight per warp
  // prologue vectors per thread held in registers: at one m16 tile (two CTAs per SM, <= 128 registers)
  // 2, and 1 for q_rope, whose epilogue needs more registers beside them (ptxas spills with 2)
  constexpr int kCache = MT > 1 ? 4 : KIND == GlueKind::kQRope ? 1 : 2;
  __shared__ float inv_x[kTok], inv_h[kTok], red_s[kMmaWarps];
  __shared__ float red[kMmaWarps / 2][kMmaAccRegs<MT>][32];
  __shared__ float tile[kTok][kGlueRows + 1];
  __shared__ int flag;
  T* stage = reinterpret_cast<T*>(dynamic_smem());
  const int stride = glue_stage_stride(p.plan.steps_per_split);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * kTok, live = min(kTok, p.T - t0);
  int s_lo, s_end;
  split_range(p, s_lo, s_end);
  const int k_lo = s_lo * kMmaStepK, k_hi = s_end * kMmaStepK;

  prefetch_weight_rows(weight_row<T, KIND>(p, threadIdx.x & 31), k_lo, min(k_hi, p.H));  // step 1
  if constexpr (KIND == GlueKind::kGateUp) prefetch_down_columns<T>(p);
  griddep_wait();  // x, the residual and the norm weights may be the previous kernel's output
  griddep_launch_dependents();

  const Prologue<T> pr = make_prologue<T>(p);
  // kLinear only: the other kernels, at the edge of their registers, spilled with the second path
  if (KIND == GlueKind::kLinear && !pr.res && !pr.norm && p.residual_out == nullptr && p.normed_out == nullptr) {
    stage_k_range(p, t0, live, stage, stride, k_lo, k_hi);
  } else {
    prologue_rows<8, kCache>(p, pr, t0, live, inv_x, inv_h, red_s, stage, stride, k_lo, k_hi);
  }
  __syncthreads();

  const int g = mma_b_row(lane), lk = mma_lane_k(lane);
  const T* wrow[kMmaRowTiles];
#pragma unroll
  for (int nt = 0; nt < kMmaRowTiles; ++nt) wrow[nt] = weight_row<T, KIND>(p, nt * 8 + g);
  float acc[MT][kMmaRowTiles][4] = {};

  for (int s0 = s_lo + warp; s0 < s_end; s0 += kMmaWarps * U) {
    uint4 wf[U][kMmaRowTiles];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s0 + u * kMmaWarps) * kMmaStepK + lk;
      load_gemv_weights(wf[u], wrow, k, s0 + u * kMmaWarps < s_end && k < p.H);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = (s0 + u * kMmaWarps) * kMmaStepK + lk;
      if (s0 + u * kMmaWarps >= s_end) break;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int ra = mt * 16 + mma_a_row(lane, 0), rb = mt * 16 + mma_a_row(lane, 1);
        const bool in_h = k < p.H;
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        const uint4 a_lo = in_h && ra < live ? *reinterpret_cast<const uint4*>(stage + ra * stride + (k - k_lo)) : zero;
        const uint4 a_hi = in_h && rb < live ? *reinterpret_cast<const uint4*>(stage + rb * stride + (k - k_lo)) : zero;
        mma_gemv_step<T>(acc[mt], a_lo, a_hi, wf[u]);
      }
    }
  }
  sum_warp_tiles<MT>(acc, red);  // then warp 0 writes the tile
  if (warp == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kMmaRowTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) tile[mt * 16 + mma_c_token(lane, c)][nt * 8 + mma_c_row(lane, c)] = acc[mt][nt][c];
  }
  __syncthreads();
  finish<T, KIND, kTok>(p, tile, t0, live, &flag);
}

// ---------------------------------------------------------------- CUDA-core path (fp32, unaligned rows)

// The same tiles: warp w owns tile rows 4w..4w+3, its lanes split the k range element by element, 8
// tokens per pass; n is computed per element from x and the shared statistics.
template <class T, GlueKind KIND>
__global__ void __launch_bounds__(kThreads, 1) scalar_kernel(GlueParams p) {
  constexpr int kTok = 64, kPass = 8, kRowsPerWarp = kGlueRows / kMmaWarps;
  __shared__ float inv_x[kTok], inv_h[kTok], red_s[kMmaWarps];
  __shared__ float tile[kTok][kGlueRows + 1];
  __shared__ int flag;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tok_tile = 16 * p.plan.token_tiles_m16;
  const int t0 = blockIdx.y * tok_tile, live = min(tok_tile, p.T - t0);
  int s_lo, s_end;
  split_range(p, s_lo, s_end);
  const int k_lo = s_lo * kMmaStepK, k_hi = min(s_end * kMmaStepK, p.H);

  prefetch_weight_rows(weight_row<T, KIND>(p, threadIdx.x & 31), k_lo, k_hi);
  if constexpr (KIND == GlueKind::kGateUp) prefetch_down_columns<T>(p);
  griddep_wait();
  griddep_launch_dependents();

  const Prologue<T> pr = make_prologue<T>(p);
  prologue_rows<1, 4>(p, pr, t0, live, inv_x, inv_h, red_s, static_cast<T*>(nullptr), 0, 0, 0);
  __syncthreads();

  const T* wrow[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) wrow[i] = weight_row<T, KIND>(p, warp * kRowsPerWarp + i);
  for (int tp = 0; tp < live; tp += kPass) {
    float acc[kRowsPerWarp * kPass] = {};
    for (int k = k_lo + lane; k < k_hi; k += 32) {
      float w[kRowsPerWarp];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) w[i] = wrow[i] != nullptr ? to_float(wrow[i][k]) : 0.f;
      const float rw = pr.res ? elem<T>(p.residual_norm_weight, k) : 0.f;
      const float nw = pr.norm ? elem<T>(p.norm_weight, k) : 0.f;
#pragma unroll
      for (int j = 0; j < kPass; ++j) {
        if (tp + j >= live) break;
        const int64_t t = t0 + tp + j;
        const float x = elem<T>(p.x, t * p.x_stride + k);
        const float r = pr.res ? elem<T>(p.residual, t * p.residual_stride + k) : 0.f;
        const float n = pr.n(pr.h(x, r, rw, inv_x[tp + j]), nw, inv_h[tp + j]);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) acc[i * kPass + j] = fmaf(w[i], n, acc[i * kPass + j]);
      }
    }
    // lane c ends with the warp's sum of acc[c]: row 4 warp + c / 8, token tp + c % 8
    const float s = warp_transpose_sum(acc, lane);
    if (tp + lane % kPass < live) tile[tp + lane % kPass][warp * kRowsPerWarp + lane / kPass] = s;
  }
  __syncthreads();
  finish<T, KIND, kTok>(p, tile, t0, live, &flag);
}

// Whether a launch takes the tensor-core path: bf16 / fp16 with every row it reads in 16-byte vectors
// starting 16-byte aligned (pointers, row strides, H), and the outputs it writes in vectors too.
template <class T>
bool uses_mma(const GlueParams& p) {
  if constexpr (sizeof(T) != 2) {
    return false;
  } else {
    constexpr int V = kVec16<T>;
    bool ok = p.H % V == 0 && p.x_stride % V == 0 && host_aligned16(p.x) && host_aligned16(p.weight) &&
              p.weight_stride % V == 0;
    if (p.residual != nullptr)
      ok = ok && host_aligned16(p.residual) && p.residual_stride % V == 0 && host_aligned16(p.residual_norm_weight);
    if (p.norm_weight != nullptr) ok = ok && host_aligned16(p.norm_weight);
    if (p.kind == GlueKind::kGateUp) ok = ok && host_aligned16(p.up_weight) && p.up_weight_stride % V == 0;
    if (p.residual_out != nullptr) ok = ok && host_aligned16(p.residual_out) && p.residual_out_stride % V == 0;
    if (p.normed_out != nullptr) ok = ok && host_aligned16(p.normed_out) && p.normed_out_stride % V == 0;
    return ok;
  }
}

template <class T, GlueKind KIND>
cudaError_t launch_kind(const GlueParams& p, cudaStream_t stream) {
  DeviceInfo dev;
  cudaError_t err = device_info(&dev);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.plan.row_tiles), static_cast<unsigned>(p.plan.token_tiles),
                  static_cast<unsigned>(p.plan.splits));
  if (uses_mma<T>(p)) {
    if constexpr (sizeof(T) == 2) {
      const size_t smem = static_cast<size_t>(glue_stage_bytes(p.plan, p.T));
      auto run = [&](auto mt) {
        constexpr auto kernel = mma_kernel<T, KIND, decltype(mt)::value>;
        cudaError_t e = opt_in_smem<kernel>(static_cast<int>(smem));
        return e != cudaSuccess ? e : launch(kernel, grid, kThreads, smem, dev.pdl, stream, p);
      };
      switch (p.plan.token_tiles_m16) {
        case 1: return run(std::integral_constant<int, 1>{});
        case 2: return run(std::integral_constant<int, 2>{});
        default: return run(std::integral_constant<int, 4>{});
      }
    }
  }
  return launch(scalar_kernel<T, KIND>, grid, kThreads, 0, dev.pdl, stream, p);
}

// What every launch needs of p beyond the public ops' checks (a C++ caller's mistakes are refused,
// not run): a plan, its buffers, and for kQRope the head layout and its inputs.
inline bool params_ok(const GlueParams& p, GlueKind kind) {
  if (p.kind != kind || p.H < 0 || p.plan.splits < 1 || p.plan.steps_per_split < 1 || p.plan.row_tiles < 1 ||
      p.plan.token_tiles < 1 || (p.plan.splits > 1 && (p.partials == nullptr || p.counters == nullptr)) ||
      p.x == nullptr || p.weight == nullptr || p.out == nullptr ||
      (p.residual != nullptr && p.residual_norm_weight == nullptr))
    return false;
  if (kind == GlueKind::kGateUp)
    return p.up_weight != nullptr &&
           (p.down_weight == nullptr || (p.down_N >= 1 && p.workspace != nullptr && p.counters != nullptr));
  if (kind == GlueKind::kQRope)
    return (p.D == 64 || p.D == 128 || p.D == 256 || p.D == 512) && p.N % p.D == 0 && p.per_pos >= 1 &&
           p.workspace != nullptr && p.counters != nullptr && p.q_norm_weight != nullptr && p.positions != nullptr &&
           p.inv_freq != nullptr;
  return true;
}

template <class T, GlueKind KIND>
cudaError_t run(const GlueParams& p, cudaStream_t stream) {
  if (p.T <= 0 || p.N <= 0) return cudaSuccess;
  if (!params_ok(p, KIND)) return cudaErrorInvalidValue;
  return launch_kind<T, KIND>(p, stream);
}

}  // namespace glue

// Fills p.plan for a device with num_sms SMs and returns the buffers a launch needs: the bytes of fp32
// partials (p.partials), of the workspace (p.workspace: kQRope, kGateUp with down_weight) and, in
// *counters, the int32 counters (p.counters: zero before the first launch, left zero by every launch).
template <class T>
int64_t glue_prepare(GlueParams& p, int num_sms, int64_t* workspace_bytes, int64_t* counters) {
  p.plan = plan_glue(p.kind, p.T, p.H, p.N, num_sms, glue::uses_mma<T>(p));
  const int64_t heads = p.kind == GlueKind::kQRope && p.D > 0 ? p.N / p.D : 0;
  const bool mlp = p.kind == GlueKind::kGateUp && p.down_weight != nullptr;
  *counters = glue_counters(p.kind, p.plan, heads) + (mlp ? glue_mlp_counters(p.plan) : 0);
  *workspace_bytes = p.kind == GlueKind::kQRope ? static_cast<int64_t>(p.T) * p.N * static_cast<int64_t>(sizeof(T))
                     : mlp                      ? 4 * glue_mlp_workspace_floats(p.plan, p.T, p.down_N)
                                                : 0;
  return p.plan.splits > 1 ? int64_t{4} * p.plan.splits * p.T * p.plan.row_tiles * kGlueRows : 0;
}

// Launch the op of p.kind for element type T (float, __half, __nv_bfloat16) after glue_prepare(p).
template <class T>
cudaError_t rms_norm_linear(const GlueParams& p, cudaStream_t stream) {
  return glue::run<T, GlueKind::kLinear>(p, stream);
}
template <class T>
cudaError_t rms_norm_gate_up(const GlueParams& p, cudaStream_t stream) {
  return glue::run<T, GlueKind::kGateUp>(p, stream);
}
template <class T>
cudaError_t rms_norm_q_rope(const GlueParams& p, cudaStream_t stream) {
  return glue::run<T, GlueKind::kQRope>(p, stream);
}

}  // namespace gemma4_mtp
