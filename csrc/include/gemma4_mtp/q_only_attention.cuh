// Q-only paged attention (split-KV flash decoding for drafter queries).
//
// One CTA owns (request b, KV head h, a tile of up to kRows query rows, one split of the key range).
// The query rows of a tile are the Q queries x (Hq / Hkv) heads that share KV head h, so a K/V block is
// streamed from memory once per call whenever Q * Hq / Hkv <= kRows (every drafter step). K/V tiles of
// kKeys keys move by 16-byte cp.async into a double buffer while the previous tile is consumed.
// Only block-table columns inside the attended (windowed) range are read. Splits write (out, lse)
// partials in fp32 that a merge kernel combines; with one split the CTA writes the output directly.
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/plan.h"

namespace gemma4_mtp {
namespace attention {

constexpr int kThreads = 128;
constexpr int kRows = 8;   // query rows per CTA
constexpr int kKeys = 16;  // keys per K/V tile; kRows * kKeys == kThreads (one score per thread)
constexpr int kRowsPerWarp = kRows / (kThreads / 32);
static_assert(kRowsPerWarp * kKeys == 32, "one score per lane after the transposing reduction");
constexpr int kMinChunk = 64;
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows * kKeys == kThreads, "softmax update maps one thread to one (row, key)");

template <class T, int D>
struct Smem {
  T k[2][kKeys][D];
  T v[2][kKeys][D];
  float p[kRows][kKeys];
  float m[kRows];  // running max, log2 units
  float l[kRows];  // running sum
  float alpha[kRows];
};

// Workspace floats for num_splits > 1: partial outputs [B, Q, Hq, splits, D] then lse [B, Q, Hq, splits].
inline int64_t workspace_floats(int64_t B, int64_t Q, int64_t Hq, int64_t D, int64_t splits) {
  return splits > 1 ? B * Q * Hq * splits * (D + 1) : 0;
}

// Issues the copies of one K/V tile; returns whether a block id among them was out of range.
template <class T, int D>
__device__ __forceinline__ bool load_tile(Smem<T, D>& sm, int buf, const AttentionParams& p, int b, int h,
                                          int64_t tile_start, int64_t end) {
  bool any_bad = false;
  constexpr int VE = kVec16<T>;
  constexpr int NV = D / VE;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int c = threadIdx.x; c < kKeys * NV; c += kThreads) {
    const int key = c / NV, vec = c % NV;
    const int64_t pos = tile_start + key;
    bool valid = pos < end;
    int64_t blk = 0;
    if (valid) {
      blk = p.block_table[b * p.block_table_stride + pos / p.block_size];
      if (blk < 0 || blk >= p.num_blocks) {
        any_bad = true;
        valid = false;
      }
    }
    const int64_t slot = valid ? pos % p.block_size : 0;
    const T* ks = kc + (valid ? blk * p.k_stride[0] + slot * p.k_stride[1] + h * p.k_stride[2] + vec * VE : 0);
    const T* vs = vc + (valid ? blk * p.v_stride[0] + slot * p.v_stride[1] + h * p.v_stride[2] + vec * VE : 0);
    cp_async16(&sm.k[buf][key][vec * VE], ks, valid);
    cp_async16(&sm.v[buf][key][vec * VE], vs, valid);
  }
  return any_bad;
}

