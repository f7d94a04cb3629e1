// Q-only paged attention (split-KV flash decoding for drafter queries).
//
// Work unit: (request b, KV head h, a tile of the Q x Hq/Hkv query rows that share h, one split of the
// key range). The rows of a tile share every K/V byte, so a call streams each attended K/V row once per
// row tile, and there is one row tile whenever Q * Hq/Hkv <= 32 (bf16/fp16) -- every drafter step,
// tree levels included. Only block-table columns inside the attended (windowed) range are read. The
// split plan (plan.h attention_plan) sizes the grid to one wave of resident CTAs; with several splits
// each CTA writes an fp32 partial (normalised output, lse) and they are merged: by the last CTA of the
// unit's splits to finish, inside the attention kernel, when the unit's partials are small (plan.h
// attention_merges_in_kernel: at most 32 KiB, every drafter sliding layer at B = 1), saving a dependent
// launch; else by a merge kernel spread over many CTAs.
//
// bf16 / fp16: tensor-core kernel, one 256-thread CTA per SM.
//   - Pipeline: stages of 8192 / D keys (16 KiB of K + 16 KiB of V), as many as the SM's shared memory
//     holds (H100/H200: 6, 5 at 32 rows; A100: 4: 96-160 KiB in flight per SM, well above the ~30 KiB that
//     4 TB/s x ~1 us of DRAM latency needs per SM). Each K or V row of a stage is one contiguous
//     D-element run of the paged cache (any block size, any 16-byte strides): on sm_90 one
//     cp.async.bulk per row completing on the stage's mbarrier, on sm_80 16-byte cp.async (zero-filled
//     past the end). Block-table entries are loaded one stage ahead so the copies never wait on them.
//     Rows are 16 bytes longer than D so that ldmatrix reads them without bank conflicts.
//   - Math: warps split D into 64-column slices (D / 64 of them) and the stage's keys into groups of 16
//     (8 / (D / 64) groups). A warp computes its slice's part of S = Q K^T for its group's 16 keys with
//     mma.m16n8k16 (Q in registers as the A operand, 16 or 32 rows), the slices of a group are summed
//     through shared memory (each warp of the group sums the same values in the same order, so all of
//     them agree bit for bit on the softmax state), then the online softmax (exp2, fp32) and
//     O += P V on its 64 columns (P rounded to the input type, as tl.dot does in the Triton kernel).
//     One __syncthreads per stage. Key groups keep separate (m, l, O) and are combined at the end.
// fp32 (a test dtype): CUDA-core kernel, 8 rows x 16 keys per step, double-buffered cp.async.
// sm_90: the kernels and the merge kernel (when there is one) are launched with programmatic dependent
// launch, so the merge kernel is scheduled while the main grid runs and waits (griddepcontrol.wait) for
// it to finish. A merge inside the attention kernel needs no such wait: the group's last CTA elects
// itself through a counter (mma_gemv.cuh last_to_arrive) once the other CTAs' partials are published.
#pragma once

#include <cmath>

#include "gemma4_mtp/common.cuh"
#include "gemma4_mtp/launch.cuh"
#include "gemma4_mtp/mma_gemv.cuh"
#include "gemma4_mtp/params.h"
#include "gemma4_mtp/plan.h"

