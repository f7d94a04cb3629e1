// The non-GPU logic of the fused glue kernels (rms_norm_linear.cuh: rms_norm_linear, rms_norm_gate_up,
// rms_norm_q_rope), tested on the CPU by csrc/tests/test_plan.cpp: which weight row each of a tile's 32
// rows reads, the work plan, and the counters a launch needs.
//
// A tile is 32 weight rows x up to 64 tokens (the tensor-core fragments of down_proj_logic.h). For
// rms_norm_linear and rms_norm_q_rope its rows are 32 consecutive rows of the weight (output columns);
// rms_norm_gate_up pairs 16 gate rows with the 16 up rows of the same output columns, so that the
// epilogue has gelu(gate) and up of a column in the same CTA.
#pragma once

#include "gemma4_mtp/down_proj_logic.h"
#include "gemma4_mtp/host_device.h"

namespace gemma4_mtp {

enum class GlueKind : int { kLinear = 0, kGateUp = 1, kQRope = 2 };

constexpr int kGlueRows = kMmaRowsPerCta;  // weight rows per tile (32)

// Output columns of one tile.
G4_HD int glue_cols_per_tile(GlueKind kind) { return kind == GlueKind::kGateUp ? 16 : kGlueRows; }

// Tile row r (0..31): whether it reads up_weight (gate_up's rows 16..31) ...
G4_HD bool glue_reads_up(GlueKind kind, int r) { return kind == GlueKind::kGateUp && r >= 16; }

// ... and which row of its weight (also the output column it feeds).
G4_HD int64_t glue_weight_row(GlueKind kind, int64_t tile, int r) {
  return kind == GlueKind::kGateUp ? tile * 16 + (r & 15) : tile * kGlueRows + r;
}

struct GluePlan {
  int token_tiles_m16;  // m16 tiles of tokens per CTA: 1, 2 or 4 (the kernel template)
  int token_tiles;      // CTAs along the tokens
  int row_tiles;        // CTAs along the output columns
  int splits;           // CTAs along k; > 1: fp32 partials and a last-CTA reduction per tile
  int steps_per_split;  // 32-wide k steps per split
};

// m16 token tiles per CTA for T tokens: a token tile's prologue is recomputed by every CTA of the tile
// row, so T > 16 takes wider tiles rather than more CTAs (3 m16 tiles round up to 4).
G4_HD int glue_token_tiles_m16(int64_t T) { return T <= 16 ? 1 : T <= 32 ? 2 : 4; }

// CTAs per SM the plan fills: at one m16 token tile the kernel fits two CTAs of <= 128 registers per
// SM, which doubles the weight loads in flight; wider token tiles take one.
G4_HD int glue_ctas_per_sm(int token_tiles_m16) { return token_tiles_m16 == 1 ? 2 : 1; }

// The tensor-core path stages n (the projection's input) for its live tokens and k range in shared
// memory, at most this many bytes (bf16 / fp16): two CTAs of the one-m16-tile kernel an SM, an A100's too.
constexpr int kGlueStageBytes = 64 * 1024;

// Token rows a CTA stages: its live tokens, at most its tile's (a one-token call stages one row, not 16).
G4_HD int glue_stage_rows(int64_t T, int token_tiles_m16) {
  return static_cast<int>(min64(max64(T, 1), int64_t{16} * token_tiles_m16));
}

// At most this many 32-wide k steps per split fit a stage of `rows` rows: the largest s with rows x
// glue_stage_stride(s) x 2 bytes <= kGlueStageBytes (62 at 16 rows, 30 at 32, 14 at 64; 1022 at one row,
// where the 16-row bound split 31B's o_proj (16384 wide) 9 ways: 288 CTAs for an H200's 264 slots).
G4_HD int glue_max_stage_steps(int rows) { return 2 * ((kGlueStageBytes / (2 * rows) - 32) / 64); }

// Elements per staged row: the k range padded so that a row starts 64 bytes (32 elements) past a
// multiple of 128 bytes; the 16-byte fragment loads of two consecutive rows then use different banks.
G4_HD int glue_stage_stride(int steps_per_split) {
  return static_cast<int>(round_up(int64_t{steps_per_split} * kMmaStepK, 64)) + 32;
}

// Dynamic shared memory of a tensor-core launch of plan p for T tokens (16-bit elements).
G4_HD int64_t glue_stage_bytes(const GluePlan& p, int64_t T) {
  return int64_t{glue_stage_rows(T, p.token_tiles_m16)} * glue_stage_stride(p.steps_per_split) * 2;
}

// The grid: tiles of 32 weight rows and up to 64 tokens; k split until the grid fills the GPU's CTA
// slots once, never below one 32-wide step per warp, and (staged: the tensor-core path) never above
// what the stage holds.
inline GluePlan plan_glue(GlueKind kind, int64_t T, int64_t H, int64_t N, int num_sms, bool staged) {
  GluePlan p{};
  p.token_tiles_m16 = glue_token_tiles_m16(T);
  p.token_tiles = static_cast<int>(ceil_div(max64(T, 1), 16 * p.token_tiles_m16));
  p.row_tiles = static_cast<int>(ceil_div(max64(N, 1), glue_cols_per_tile(kind)));
  const int64_t steps = max64(1, ceil_div(H, kMmaStepK));
  const int64_t tiles = static_cast<int64_t>(p.row_tiles) * p.token_tiles;
  const int64_t slots = int64_t{glue_ctas_per_sm(p.token_tiles_m16)} * num_sms;
  int64_t per_split = ceil_div(steps, max64(1, min64(slots / tiles, steps / kMmaWarps)));
  if (staged) per_split = min64(per_split, glue_max_stage_steps(glue_stage_rows(T, p.token_tiles_m16)));
  p.steps_per_split = static_cast<int>(per_split);
  p.splits = static_cast<int>(ceil_div(steps, per_split));
  return p;
}

// int32 counters a launch needs: one per output tile when k is split (the last split sums the
// partials), and for rms_norm_q_rope one per (token tile, head) (the head's last tile normalises and
// rotates it). All zero before the first launch and left zero.
G4_HD int64_t glue_split_counters(const GluePlan& p) {
  return p.splits > 1 ? static_cast<int64_t>(p.row_tiles) * p.token_tiles : 0;
}
G4_HD int64_t glue_counters(GlueKind kind, const GluePlan& p, int64_t heads) {
  return glue_split_counters(p) + (kind == GlueKind::kQRope ? static_cast<int64_t>(p.token_tiles) * heads : 0);
}

// The whole MLP in one rms_norm_gate_up launch (down_weight [down_N, I]): each tile's last CTA multiplies
// its 16 columns of m by down_weight's 16 columns (the down projection's split-K operands, since the tile
// holds that K range) and publishes an fp32 partial [T, down_N]; the partials are summed in a fixed tree
// (deterministic): the last tile of each group of glue_mlp_group() tiles sums the group, the last group
// the group sums, and rounds once. When (the callers' choice: the op's binding and the one-call step): the
// Triton rule (triton/rms_norm_gate_up.py one_launch, which says why), up to 4 tokens and weights of at
// most 8 MiB (E2B / E4B: L2-resident, latency bound); otherwise gate_up, then rms_norm_linear.
constexpr int kGlueMlpMaxT = 4;
constexpr int64_t kGlueMlpMaxWeightBytes = int64_t{8} << 20;

G4_HD bool glue_mlp_one_launch(int64_t T, int64_t H, int64_t I, int64_t down_N, int64_t elem_bytes) {
  return T > 0 && T <= kGlueMlpMaxT && (2 * H + down_N) * I * elem_bytes <= kGlueMlpMaxWeightBytes;
}

// Tiles per group of the reduction tree: the power of two >= sqrt(row_tiles) (E2B's 128 tiles: 8 groups
// of 16, one wave of 16 loads a thread at the first level and 8 at the second).
G4_HD int glue_mlp_group(int row_tiles) {
  int g = 1;
  while (g * g < row_tiles) g *= 2;
  return g;
}
G4_HD int glue_mlp_groups(int row_tiles) { return static_cast<int>(ceil_div(row_tiles, glue_mlp_group(row_tiles))); }

// Counters of the tree, after glue_counters(): per token tile, one per group and one for the groups.
G4_HD int64_t glue_mlp_counters(const GluePlan& p) {
  return static_cast<int64_t>(p.token_tiles) * (glue_mlp_groups(p.row_tiles) + 1);
}

// fp32 workspace of the tree: the tiles' partials, then the group sums, each [T, down_N].
G4_HD int64_t glue_mlp_workspace_floats(const GluePlan& p, int64_t T, int64_t down_N) {
  return (static_cast<int64_t>(p.row_tiles) + glue_mlp_groups(p.row_tiles)) * T * down_N;
}

}  // namespace gemma4_mtp