template <class T, int D>
__global__ void __launch_bounds__(kThreads, 3) kernel(AttentionParams p) {
  constexpr int VE = kVec16<T>;
  constexpr int NV = D / VE;                                  // 16-byte vectors per row
  constexpr int VPL = NV >= 32 ? NV / 32 : 1;                 // score phase: vectors per lane
  constexpr int RSTRIDE = kThreads / NV;                      // PV phase: threads per vector column
  constexpr int RPT = kRows / RSTRIDE > 0 ? kRows / RSTRIDE : 1;  // PV phase: rows per thread
  static_assert(NV <= kThreads, "one PV thread per vector column at least");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem<T, D>& sm = *reinterpret_cast<Smem<T, D>*>(smem_raw);
  __shared__ int bad_block;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = p.Hq / p.Hkv;
  const int M = p.Q * group;
  const int row_tiles = (M + kRows - 1) / kRows;
  // Row tiles of one (request, KV head) are adjacent in launch order so that their K/V reads meet in L2.
  const int row_tile = blockIdx.x % row_tiles, split = blockIdx.y;
  const int bh = blockIdx.x / row_tiles;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int row0 = row_tile * kRows;

  const int64_t len = p.seq_lens[b];
  const bool bad_len = len < 0 || len > static_cast<int64_t>(p.max_blocks) * p.block_size;
  const KeyRange full = attended_range(bad_len ? 0 : len, p.window);
  const KeyRange range =
      split_range(full, split, request_chunk(full.end - full.start, p.num_splits, kKeys, kMinChunk));

  // Warp w scores query rows 2w, 2w + 1 against every key of a tile; each lane keeps its slice of D of
  // both rows in registers (fp32, pre-multiplied by the scale, and by log2 e when there is no softcap
  // so that the softmax can use exp2), so only K is read from shared memory in the score phase.
  const float qmul = p.softcap > 0.f ? p.scale : p.scale * kLog2e;
  const T* qp = static_cast<const T*>(p.q);
  float qreg[kRowsPerWarp][VPL][VE];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int gr = row0 + warp * kRowsPerWarp + i;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int vec = lane + 32 * j;
      if (gr < M && vec < NV) {
        const int qi = gr / group, hq = h * group + gr % group;
        load_float<VE>(qp + b * p.q_stride[0] + qi * p.q_stride[1] + hq * p.q_stride[2] + vec * VE, qreg[i][j]);
#pragma unroll
        for (int e = 0; e < VE; ++e) qreg[i][j][e] *= qmul;
      } else {
#pragma unroll
        for (int e = 0; e < VE; ++e) qreg[i][j][e] = 0.f;
      }
    }
  }
  if (tid < kRows) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.f;
  }
  if (tid == 0) bad_block = 0;

  float acc[RPT][VE];
#pragma unroll
  for (int i = 0; i < RPT; ++i)
#pragma unroll
    for (int e = 0; e < VE; ++e) acc[i][e] = 0.f;
  const int vcol = tid % NV, rbase = tid / NV;

  bool any_bad = false;
  const int64_t n_tiles = range.end > range.start ? ceil_div(range.end - range.start, kKeys) : 0;
  if (n_tiles > 0) any_bad = load_tile(sm, 0, p, b, h, range.start, range.end);
  cp_async_commit();
  __syncthreads();  // m, l, bad_block

  for (int64_t it = 0; it < n_tiles; ++it) {
    const int buf = static_cast<int>(it & 1);
    if (it + 1 < n_tiles) any_bad |= load_tile(sm, buf ^ 1, p, b, h, range.start + (it + 1) * kKeys, range.end);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // Scores: warp w owns rows 2w, 2w + 1; lanes split D. The 2 x 16 partial dot products of a lane are
    // reduced across the warp with a transposing butterfly (31 shuffles, lane c ends with score c).
    const int64_t tile_start = range.start + it * kKeys;
    float part[kRowsPerWarp * kKeys];
#pragma unroll
    for (int key = 0; key < kKeys; ++key) {
      float kf[VPL][VE];
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int vec = lane + 32 * j;
        if (vec < NV) {
          load_float<VE>(&sm.k[buf][key][vec * VE], kf[j]);
        } else {
#pragma unroll
          for (int e = 0; e < VE; ++e) kf[j][e] = 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float acc_s = 0.f;
#pragma unroll
        for (int j = 0; j < VPL; ++j)
#pragma unroll
          for (int e = 0; e < VE; ++e) acc_s = fmaf(qreg[i][j][e], kf[j][e], acc_s);
        part[i * kKeys + key] = acc_s;
      }
    }
    {
      const float score = warp_transpose_sum(part, lane);
      const int i = lane / kKeys, key = lane % kKeys;
      float s = score;
      if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap) * kLog2e;
      sm.p[warp * kRowsPerWarp + i][key] = tile_start + key < range.end ? s : -INFINITY;
    }
    __syncthreads();

    // Online softmax: thread = (row r, key n); a row is 16 consecutive lanes of one warp.
    {
      const int r = tid / kKeys, n = tid % kKeys;
      const float s = sm.p[r][n];
      float tmax = s;
#pragma unroll
      for (int o = kKeys / 2; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o, kKeys));
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, tmax);
      float pr = 0.f, alpha = 1.f;
      if (m_new != -INFINITY) {
        pr = exp2f(s - m_new);
        alpha = exp2f(m_old - m_new);
      }
      float psum = pr;