namespace gemma4_mtp {
namespace attention {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Workspace floats for num_splits > 1: partial outputs [B, Q, Hq, splits, D] then lse [B, Q, Hq, splits].
inline int64_t workspace_floats(int64_t B, int64_t Q, int64_t Hq, int64_t D, int64_t splits) {
  return splits > 1 ? B * Q * Hq * splits * (D + 1) : 0;
}

// The CTA's share of the work: which request, KV head, rows and keys.
struct Work {
  int b, h, row0;  // request, KV head, first of this CTA's rows (row r: query r / group, head h * group + r % group)
  int M, group;    // rows of the unit (Q * group), Hq / Hkv
  KeyRange range;  // the keys of this split
  bool bad_len;    // seq_len outside [0, max_blocks * block_size]: output NaN, nothing read
};

__device__ __forceinline__ Work cta_work(const AttentionParams& p, int rows_per_cta, int64_t tile) {
  Work w;
  w.group = p.Hq / p.Hkv;
  w.M = p.Q * w.group;
  const int row_tiles = (w.M + rows_per_cta - 1) / rows_per_cta;
  // The row tiles of one (request, KV head) are adjacent in launch order so that their K/V reads meet in L2.
  const int bh = blockIdx.x / row_tiles;
  w.row0 = (blockIdx.x % row_tiles) * rows_per_cta;
  w.b = bh / p.Hkv;
  w.h = bh % p.Hkv;
  const int64_t len = p.seq_lens[w.b];
  w.bad_len = len < 0 || len > static_cast<int64_t>(p.max_blocks) * p.block_size;
  const KeyRange full = attended_range(w.bad_len ? 0 : len, p.window);
  w.range = split_range(full, blockIdx.y,
                        request_chunk(full.end - full.start, p.num_splits, tile, kAttentionMinTiles * tile));
  return w;
}

// The (b, q, head) row of out / lse that the CTA's row r is.
__device__ __forceinline__ int64_t out_row(const AttentionParams& p, const Work& w, int r) {
  const int gr = w.row0 + r;
  return (static_cast<int64_t>(w.b) * p.Q + gr / w.group) * p.Hq + w.h * w.group + gr % w.group;
}

// ------------------------------------------------------------------------------------------------
// Merge of the splits: out = sum_s exp(lse_s - L) o_s / sum_s exp(lse_s - L), lse = L + log(sum), with
// L = max_s lse_s. -inf partials (empty splits) weigh 0, a NaN lse (a poisoned request) makes the row
// NaN, a row without keys gets out 0 and lse -inf. The merge kernel runs it for one row and 128
// columns per CTA; the attention kernels' in-kernel merge for the group's rows and every column.
// ------------------------------------------------------------------------------------------------

// Partials a merge_splits thread loads at once (float4 each: 32 registers).
constexpr int kMergeBatch = 8;

// Shared floats of merge_splits for `rows` rows with row_splits partials (rows x splits) in all.
constexpr int merge_scratch_floats(int threads, int rows, int row_splits) { return 4 * threads + row_splits + 3 * rows; }

// Merges columns [col0, col0 + cols) of rows orow(0 .. rows - 1) of out (their lse too when write_lse)
// over p.num_splits partials; every thread of the kThreads-thread CTA calls it, `scratch` is 16-byte
// aligned shared memory of merge_scratch_floats(). All lse are loaded at once, then the partials,
// kMergeBatch a thread at once: two L2 latencies per call up to kMergeBatch splits a thread (a 128-split
// merge kernel's 16: three). Partials are read with .cg loads (the in-kernel merge reads
// other CTAs' writes; L1 is not coherent). A float4 column of a row is one item; when there are fewer
// items than threads, `ways` threads share an item, each taking every ways-th split, and their sums
// meet in shared memory in way order (the merge kernel at 128 columns: lane = item, warp = way).
template <class T, int kThreads, class RowOf>
__device__ __forceinline__ void merge_splits(const AttentionParams& p, int rows, RowOf orow, int col0, int cols,
                                             bool write_lse, float* scratch) {
  static_assert(kThreads % 32 == 0, "whole warps");
  constexpr int kWarps = kThreads / 32;
  const int S = p.num_splits, D = p.D;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* wl = p.workspace + static_cast<int64_t>(p.B) * p.Q * p.Hq * S * D;
  float4* red = reinterpret_cast<float4*>(scratch);  // [kThreads]: the ways' sums
  float* weight = scratch + 4 * kThreads;            // [rows][S]: the lse, then the weights
  float* row_max = weight + rows * S;
  float* row_total = row_max + rows;
  int* row_nan = reinterpret_cast<int*>(row_total + rows);

  for (int i = tid; i < rows * S; i += kThreads) weight[i] = __ldcg(wl + orow(i / S) * S + i % S);
  __syncthreads();
  for (int r = warp; r < rows; r += kWarps) {  // a warp per row: max, NaN, weights, their sum
    float mx = -INFINITY;
    int nan = 0;
    for (int s = lane; s < S; s += 32) {
      const float x = weight[r * S + s];
      mx = fmaxf(mx, x);
      nan |= x != x;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    float total = 0.f;
    for (int s = lane; s < S; s += 32) {
      const float wgt = mx != -INFINITY ? expf(weight[r * S + s] - mx) : 0.f;  // -inf partials weigh 0
      weight[r * S + s] = wgt;
      total += wgt;
    }
    total = warp_sum(total);
    if (lane == 0) {
      row_max[r] = mx;
      row_total[r] = total;
      row_nan[r] = nan;
    }
  }
  __syncthreads();

  const int vecs = cols / 4, items = rows * vecs;
  const int ways = items < kThreads ? kThreads / items : 1;
  auto store = [&](int item, float4 o) {
    const int r = item / vecs, c = col0 + item % vecs * 4;
    const float total = row_total[r];
    const bool nan = row_nan[r];
    const float v[4] = {o.x, o.y, o.z, o.w};
    T* dst = static_cast<T*>(p.out) + orow(r) * D + c;  // out may sit at any element offset: scalar stores
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[e] = from_float<T>(nan ? NAN : (total > 0.f ? v[e] / total : 0.f));
  };
  for (int i = tid; i < items * ways; i += kThreads) {  // ways > 1: one pass
    const int item = i % items, way = i / items;
    const int r = item / vecs;
    const float* src = p.workspace + orow(r) * S * D + col0 + item % vecs * 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    // kMergeBatch partials loaded before any is added (every split wrote its partial, so the loads need no
    // weight): a load guarded by its weight kept each behind the previous split's adds, one L2 round trip
    // per split (sm_90 SASS: 8 in a sliding layer's in-kernel merge, 16 a thread in the merge kernel of a
    // 128-split full layer). Added in split order, a weight-0 split skipped, as before.
    for (int s0 = way; s0 < S; s0 += kMergeBatch * ways) {
      float4 v[kMergeBatch];
      float wv[kMergeBatch];
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {  // past the last split: the last one again (unpredicated
        const int s = min(s0 + j * ways, S - 1);  // loads, which ptxas issues together), weighed 0
        wv[j] = s0 + j * ways < S ? weight[r * S + s] : 0.f;
        v[j] = __ldcg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(s) * D));
      }
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        if (wv[j] > 0.f) {
          o.x = fmaf(wv[j], v[j].x, o.x);
          o.y = fmaf(wv[j], v[j].y, o.y);
          o.z = fmaf(wv[j], v[j].z, o.z);
          o.w = fmaf(wv[j], v[j].w, o.w);
        }
      }
    }
    if (ways == 1) {
      store(item, o);
    } else {
      red[i] = o;  // way * items + item
    }
  }
  if (ways > 1) {
    __syncthreads();
    if (tid < items) {
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int way = 0; way < ways; ++way) {
        const float4 v = red[way * items + tid];
        o.x += v.x;
        o.y += v.y;
        o.z += v.z;
        o.w += v.w;
      }
      store(tid, o);
    }
  }
  if (write_lse && p.lse != nullptr)
    for (int r = tid; r < rows; r += kThreads)
      p.lse[orow(r)] = row_nan[r] ? NAN : (row_total[r] > 0.f ? row_max[r] + logf(row_total[r]) : -INFINITY);
}

