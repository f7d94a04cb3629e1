// Index, window and work-split arithmetic shared by the kernels and their launchers. Pure functions,
// exercised on the CPU by csrc/tests/test_plan.cpp.
#pragma once

#include "gemma4_mtp/host_device.h"

namespace gemma4_mtp {

struct KeyRange {
  int64_t start;  // first attended cache position
  int64_t end;    // one past the last
};

// Positions a request attends: the last `window` entries (window <= 0: all of them).
G4_HD KeyRange attended_range(int64_t seq_len, int64_t window) {
  const int64_t len = seq_len < 0 ? 0 : seq_len;
  const int64_t start = (window > 0 && len > window) ? len - window : 0;
  return {start, len};
}

// The part of `r` that split `split` of `chunk`-sized splits owns (possibly empty, never reversed).
G4_HD KeyRange split_range(KeyRange r, int64_t split, int64_t chunk) {
  const int64_t s = min64(r.end, r.start + split * chunk);
  const int64_t e = min64(r.end, s + chunk);
  return {s, e};
}

// First and one-past-last block-table column that a key range touches: the only columns a kernel may
// read (the rest can hold garbage ids of freed blocks).
G4_HD KeyRange block_columns(KeyRange r, int64_t block_size) {
  if (r.end <= r.start) return {0, 0};
  return {r.start / block_size, ceil_div(r.end, block_size)};
}

struct SplitPlan {
  int num_splits;
  int64_t chunk;  // keys per split for a request as long as the bound
};

// How many splits of the key range a launch has, so that small batches still fill the GPU: as many as
// keep `units` x splits CTAs within one wave of `slots` (resident CTAs on the whole GPU), never a
// second, nearly empty wave; each split at least `min_chunk` keys. Decided from host-known bounds only
// (the largest possible attended range), never from seq_lens, so that it needs no device read and a
// captured CUDA graph stays valid for any seq_lens within the bound.
inline SplitPlan plan_kv_splits(int64_t key_bound, int64_t units, int64_t slots, int64_t tile, int64_t min_chunk,
                                int max_splits) {
  if (key_bound <= 0 || units <= 0) return {1, tile};
  int64_t splits = slots / units;
  splits = min64(splits, ceil_div(key_bound, min_chunk));
  splits = max64(1, min64(splits, max_splits));
  const int64_t chunk = round_up(ceil_div(key_bound, splits), tile);
  return {static_cast<int>(ceil_div(key_bound, chunk)), chunk};
}

// The launch shape of the attention kernels (csrc/include/gemma4_mtp/q_only_attention.cuh), shared
// by the kernels and the split plan.
struct AttentionShape {
  int rows;         // query rows per CTA: the Q x Hq/Hkv rows of one KV head come in tiles of this many
  int keys;         // keys per pipeline stage
  int m_tiles;      // tensor-core kernel: 16-row mma tiles per CTA; 0 for the fp32 (CUDA-core) kernel
  int ctas_per_sm;  // resident CTAs per SM that the split plan fills
};

constexpr int kAttentionMinTiles = 2;  // a split is at least two stages long
constexpr int kAttentionMaxSplits = 256;

// elem_bytes 2 (bf16, fp16): the tensor-core kernel, one 256-thread CTA per SM with a deep copy
// pipeline, stages of 16 KiB of K and 16 KiB of V (8192 / D keys), 16 or 32 query rows. elem_bytes 4
// (fp32, a test dtype): the CUDA-core kernel, 8 rows, 16-key double buffer of 256 * D bytes.
inline AttentionShape attention_shape(int elem_bytes, int D, int rows_needed) {
  if (elem_bytes == 2) {
    const int m_tiles = rows_needed <= 16 ? 1 : 2;
    return {16 * m_tiles, 8192 / (D > 0 ? D : 1), m_tiles, 1};
  }
  const int64_t smem = 256 * static_cast<int64_t>(D);
  return {8, 16, 0, static_cast<int>(max64(1, min64(3, (227 * 1024) / max64(smem, 1))))};
}

// The CTAs of one split (grid.x): one per (request, KV head, row tile). The num_splits CTAs of such a
// unit form a merge group: their partials make the unit's rows.
inline int64_t attention_units(const AttentionShape& shape, int64_t B, int64_t Hkv, int64_t rows_needed) {
  return B * Hkv * ceil_div(rows_needed, shape.rows);
}

// The fp32 partials (rows x splits x D x 4 bytes) up to which a merge group's last CTA merges them in
// the attention kernel instead of a merge kernel: it reads them from L2 in one pass (an estimated
// ~0.2-0.3 us for 32 KiB on an H200), where the merge kernel costs a dependent launch (~1.5-2.5 us).
// Larger groups (a full layer's ~128 splits) keep the merge kernel, which spreads them over many CTAs.
// Every drafter sliding layer at B = 1 is within it (E2B: 4 rows x 8 splits x D 256 = 32 KiB; 31B:
// 2 x 8 x 256). The Triton backend applies the same bound (and caps the (row, split) pairs at 64, its
// tile padded to powers of two: the same choice at every drafter shape, not always at D <= 128).
constexpr int64_t kAttentionInKernelMergeBytes = 32 * 1024;

// The most splits the attention kernel merges itself for a launch of this shape (fewer than 2: none).
constexpr int64_t attention_merge_split_cap(const AttentionShape& shape, int64_t rows_needed, int D) {
  const int64_t rows_of_tile = rows_needed < shape.rows ? rows_needed : shape.rows;  // the rows one CTA holds
  return rows_of_tile * D > 0 ? kAttentionInKernelMergeBytes / (rows_of_tile * D * 4) : 0;
}

// Whether the splits of a launch are merged in the attention kernel (one counter per merge group,
// attention_units()) rather than by the merge kernel. constexpr: a kernel instantiation asks whether
// any launch of it can merge (fewest rows, 2 splits).
constexpr bool attention_merges_in_kernel(const AttentionShape& shape, int64_t rows_needed, int D, int num_splits) {
  return num_splits > 1 && num_splits <= attention_merge_split_cap(shape, rows_needed, D);
}

// The split plan of one call: shapes, the window, the block table's capacity and the SM count. A plan
// just above what the in-kernel merge takes (Hugging Face's sliding window of 513 keys: 9 splits of two
// 32-key stages, the last holding one key) would pay the merge kernel's dependent launch for one key:
// where the merge's own count needs at most one stage more a split, the plan takes that (6 splits of 3
// stages for 513 keys; the Triton backend's fit_in_kernel_merge makes the same choice).
inline SplitPlan attention_plan(const AttentionShape& shape, int64_t B, int64_t Hkv, int64_t rows_needed, int D,
                                int64_t max_blocks, int64_t block_size, int64_t window, int num_sms) {
  int64_t bound = max_blocks * block_size;
  if (window > 0) bound = min64(bound, window);
  const int64_t units = attention_units(shape, B, Hkv, rows_needed), slots = int64_t{shape.ctas_per_sm} * num_sms;
  const int64_t min_chunk = int64_t{kAttentionMinTiles} * shape.keys;
  const SplitPlan plan = plan_kv_splits(bound, units, slots, shape.keys, min_chunk, kAttentionMaxSplits);
  const int64_t cap = attention_merge_split_cap(shape, rows_needed, D);
  if (cap < 2 || plan.num_splits <= cap) return plan;
  const SplitPlan merged = plan_kv_splits(bound, units, slots, shape.keys, min_chunk, static_cast<int>(cap));
  return merged.chunk <= plan.chunk + shape.keys ? merged : plan;
}

// Keys per split for one request: its own attended range spread over the launch's splits (a multiple of
// the tile, at least min_chunk), so that a short request under a plan made for a wide block table
// still spreads over several CTAs. num_splits * chunk >= range_len.
G4_HD int64_t request_chunk(int64_t range_len, int num_splits, int64_t tile, int64_t min_chunk) {
  const int64_t c = round_up(ceil_div(max64(range_len, 1), num_splits), tile);
  return max64(c, round_up(min_chunk, tile));
}

// Weight rows per CTA of the down projection: as many as keep at least one CTA per SM, because each
// CTA re-reads the token inputs (from L2) once for all of its rows.
inline int plan_rows_per_cta(int64_t rows, int num_sms) {
  for (int r = 4; r > 1; r /= 2)
    if (ceil_div(rows, r) >= num_sms) return r;
  return 1;
}

}  // namespace gemma4_mtp