#pragma unroll
      for (int o = kKeys / 2; o > 0; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o, kKeys);
      sm.p[r][n] = pr;
      __syncwarp();
      if (n == 0) {
        sm.l[r] = sm.l[r] * alpha + psum;
        sm.m[r] = m_new;
        sm.alpha[r] = alpha;
      }
    }
    __syncthreads();

    // P @ V: thread owns one 16-byte column of V for RPT rows.
    if (rbase < kRows) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const float a = sm.alpha[rbase + i * RSTRIDE];
#pragma unroll
        for (int e = 0; e < VE; ++e) acc[i][e] *= a;
      }
#pragma unroll 2
      for (int n = 0; n < kKeys; ++n) {
        float vf[VE];
        load_float<VE>(&sm.v[buf][n][vcol * VE], vf);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
          const float pr = sm.p[rbase + i * RSTRIDE][n];
#pragma unroll
          for (int e = 0; e < VE; ++e) acc[i][e] = fmaf(pr, vf[e], acc[i][e]);
        }
      }
    }
    __syncthreads();  // buffers and p are rewritten by the next tile
  }
  cp_async_wait<0>();

  if (any_bad) atomicOr(&bad_block, 1);
  __syncthreads();
  const bool poisoned = bad_len || bad_block;

  if (rbase < kRows) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = rbase + i * RSTRIDE;
      const int gr = row0 + r;
      if (gr >= M) continue;
      const int qi = gr / group, hq = h * group + gr % group;
      const float l = sm.l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? (sm.m[r] + log2f(l)) * kLn2 : -INFINITY;  // scores are in log2 units
      const int64_t orow = (static_cast<int64_t>(b) * p.Q + qi) * p.Hq + hq;
      if (p.num_splits == 1) {
        T* o = static_cast<T*>(p.out) + orow * D + vcol * VE;
#pragma unroll
        for (int e = 0; e < VE; ++e) o[e] = from_float<T>(poisoned ? NAN : acc[i][e] * inv);
        if (vcol == 0 && p.lse != nullptr) p.lse[orow] = poisoned ? NAN : lse;
      } else {
        float* wo = p.workspace + (orow * p.num_splits + split) * D + vcol * VE;
#pragma unroll
        for (int e = 0; e < VE; ++e) wo[e] = poisoned ? NAN : acc[i][e] * inv;
        if (vcol == 0) {
          float* wl = p.workspace + static_cast<int64_t>(p.B) * p.Q * p.Hq * p.num_splits * D;
          wl[orow * p.num_splits + split] = poisoned ? NAN : lse;
        }
      }
    }
  }
}