// The in-kernel merge (the launcher passes counters only then), after the CTA's partial stores: the
// last CTA of its group (the splits of blockIdx.x) to arrive resets the group's counter for the next
// launch and merges the group's `rows` rows. flag: a shared int; scratch: shared memory free from the
// election's first __syncthreads on.
template <class T, int kThreads>
__device__ __forceinline__ void merge_if_last(const AttentionParams& p, const Work& w, int rows, int* flag,
                                              float* scratch) {
  int32_t* counter = p.counters + blockIdx.x;
  if (!last_to_arrive(counter, p.num_splits, flag)) return;
  if (threadIdx.x == 0) *counter = 0;
  merge_splits<T, kThreads>(p, rows, [&](int r) { return out_row(p, w, r); }, 0, p.D, true, scratch);
}

// ------------------------------------------------------------------------------------------------
// bf16 / fp16: tensor-core kernel
// ------------------------------------------------------------------------------------------------
namespace tc {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kSliceCols = 64;  // head-dim columns per warp
constexpr int kGroupKeys = 16;  // keys per key group per stage (one mma k-step of P V)
constexpr int kMaxStages = 6;

template <int D>
struct Cfg {
  static_assert(D == 64 || D == 128 || D == 256 || D == 512, "head dims 64..512");
  static constexpr int kSlices = D / kSliceCols;          // warps along D
  static constexpr int kGroups = kWarps / kSlices;        // warps along keys
  static constexpr int kKeys = kGroupKeys * kGroups;      // keys per stage: 8192 / D
  static constexpr int kPitch = D * 2 + 16;               // bytes per shared K/V row
  static constexpr int kStageBytes = 2 * kKeys * kPitch;  // K rows, then V rows
  static constexpr int kCopyRows = 2 * kKeys;             // rows copied per stage
  static constexpr int kThreadsPerRow = kThreads / kCopyRows;  // D / 64: cp.async threads per row
  static constexpr int kChunksPerThread = D * 2 / 16 / kThreadsPerRow;  // 16-byte cp.async per thread: 8
  static_assert(kKeys * D == 8192 && kThreadsPerRow * kCopyRows == kThreads, "stage geometry");
};

// Shared memory after the stages: S exchange (double buffered), per-group softmax state, mbarriers, flag.
template <int D, int MT>
struct Layout {
  static constexpr int kExchangeFloats = Cfg<D>::kSlices > 1 ? 2 * kWarps * MT * 2 * 32 * 4 : 0;
  static constexpr int kStatFloats = Cfg<D>::kGroups * 16 * MT * 2;
  static constexpr int kRedPitch = D + 8;  // floats per row of the epilogue's group reduction (no bank conflicts)
  static constexpr int kRedBytes = Cfg<D>::kGroups * 16 * MT * kRedPitch * 4;
  static constexpr int kTailBytes = (kExchangeFloats + kStatFloats) * 4 + kMaxStages * 8 + 16;
  static_assert(kRedBytes <= 3 * Cfg<D>::kStageBytes, "the epilogue reuses three stages");
  static constexpr size_t bytes(int stages) {
    return static_cast<size_t>(stages) * Cfg<D>::kStageBytes + kTailBytes;
  }
};

template <class T, int D, int MT>
__global__ void __launch_bounds__(kThreads, 1) kernel(const AttentionParams p, const int stages) {
  using C = Cfg<D>;
  using L = Layout<D, MT>;
  constexpr int R = 16 * MT;  // rows per CTA
  unsigned char* const smem = dynamic_smem();
  unsigned char* stage_mem = smem;
  float4* xchg = reinterpret_cast<float4*>(smem + static_cast<size_t>(stages) * C::kStageBytes);
  float* stat = reinterpret_cast<float*>(xchg) + L::kExchangeFloats;
  uint64_t* bars = reinterpret_cast<uint64_t*>(stat + L::kStatFloats);
  int* bad_flag = reinterpret_cast<int*>(bars + kMaxStages);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Shared memory only, so before the wait (under PDL while the previous kernel still runs): the stages'
  // mbarriers and the bad-block flag; the __syncthreads after the Work publishes them.
  if (tid == 0) {
    if constexpr (kHasBulkCopy) {
      for (int s = 0; s < stages; ++s) mbarrier_init(&bars[s], C::kCopyRows);
      fence_mbarrier_init();
    }
    *bad_flag = 0;
  }
  griddep_wait();               // q, the cache, the table and seq_lens may come from the previous kernel
  griddep_launch_dependents();  // the merge may be scheduled now; it waits for this grid to finish

  const int slice = warp % C::kSlices, grp = warp / C::kSlices;
  const int quad = lane & 3, lrow = lane >> 2;
  const Work w = cta_work(p, R, C::kKeys);
  const int64_t n_tiles = w.range.end > w.range.start ? ceil_div(w.range.end - w.range.start, C::kKeys) : 0;

  // ---- the copies: thread -> (stage row, part of it); rows [0, kKeys) are K, [kKeys, 2 kKeys) V ----
  const int crow = tid / C::kThreadsPerRow, cpart = tid % C::kThreadsPerRow;
  const bool is_v = crow >= C::kKeys;
  const int ckey = crow % C::kKeys;
  const T* cache = static_cast<const T*>(is_v ? p.v_cache : p.k_cache);
  const int64_t cs0 = is_v ? p.v_stride[0] : p.k_stride[0], cs1 = is_v ? p.v_stride[1] : p.k_stride[1],
                cs2 = is_v ? p.v_stride[2] : p.k_stride[2];
  const int32_t* table_row = p.block_table + static_cast<int64_t>(w.b) * p.block_table_stride;
  bool any_bad = false;
  // The raw table entry for this thread's row of tile t (INT64_MIN: the row is past the range's end).
  auto lookup = [&](int64_t t) -> int64_t {
    const int64_t pos = w.range.start + t * C::kKeys + ckey;
    if (t >= n_tiles || pos >= w.range.end) return INT64_MIN;
    return table_row[static_cast<int>(pos) / p.block_size];
  };
  auto issue = [&](int64_t t, int st, int64_t raw) {
    const int64_t pos = w.range.start + t * C::kKeys + ckey;
    bool valid = raw != INT64_MIN;
    if (valid && (raw < 0 || raw >= p.num_blocks)) {
      any_bad = true;  // never dereferenced; the request's output becomes NaN
      valid = false;
    }
    const T* src = valid ? cache + raw * cs0 + (pos % p.block_size) * cs1 + static_cast<int64_t>(w.h) * cs2
                         : cache;
    unsigned char* dst = stage_mem + static_cast<size_t>(st) * C::kStageBytes + crow * C::kPitch;
    if constexpr (kHasBulkCopy) {
      if (cpart == 0) {
        mbarrier_arrive_expect_tx(&bars[st], valid ? D * 2 : 0);
        if (valid) bulk_copy_g2s(dst, src, D * 2, &bars[st]);
      }
      // A row left out (past the range's end, or a bad block) has its score masked and its P exactly 0,
      // but P V multiplies its V row, which must be finite: its threads zero it (the K row may hold
      // anything). The fence orders these generic stores before a later bulk copy into the row; the
      // row is read >= 1 __syncthreads later (stages >= 3). Zeroing only such rows, here, replaces a
      // zero fill of every stage before the first copy (~200 KiB of shared stores, ~0.8 us at the
      // start of every CTA).
      if (!valid && is_v) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int j = 0; j < C::kChunksPerThread; ++j)
          reinterpret_cast<uint4*>(dst)[j * C::kThreadsPerRow + cpart] = zero;
        fence_proxy_async_shared();
      }
    } else {
#pragma unroll 1  // registers: the 32-row kernel at D 512 is at the limit
      for (int j = 0; j < C::kChunksPerThread; ++j) {
        const int c = j * C::kThreadsPerRow + cpart;  // 16-byte chunk of the row
        cp_async16(dst + c * 16, valid ? src + c * (16 / sizeof(T)) : src, valid);
      }
      cp_async_commit();
    }
  };

  __syncthreads();  // the mbarriers and the flag

  // ---- Q fragments (A operand): rows of m-tile mt, k-step ks of this warp's slice ----
  const T* qp = static_cast<const T*>(p.q);
  uint32_t qa[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int gr = w.row0 + mt * 16 + lrow + 8 * hi;
      const T* qrow = nullptr;
      if (gr < w.M)
        qrow = qp + static_cast<int64_t>(w.b) * p.q_stride[0] + static_cast<int64_t>(gr / w.group) * p.q_stride[1] +
               static_cast<int64_t>(w.h * w.group + gr % w.group) * p.q_stride[2];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int d = slice * kSliceCols + ks * 16 + 2 * quad;
        qa[mt][ks][hi] = qrow ? *reinterpret_cast<const uint32_t*>(qrow + d) : 0u;
        qa[mt][ks][2 + hi] = qrow ? *reinterpret_cast<const uint32_t*>(qrow + d + 8) : 0u;
      }
    }
  }

  // ---- prologue: stages - 1 tiles in flight, the next tile's table entries loading ----
  // The table entries of the first `stages` tiles are loaded together (one latency, not one per tile);
  // raw[] is only indexed by unrolled constants, so it stays in registers.
  int64_t raw[kMaxStages - 1];
#pragma unroll
  for (int t = 0; t < kMaxStages - 1; ++t) raw[t] = t < stages - 1 ? lookup(t) : INT64_MIN;
  int64_t next_raw = lookup(stages - 1);
#pragma unroll
  for (int t = 0; t < kMaxStages - 1; ++t) {
    if (t < stages - 1) {
      if (t < n_tiles) {
        issue(t, t, raw[t]);
      } else if (!kHasBulkCopy) {
        cp_async_commit();  // keep one group per tile
      }
    }
  }
  if constexpr (!kHasBulkCopy) cp_async_wait_dyn(stages - 2);  // tile 0 landed (this thread's part)
  __syncthreads();

  float acc[MT][8][4];
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }
  const float qk_scale = p.softcap > 0.f ? p.scale / p.softcap : p.scale * kLog2e;
  const float cap = p.softcap * kLog2e;

  int st = 0;
  for (int64_t it = 0; it < n_tiles; ++it) {
    const unsigned char* kst = stage_mem + static_cast<size_t>(st) * C::kStageBytes;
    const unsigned char* vst = kst + C::kKeys * C::kPitch;
    if constexpr (kHasBulkCopy) mbarrier_wait(&bars[st], static_cast<unsigned>((it / stages) & 1));

    // Partial scores over this warp's slice: S[row][key] for keys grp * 16 + nt * 8 + [0, 8).
    float sc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t kb[4];  // B operand (K^T) for the two 8-key tiles: rows = keys, 8 columns per matrix
      ldmatrix_x4(kb, kst + (grp * kGroupKeys + (lane >> 4) * 8 + (lane & 7)) * C::kPitch +
                          (slice * kSliceCols + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_m16n8k16<T>(sc[mt][0], qa[mt][ks], {kb[0], kb[1]});
        mma_m16n8k16<T>(sc[mt][1], qa[mt][ks], {kb[2], kb[3]});
      }
    }
    float4* xb = xchg + (it & 1) * (kWarps * MT * 2 * 32);
    if constexpr (C::kSlices > 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          xb[((warp * MT + mt) * 2 + nt) * 32 + lane] =
              make_float4(sc[mt][nt][0], sc[mt][nt][1], sc[mt][nt][2], sc[mt][nt][3]);
    }
    if constexpr (!kHasBulkCopy) cp_async_wait_dyn(stages - 3);  // tile it + 1 landed (this thread's part)
    // Everyone is done with tile it - 1 (its stage may be refilled), the partial scores of tile it are
    // written, and (cp.async) tile it + 1 is visible.
    __syncthreads();
    if (it + stages - 1 < n_tiles) {
      issue(it + stages - 1, st == 0 ? stages - 1 : st - 1, next_raw);
      next_raw = lookup(it + stages);
    } else if (!kHasBulkCopy) {
      cp_async_commit();
    }

    if constexpr (C::kSlices > 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int sl = 0; sl < C::kSlices; ++sl) {
            const float4 v = xb[(((grp * C::kSlices + sl) * MT + mt) * 2 + nt) * 32 + lane];
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
          }
          sc[mt][nt][0] = s.x;
          sc[mt][nt][1] = s.y;
          sc[mt][nt][2] = s.z;
          sc[mt][nt][3] = s.w;
        }
    }

    // Online softmax in log2 units. Lane holds rows lrow (c0, c1) and lrow + 8 (c2, c3) of each m-tile
    // and keys 2 quad + {0, 1} of each 8-key tile; a row's 16 keys live in the 4 lanes of a quad.
    const int64_t key0 = w.range.start + it * C::kKeys + grp * kGroupKeys + 2 * quad;
    uint32_t pa[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        float s[4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = sc[mt][nt][2 * hi + e];
            x = p.softcap > 0.f ? cap * tanhf(x * qk_scale) : x * qk_scale;
            s[2 * nt + e] = key0 + nt * 8 + e < w.range.end ? x : -INFINITY;
          }
        float tmax = fmaxf(fmaxf(s[0], s[1]), fmaxf(s[2], s[3]));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m_run[mt][hi], tmax);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2f(m_run[mt][hi] - m_use);
        float pr[4], sum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pr[i] = exp2f(s[i] - m_use);
          sum += pr[i];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l_run[mt][hi] = l_run[mt][hi] * alpha + sum;
        m_run[mt][hi] = m_new;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[mt][j][2 * hi] *= alpha;
          acc[mt][j][2 * hi + 1] *= alpha;
        }
        // A operand of P V: (row, keys 0-7) = a0 / a1, (row, keys 8-15) = a2 / a3
        pa[mt][hi] = pack2<T>(pr[0], pr[1]);
        pa[mt][2 + hi] = pack2<T>(pr[2], pr[3]);
      }
    }

    // O[:, slice] += P V[group's 16 keys, slice]: B operand (V) by transposed ldmatrix, 16 columns per load.
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, vst + (grp * kGroupKeys + ((lane >> 3) & 1) * 8 + (lane & 7)) * C::kPitch +
                                (slice * kSliceCols + jj * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_m16n8k16<T>(acc[mt][2 * jj], pa[mt], {vb[0], vb[1]});
        mma_m16n8k16<T>(acc[mt][2 * jj + 1], pa[mt], {vb[2], vb[3]});
      }
    }
    st = st + 1 == stages ? 0 : st + 1;
  }
  if constexpr (!kHasBulkCopy) cp_async_wait<0>();

  // ---- epilogue: combine the key groups' (m, l, O) and write the rows ----
  if (slice == 0 && quad == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int r = mt * 16 + 8 * hi + lrow;
        stat[(grp * R + r) * 2] = m_run[mt][hi];
        stat[(grp * R + r) * 2 + 1] = l_run[mt][hi];
      }
  }
  if (any_bad) atomicOr(bad_flag, 1);
  __syncthreads();  // every copy has landed and been consumed: the stage memory is free
  float* red = reinterpret_cast<float*>(stage_mem);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = mt * 16 + 8 * hi + lrow;
      float mx = -INFINITY;