// Combines the splits of one (b, q, head) row: out = sum_s exp(lse_s - L) o_s, L = logsumexp lse_s.
template <class T>
__global__ void __launch_bounds__(kThreads) merge_kernel(AttentionParams p) {
  const int64_t orow = blockIdx.x;
  const int S = p.num_splits, D = p.D;
  const float* wo = p.workspace + orow * S * D;
  const float* wl = p.workspace + static_cast<int64_t>(p.B) * p.Q * p.Hq * S * D + orow * S;
  float L = -INFINITY;
  bool nan = false;
  for (int s = 0; s < S; ++s) {
    const float x = wl[s];
    nan |= x != x;
    L = fmaxf(L, x);
  }
  float total = 0.f;
  if (L != -INFINITY)
    for (int s = 0; s < S; ++s) total += expf(wl[s] - L);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    if (L != -INFINITY) {
      for (int s = 0; s < S; ++s) {
        const float w = expf(wl[s] - L);
        if (w > 0.f) o = fmaf(w, wo[static_cast<int64_t>(s) * D + d], o);
      }
      o /= total;
    }
    static_cast<T*>(p.out)[orow * D + d] = from_float<T>(nan ? NAN : o);
  }
  if (threadIdx.x == 0 && p.lse != nullptr)
    p.lse[orow] = nan ? NAN : (L == -INFINITY ? -INFINITY : L + logf(total));
}

template <class T, int D>
cudaError_t launch_d(const AttentionParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(Smem<T, D>);
  // The shared-memory opt-in is set once per device (the first launch), so that launches inside a
  // CUDA-graph capture make no configuration calls.
  constexpr int kMaxDevices = 64;
  static bool configured[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= kMaxDevices || !configured[dev]) {
    err = cudaFuncSetAttribute(kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    if (dev < kMaxDevices) configured[dev] = true;
  }
  const int M = p.Q * (p.Hq / p.Hkv);
  const dim3 grid(static_cast<unsigned>(ceil_div(M, kRows) * p.B * p.Hkv), static_cast<unsigned>(p.num_splits));
  kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  merge_kernel<T><<<static_cast<unsigned>(p.B * p.Q * p.Hq), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention

// The split plan for a call: depends only on shapes, the window and the SM count (see plan_kv_splits).
inline SplitPlan attention_plan(int B, int Q, int Hq, int Hkv, int max_blocks, int block_size, int64_t window,
                                int num_sms) {
  if (Hkv <= 0 || Hq % Hkv) return {1, attention::kKeys};  // refused by the launcher; no division by zero here
  int64_t bound = static_cast<int64_t>(max_blocks) * block_size;
  if (window > 0) bound = min64(bound, window);
  const int64_t base = static_cast<int64_t>(B) * Hkv * ceil_div(static_cast<int64_t>(Q) * (Hq / Hkv), attention::kRows);
  return plan_kv_splits(bound, base, num_sms, attention::kKeys, attention::kMinChunk, attention::kMaxSplits);
}

// Whether the cache/query layout allows the kernel's 16-byte loads and copies of q, K and V (all strides
// but D's a multiple of 16 bytes, 16-byte aligned bases). The kernel requires it. out is written with
// scalar stores and may sit at any element offset.
template <class T>
bool attention_layout_ok(const AttentionParams& p) {
  constexpr int V = kVec16<T>;
  for (int i = 0; i < 3; ++i)
    if (p.q_stride[i] % V || p.k_stride[i] % V || p.v_stride[i] % V) return false;
  return p.D % V == 0 && host_aligned16(p.q) && host_aligned16(p.k_cache) && host_aligned16(p.v_cache);
}

// Launches the attention for element type T (float, __half, __nv_bfloat16); p.num_splits comes from
// attention_plan() and p.workspace holds attention::workspace_floats() floats.
template <class T>
cudaError_t q_only_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.B <= 0 || p.Q <= 0 || p.Hq <= 0) return cudaSuccess;
  if (p.Hkv <= 0 || p.Hq % p.Hkv || p.block_size <= 0 || p.num_splits < 1 ||
      (p.num_splits > 1 && p.workspace == nullptr) || !attention_layout_ok<T>(p))
    return cudaErrorInvalidValue;
  switch (p.D) {
    case 64: return attention::launch_d<T, 64>(p, stream);
    case 128: return attention::launch_d<T, 128>(p, stream);
    case 256: return attention::launch_d<T, 256>(p, stream);
    case 512: return attention::launch_d<T, 512>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace gemma4_mtp