#pragma unroll
      for (int g = 0; g < C::kGroups; ++g) mx = fmaxf(mx, stat[(g * R + r) * 2]);
      const float f = m_run[mt][hi] == -INFINITY ? 0.f : exp2f(m_run[mt][hi] - mx);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = slice * kSliceCols + j * 8 + 2 * quad;
        *reinterpret_cast<float2*>(&red[(grp * R + r) * L::kRedPitch + col]) =
            make_float2(acc[mt][j][2 * hi] * f, acc[mt][j][2 * hi + 1] * f);
      }
    }
  __syncthreads();

  const bool poisoned = w.bad_len || *bad_flag;
  const int rows = min(R, w.M - w.row0);
  for (int i = tid; i < rows * (D / 4); i += kThreads) {
    const int r = i / (D / 4), c = (i % (D / 4)) * 4;
    float mx = -INFINITY;
#pragma unroll
    for (int g = 0; g < C::kGroups; ++g) mx = fmaxf(mx, stat[(g * R + r) * 2]);
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int g = 0; g < C::kGroups; ++g) {
      const float mg = stat[(g * R + r) * 2];
      l += mg == -INFINITY ? 0.f : stat[(g * R + r) * 2 + 1] * exp2f(mg - mx);
      const float4 v = *reinterpret_cast<const float4*>(&red[(g * R + r) * L::kRedPitch + c]);
      o.x += v.x;
      o.y += v.y;
      o.z += v.z;
      o.w += v.w;
    }
    const float inv = poisoned ? NAN : (l > 0.f ? 1.f / l : 0.f);
    const int64_t orow = out_row(p, w, r);
    if (p.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + orow * D + c;  // out may sit at any element offset: scalar stores
      dst[0] = from_float<T>(o.x * inv);
      dst[1] = from_float<T>(o.y * inv);
      dst[2] = from_float<T>(o.z * inv);
      dst[3] = from_float<T>(o.w * inv);
    } else {
      *reinterpret_cast<float4*>(p.workspace + (orow * p.num_splits + blockIdx.y) * D + c) =
          make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    }
    if (c == 0) {
      const float lse = poisoned ? NAN : (l > 0.f ? (mx + log2f(l)) * kLn2 : -INFINITY);  // log2 units -> ln
      if (p.num_splits == 1) {
        if (p.lse != nullptr) p.lse[orow] = lse;
      } else {
        p.workspace[static_cast<int64_t>(p.B) * p.Q * p.Hq * p.num_splits * D + orow * p.num_splits + blockIdx.y] = lse;
      }
    }
  }
  // Only instantiations that some launch merges in carry the merge code (their fewest rows over the
  // fewest splits, 2: a 32-row CTA holds 17 rows at least, so not beyond D 128); in the 32-row kernel at
  // D 512 it would cost registers (spills on sm_80).
  if constexpr (attention_merges_in_kernel(AttentionShape{R, C::kKeys, MT, 1}, 16 * (MT - 1) + 1, D, 2)) {
    // the merge's scratch: the stages (its first __syncthreads ends the epilogue's reads of them)
    static_assert(4 * merge_scratch_floats(kThreads, R, static_cast<int>(kAttentionInKernelMergeBytes / (4 * D))) <=
                      C::kStageBytes, "the in-kernel merge's scratch fits in a stage");
    if (p.counters != nullptr) merge_if_last<T, kThreads>(p, w, rows, bad_flag, reinterpret_cast<float*>(stage_mem));
  }
}

}  // namespace tc

// ------------------------------------------------------------------------------------------------
// fp32: CUDA-core kernel
// ------------------------------------------------------------------------------------------------
namespace f32 {

constexpr int kThreads = 128;
constexpr int kRows = 8;   // query rows per CTA
constexpr int kKeys = 16;  // keys per K/V tile; kRows * kKeys == kThreads (one score per thread)
constexpr int kRowsPerWarp = kRows / (kThreads / 32);
static_assert(kRowsPerWarp * kKeys == 32, "one score per lane after the transposing reduction");
static_assert(kRows * kKeys == kThreads, "softmax update maps one thread to one (row, key)");

template <int D>
struct Smem {
  float k[2][kKeys][D];
  float v[2][kKeys][D];
  float p[kRows][kKeys];
  float m[kRows];  // running max, log2 units
  float l[kRows];  // running sum
  float alpha[kRows];
};

// Issues the copies of one K/V tile; returns whether a block id among them was out of range.
template <int D>
__device__ __forceinline__ bool load_tile(Smem<D>& sm, int buf, const AttentionParams& p, const Work& w,
                                          int64_t tile_start) {
  bool any_bad = false;
  constexpr int NV = D / 4;
  const float* kc = static_cast<const float*>(p.k_cache);
  const float* vc = static_cast<const float*>(p.v_cache);
  for (int c = threadIdx.x; c < kKeys * NV; c += kThreads) {
    const int key = c / NV, vec = c % NV;
    const int64_t pos = tile_start + key;
    bool valid = pos < w.range.end;
    int64_t blk = 0;
    if (valid) {
      blk = p.block_table[w.b * p.block_table_stride + pos / p.block_size];
      if (blk < 0 || blk >= p.num_blocks) {
        any_bad = true;
        valid = false;
      }
    }
    const int64_t slot = valid ? pos % p.block_size : 0;
    const float* ks = kc + (valid ? blk * p.k_stride[0] + slot * p.k_stride[1] + w.h * p.k_stride[2] + vec * 4 : 0);
    const float* vs = vc + (valid ? blk * p.v_stride[0] + slot * p.v_stride[1] + w.h * p.v_stride[2] + vec * 4 : 0);
    cp_async16(&sm.k[buf][key][vec * 4], ks, valid);
    cp_async16(&sm.v[buf][key][vec * 4], vs, valid);
  }
  return any_bad;
}

template <int D>
__global__ void __launch_bounds__(kThreads, 3) kernel(const AttentionParams p) {
  constexpr int NV = D / 4;                                   // 16-byte vectors per row
  constexpr int VPL = NV >= 32 ? NV / 32 : 1;                 // score phase: vectors per lane
  constexpr int RSTRIDE = kThreads / NV;                      // PV phase: threads per vector column
  constexpr int RPT = kRows / RSTRIDE > 0 ? kRows / RSTRIDE : 1;  // PV phase: rows per thread
  static_assert(NV <= kThreads, "one PV thread per vector column at least");

  Smem<D>& sm = *reinterpret_cast<Smem<D>*>(dynamic_smem());
  __shared__ int bad_block;

  griddep_wait();
  griddep_launch_dependents();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Work w = cta_work(p, kRows, kKeys);

  // Warp w scores query rows 2w, 2w + 1 against every key of a tile; each lane keeps its slice of D of
  // both rows in registers (pre-multiplied by the scale, and by log2 e when there is no softcap so that
  // the softmax can use exp2), so only K is read from shared memory in the score phase.
  const float qmul = p.softcap > 0.f ? p.scale : p.scale * kLog2e;
  const float* qp = static_cast<const float*>(p.q);
  float qreg[kRowsPerWarp][VPL][4];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int gr = w.row0 + warp * kRowsPerWarp + i;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int vec = lane + 32 * j;
      if (gr < w.M && vec < NV) {
        const int qi = gr / w.group, hq = w.h * w.group + gr % w.group;
        load_float<4>(qp + w.b * p.q_stride[0] + qi * p.q_stride[1] + hq * p.q_stride[2] + vec * 4, qreg[i][j]);
#pragma unroll
        for (int e = 0; e < 4; ++e) qreg[i][j][e] *= qmul;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) qreg[i][j][e] = 0.f;
      }
    }
  }
  if (tid < kRows) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.f;
  }
  if (tid == 0) bad_block = 0;

  float acc[RPT][4];
#pragma unroll
  for (int i = 0; i < RPT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
  const int vcol = tid % NV, rbase = tid / NV;

  bool any_bad = false;
  const int64_t n_tiles = w.range.end > w.range.start ? ceil_div(w.range.end - w.range.start, kKeys) : 0;
  if (n_tiles > 0) any_bad = load_tile(sm, 0, p, w, w.range.start);
  cp_async_commit();
  __syncthreads();  // m, l, bad_block

  for (int64_t it = 0; it < n_tiles; ++it) {
    const int buf = static_cast<int>(it & 1);
    if (it + 1 < n_tiles) any_bad |= load_tile(sm, buf ^ 1, p, w, w.range.start + (it + 1) * kKeys);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // Scores: warp w owns rows 2w, 2w + 1; lanes split D. The 2 x 16 partial dot products of a lane are
    // reduced across the warp with a transposing butterfly (31 shuffles, lane c ends with score c).
    const int64_t tile_start = w.range.start + it * kKeys;
    float part[kRowsPerWarp * kKeys];
#pragma unroll
    for (int key = 0; key < kKeys; ++key) {
      float kf[VPL][4];
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int vec = lane + 32 * j;
        if (vec < NV) {
          load_float<4>(&sm.k[buf][key][vec * 4], kf[j]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) kf[j][e] = 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        float acc_s = 0.f;
#pragma unroll
        for (int j = 0; j < VPL; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s = fmaf(qreg[i][j][e], kf[j][e], acc_s);
        part[i * kKeys + key] = acc_s;
      }
    }
    {
      const float score = warp_transpose_sum(part, lane);
      const int i = lane / kKeys, key = lane % kKeys;
      float s = score;
      if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap) * kLog2e;
      sm.p[warp * kRowsPerWarp + i][key] = tile_start + key < w.range.end ? s : -INFINITY;
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
        for (int e = 0; e < 4; ++e) acc[i][e] *= a;
      }
#pragma unroll 2
      for (int n = 0; n < kKeys; ++n) {
        float vf[4];
        load_float<4>(&sm.v[buf][n][vcol * 4], vf);
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
          const float pr = sm.p[rbase + i * RSTRIDE][n];
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][e] = fmaf(pr, vf[e], acc[i][e]);
        }
      }
    }
    __syncthreads();  // buffers and p are rewritten by the next tile
  }
  cp_async_wait<0>();

  if (any_bad) atomicOr(&bad_block, 1);
  __syncthreads();
  const bool poisoned = w.bad_len || bad_block;

  if (rbase < kRows) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const int r = rbase + i * RSTRIDE;
      if (w.row0 + r >= w.M) continue;
      const float l = sm.l[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? (sm.m[r] + log2f(l)) * kLn2 : -INFINITY;  // scores are in log2 units
      const int64_t orow = out_row(p, w, r);
      if (p.num_splits == 1) {
        float* o = static_cast<float*>(p.out) + orow * D + vcol * 4;
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = poisoned ? NAN : acc[i][e] * inv;
        if (vcol == 0 && p.lse != nullptr) p.lse[orow] = poisoned ? NAN : lse;
      } else {
        float* wo = p.workspace + (orow * p.num_splits + blockIdx.y) * D + vcol * 4;
#pragma unroll
        for (int e = 0; e < 4; ++e) wo[e] = poisoned ? NAN : acc[i][e] * inv;
        if (vcol == 0) {
          float* wl = p.workspace + static_cast<int64_t>(p.B) * p.Q * p.Hq * p.num_splits * D;
          wl[orow * p.num_splits + blockIdx.y] = poisoned ? NAN : lse;
        }
      }
    }
  }
  // the merge's scratch: the K/V buffers (every copy has landed; its first __syncthreads ends their use)
  static_assert(4 * merge_scratch_floats(kThreads, kRows, static_cast<int>(kAttentionInKernelMergeBytes / (4 * D))) <=
                    static_cast<int>(sizeof(Smem<D>)), "the in-kernel merge's scratch fits in the K/V buffers");
  if (p.counters != nullptr) merge_if_last<float, kThreads>(p, w, min(kRows, w.M - w.row0), &bad_block, &sm.k[0][0][0]);
}

}  // namespace f32

// ------------------------------------------------------------------------------------------------
// Merge kernel (groups above the in-kernel bound): CTA = one (b, q, head) row x up to 128 columns.
// ------------------------------------------------------------------------------------------------
constexpr int kMergeThreads = 256;
constexpr int kMergeCols = 128;

template <class T>
__global__ void __launch_bounds__(kMergeThreads, 1) merge_kernel(const AttentionParams p) {
  __shared__ __align__(16) float scratch[merge_scratch_floats(kMergeThreads, 1, kAttentionMaxSplits)];
  griddep_wait();  // the partials are the previous grid's output
  const int col0 = blockIdx.y * kMergeCols;
  merge_splits<T, kMergeThreads>(p, 1, [](int) { return static_cast<int64_t>(blockIdx.x); }, col0,
                                 min(kMergeCols, p.D - col0), blockIdx.y == 0, scratch);
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

// Pipeline stages of the tensor-core kernel on a device: as many as its shared memory holds (at most
// kMaxStages); 0 when fewer than 3 fit (the kernel refuses such a device).
template <int D, int MT>
int tc_stages(const DeviceInfo& dev) {
  int s = tc::kMaxStages;
  while (s >= 3 && tc::Layout<D, MT>::bytes(s) > static_cast<size_t>(dev.smem_optin)) --s;
  return s >= 3 ? s : 0;
}

template <class T>
cudaError_t launch_merge(const AttentionParams& p, const DeviceInfo& dev, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.B) * p.Q * p.Hq),
                  static_cast<unsigned>(ceil_div(p.D, kMergeCols)));
  return launch(merge_kernel<T>, grid, kMergeThreads, 0, dev.pdl, stream, p);
}

template <class T, int D>
cudaError_t launch_d(const AttentionParams& p, cudaStream_t stream) {
  DeviceInfo dev;
  cudaError_t err = device_info(&dev);
  if (err != cudaSuccess) return err;
  const int rows_needed = p.Q * (p.Hq / p.Hkv);
  const AttentionShape shape = attention_shape(static_cast<int>(sizeof(T)), D, rows_needed);
  const dim3 grid(static_cast<unsigned>(attention_units(shape, p.B, p.Hkv, rows_needed)),
                  static_cast<unsigned>(p.num_splits));
  // The kernels merge the splits themselves exactly when they are given counters.
  const bool merge_in_kernel = attention_merges_in_kernel(shape, rows_needed, D, p.num_splits);
  AttentionParams kp = p;
  if (!merge_in_kernel) kp.counters = nullptr;
  if constexpr (sizeof(T) == 2) {
    auto run = [&](auto mt) -> cudaError_t {
      constexpr int MT = decltype(mt)::value;
      const int stages = tc_stages<D, MT>(dev);
      if (stages == 0) return cudaErrorInvalidConfiguration;
      const size_t smem = tc::Layout<D, MT>::bytes(stages);
      cudaError_t e = opt_in_smem<tc::kernel<T, D, MT>>(static_cast<int>(smem));
      if (e != cudaSuccess) return e;
      return launch(tc::kernel<T, D, MT>, grid, tc::kThreads, smem, dev.pdl, stream, kp, stages);
    };
    err = shape.m_tiles == 1 ? run(std::integral_constant<int, 1>{}) : run(std::integral_constant<int, 2>{});
  } else {
    const size_t smem = sizeof(f32::Smem<D>);
    err = opt_in_smem<f32::kernel<D>>(static_cast<int>(smem));
    if (err == cudaSuccess) err = launch(f32::kernel<D>, grid, f32::kThreads, smem, dev.pdl, stream, kp);
  }
  if (err != cudaSuccess || p.num_splits == 1 || merge_in_kernel) return err;
  return launch_merge<T>(p, dev, stream);
}

}  // namespace attention

// The split plan for a call of element size elem_bytes: depends only on shapes, the window and the SM
// count (see plan.h attention_plan).
inline SplitPlan attention_plan_for(int elem_bytes, const AttentionParams& p, int num_sms) {
  if (p.Hkv <= 0 || p.Hq % p.Hkv) return {1, 16};  // refused by the launcher; no division by zero here
  const int64_t rows = static_cast<int64_t>(p.Q) * (p.Hq / p.Hkv);
  return attention_plan(attention_shape(elem_bytes, p.D, static_cast<int>(rows)), p.B, p.Hkv, rows, p.D,
                        p.max_blocks, p.block_size, p.window, num_sms);
}

// The int32 counters that p.counters must hold for a call of element size elem_bytes (after
// attention_plan_for() set p.num_splits): one per merge group when the kernel merges the splits itself
// (plan.h attention_merges_in_kernel), else none.
inline int64_t attention_counters_for(int elem_bytes, const AttentionParams& p) {
  if (p.Hkv <= 0 || p.Hq % p.Hkv) return 0;  // refused by the launcher
  const int64_t rows = static_cast<int64_t>(p.Q) * (p.Hq / p.Hkv);
  const AttentionShape shape = attention_shape(elem_bytes, p.D, static_cast<int>(rows));
  return attention_merges_in_kernel(shape, rows, p.D, p.num_splits) ? attention_units(shape, p.B, p.Hkv, rows) : 0;
}

// Whether the cache/query layout allows the kernels' vector loads and copies of q, K and V (all strides
// but D's a multiple of 16 bytes, 16-byte aligned bases). The kernels require it. out is written with
// scalar stores and may sit at any element offset.
template <class T>
bool attention_layout_ok(const AttentionParams& p) {
  constexpr int V = kVec16<T>;
  for (int i = 0; i < 3; ++i)
    if (p.q_stride[i] % V || p.k_stride[i] % V || p.v_stride[i] % V) return false;
  return p.D % V == 0 && host_aligned16(p.q) && host_aligned16(p.k_cache) && host_aligned16(p.v_cache);
}

// Launches the attention for element type T (float, __half, __nv_bfloat16); p.num_splits comes from
// attention_plan_for(), p.workspace holds attention::workspace_floats() floats and p.counters
// attention_counters_for() int32 (zero before the first launch; every launch leaves them zero).
template <class T>
cudaError_t q_only_paged_attention(const AttentionParams& p, cudaStream_t stream) {
  if (p.B <= 0 || p.Q <= 0 || p.Hq <= 0) return cudaSuccess;
  if (p.Hkv <= 0 || p.Hq % p.Hkv || p.block_size <= 0 || p.num_splits < 1 || p.num_splits > kAttentionMaxSplits ||
      (p.num_splits > 1 && p.workspace == nullptr) || !attention_layout_ok<T>(p) ||
      (p.counters == nullptr && attention_counters_for(static_cast<int>(sizeof(T)), p) > 0))
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
