// Window, split and block-column arithmetic of the attention kernels, their launch shapes and split
// plans, and the work plans of the other kernels.
#include <algorithm>
#include <random>
#include <vector>

#include "check.h"
#include "gemma4_mtp/glue_logic.h"
#include "gemma4_mtp/plan.h"

using namespace gemma4_mtp;

static void test_attended_range() {
  CHECK_EQ(attended_range(0, 0).start, 0);
  CHECK_EQ(attended_range(0, 0).end, 0);
  CHECK_EQ(attended_range(100, 0).start, 0);
  CHECK_EQ(attended_range(100, 512).start, 0);
  CHECK_EQ(attended_range(100, 30).start, 70);
  CHECK_EQ(attended_range(100, 30).end, 100);
  CHECK_EQ(attended_range(100, 100).start, 0);
  CHECK_EQ(attended_range(-5, 10).end, 0);  // a bad seq_len never yields a reversed range
}

// Splits of any attended range within the plan's bound tile it exactly, and the block-table columns
// they read are only those the range needs (out-of-window and past-the-end entries stay untouched).
static void test_splits_cover_range() {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 3000; ++trial) {
    const int block_size = 1 + rng() % 40;
    const int max_blocks = 1 + rng() % 50;
    const int64_t capacity = int64_t{max_blocks} * block_size;
    const int64_t window = (rng() % 3 == 0) ? 0 : 1 + rng() % 600;
    const int64_t len = rng() % (capacity + 1);
    const int64_t bound = window > 0 ? min64(capacity, window) : capacity;
    const SplitPlan plan = plan_kv_splits(bound, 1 + rng() % 8, 132, 16, 32, 256);
    CHECK(plan.num_splits >= 1 && plan.num_splits <= 256);
    CHECK(plan.chunk % 16 == 0);
    CHECK(int64_t{plan.num_splits} * plan.chunk >= bound);
    const KeyRange r = attended_range(len, window);
    const int64_t chunk = request_chunk(r.end - r.start, plan.num_splits, 16, 32);
    CHECK(chunk % 16 == 0 && chunk >= 32);
    int64_t next = r.start;
    for (int s = 0; s < plan.num_splits; ++s) {
      const KeyRange part = split_range(r, s, chunk);
      CHECK(part.start <= part.end);
      if (part.end > part.start) {
        CHECK_EQ(part.start, next);
        next = part.end;
        const KeyRange cols = block_columns(part, block_size);
        CHECK(cols.start >= r.start / block_size);
        CHECK(cols.end <= max_blocks);
        CHECK(cols.end <= ceil_div(r.end, block_size));
      }
    }
    CHECK_EQ(next, r.end);
  }
}

// A 1000-key request under a plan made for a 128K-entry block table still uses 16 splits.
static void test_short_request_under_a_wide_plan() {
  const SplitPlan plan = plan_kv_splits(131072, 1, 132, 16, 32, 256);
  CHECK_EQ(plan.num_splits, 131);  // 132 splits of 1008 keys cover the bound in 131
  const int64_t chunk = request_chunk(1000, plan.num_splits, 16, 32);
  CHECK_EQ(chunk, 32);
  CHECK_EQ(ceil_div(1000, chunk), 32);
  CHECK_EQ(request_chunk(0, 7, 16, 64), 64);
  CHECK_EQ(request_chunk(100000, 7, 16, 64), round_up(ceil_div(100000, 7), 16));
}

static void test_split_plan_fills_gpu() {
  // B = 1, one KV head, 8K context, one CTA per SM: a split per SM, each at least two 16-key tiles.
  const SplitPlan p = plan_kv_splits(8192, 1, 132, 16, 32, 256);
  CHECK_EQ(p.num_splits, 128);
  CHECK_EQ(p.chunk, 64);
  // Never more CTAs than one wave: 32 units on 132 slots take 4 splits (128 CTAs), not 5 (160).
  CHECK_EQ(plan_kv_splits(8192, 32, 132, 16, 32, 256).num_splits, 4);
  // A full batch needs no split.
  CHECK_EQ(plan_kv_splits(8192, 512, 132, 16, 32, 256).num_splits, 1);
  CHECK_EQ(plan_kv_splits(8192, 132, 132, 16, 32, 256).num_splits, 1);
  // Empty bound.
  CHECK_EQ(plan_kv_splits(0, 1, 132, 16, 32, 256).num_splits, 1);
}

// The attention launch shapes: bf16/fp16 take the tensor-core kernel (one CTA per SM, 16 or 32 rows,
// stages of 8192 / D keys); fp32 the CUDA-core kernel (8 rows, 16 keys).
static void test_attention_shapes() {
  const AttentionShape a = attention_shape(2, 512, 4);
  CHECK_EQ(a.rows, 16);
  CHECK_EQ(a.keys, 16);
  CHECK_EQ(a.m_tiles, 1);
  CHECK_EQ(a.ctas_per_sm, 1);
  CHECK_EQ(attention_shape(2, 512, 16).rows, 16);
  CHECK_EQ(attention_shape(2, 512, 17).rows, 32);
  CHECK_EQ(attention_shape(2, 512, 17).m_tiles, 2);
  CHECK_EQ(attention_shape(2, 256, 8).keys, 32);
  CHECK_EQ(attention_shape(2, 64, 8).keys, 128);
  const AttentionShape f = attention_shape(4, 256, 8);
  CHECK_EQ(f.rows, 8);
  CHECK_EQ(f.keys, 16);
  CHECK_EQ(f.m_tiles, 0);
  CHECK_EQ(f.ctas_per_sm, 3);
  CHECK_EQ(attention_shape(4, 512, 8).ctas_per_sm, 1);
}

// The benchmarked drafter cases on an H200 (132 SMs): every batch gets one wave of CTAs, Q = 4 tree
// levels (32 rows per KV head at 31B) stay one row tile, so K/V are read once.
static void test_attention_plans_of_the_drafters() {
  struct Case {
    int B, Q, Hq, Hkv, D;
    int64_t ctx, window;
    int splits, ctas;
  };
  const Case cases[] = {
      {1, 1, 4, 1, 512, 8192, 0, 128, 128},     // E2B full, 8K: 64 keys per split
      {1, 1, 4, 1, 512, 32768, 0, 128, 128},    // E2B full, 32K: 256 keys per split
      {1, 1, 4, 1, 256, 8192, 512, 8, 8},       // E2B sliding: window 512, two 32-key stages each
      {1, 1, 4, 1, 256, 8192, 513, 6, 6},       // Hugging Face's window (513 keys): 6 of 3 stages, not 9 of 2
      {1, 1, 4, 1, 256, 8192, 700, 8, 8},       // 8 of 3 stages where 11 of 2 would need the merge kernel
      {1, 1, 4, 1, 256, 8192, 769, 13, 13},     // 8 would take 4 stages each: 13 of 2 and the merge kernel
      {8, 1, 4, 1, 512, 8192, 0, 16, 128},      // E2B full, B = 8
      {1, 1, 32, 4, 512, 8192, 0, 32, 128},     // 31B full, 8K
      {1, 1, 32, 4, 512, 32768, 0, 33, 132},    // 31B full, 32K
      {1, 1, 32, 16, 256, 8192, 1024, 8, 128},  // 31B sliding
      {8, 1, 32, 4, 512, 8192, 0, 4, 128},      // 31B full, B = 8
      {32, 1, 32, 4, 512, 8192, 0, 1, 128},     // 31B full, B = 32
      {1, 4, 32, 4, 512, 8192, 0, 32, 128},     // 31B full, Q = 4: 32 rows in one tile
  };
  for (const Case& c : cases) {
    const int rows = c.Q * c.Hq / c.Hkv;
    const AttentionShape shape = attention_shape(2, c.D, rows);
    CHECK_EQ(ceil_div(rows, shape.rows), 1);
    const SplitPlan plan = attention_plan(shape, c.B, c.Hkv, rows, c.D, ceil_div(c.ctx, 16), 16, c.window, 132);
    CHECK_EQ(plan.num_splits, c.splits);
    CHECK_EQ(int64_t{c.B} * c.Hkv * plan.num_splits, c.ctas);
  }
}

// Which merge the drafter cases of an H200 take: a sliding layer's 8 splits at B = 1 are merged by the
// attention kernel (E2B: exactly the 32 KiB bound), a full layer's ~128 splits by the merge kernel; the
// bound is inclusive and counts the rows of one tile.
static void test_attention_merge_paths() {
  struct Case {
    int B, Q, Hq, Hkv, D;
    int64_t ctx, window;
    bool in_kernel;
  };
  const Case cases[] = {
      {1, 1, 4, 1, 256, 8192, 512, true},     // E2B sliding: 4 rows x 8 splits x 256 x 4 B = 32 KiB
      {1, 1, 4, 1, 256, 8192, 513, true},     // Hugging Face's window: 6 splits, one stage longer
      {1, 1, 4, 1, 256, 8192, 769, false},    // 13 splits (8 would be two stages longer)
      {1, 1, 4, 1, 512, 8192, 0, false},      // E2B full, 8K: 128 splits
      {1, 1, 32, 16, 256, 8192, 1024, true},  // 31B sliding: 2 rows x 8 splits
      {1, 1, 32, 4, 512, 8192, 0, false},     // 31B full, 8K: 32 splits x 8 rows x 2 KiB
      {1, 2, 4, 1, 256, 8192, 512, false},    // E2B sliding, Q = 2: 8 rows, 64 KiB
      {32, 1, 32, 4, 512, 8192, 0, false},    // one split: nothing to merge
  };
  for (const Case& c : cases) {
    const int rows = c.Q * c.Hq / c.Hkv;
    const AttentionShape shape = attention_shape(2, c.D, rows);
    const SplitPlan plan = attention_plan(shape, c.B, c.Hkv, rows, c.D, ceil_div(c.ctx, 16), 16, c.window, 132);
    CHECK_EQ(attention_merges_in_kernel(shape, rows, c.D, plan.num_splits), c.in_kernel);
  }
  const AttentionShape tile32 = attention_shape(2, 128, 40);  // two tiles of 32 rows: a tile counts 32
  CHECK(attention_merges_in_kernel(tile32, 40, 128, 2));
  CHECK(!attention_merges_in_kernel(tile32, 40, 128, 3));
  CHECK(attention_merges_in_kernel(attention_shape(2, 128, 17), 17, 128, 3));  // 17 rows x 3 x 512 B
  CHECK_EQ(attention_units(tile32, 3, 2, 40), 3 * 2 * 2);
}

// Any batch: the grid is one wave at most (when a split is possible) and at least half of one, unless
// the keys run out first (every split at its minimum length) or the batch alone fills the GPU.
static void test_attention_plans_fill_one_wave() {
  for (int sms : {108, 132}) {
    for (int B = 1; B <= 200; ++B) {
      for (int Hkv : {1, 2, 4, 8}) {
        for (int64_t ctx : {100, 2048, 8192, 131072}) {
          const AttentionShape shape = attention_shape(2, 512, 8);
          const SplitPlan plan = attention_plan(shape, B, Hkv, 8, 512, ceil_div(ctx, 16), 16, 0, sms);
          const int64_t units = int64_t{B} * Hkv, ctas = units * plan.num_splits;
          CHECK(plan.num_splits >= 1);
          if (units >= sms) {
            CHECK_EQ(plan.num_splits, 1);
          } else {
            CHECK(ctas <= sms);
            const bool keys_ran_out = plan.chunk <= int64_t{kAttentionMinTiles} * shape.keys + shape.keys;
            CHECK(2 * ctas > sms || keys_ran_out);
          }
        }
      }
    }
  }
}

static void test_rows_per_cta() {
  CHECK_EQ(plan_rows_per_cta(1024, 132), 4);  // 31B / 26B drafters: 256 CTAs
  CHECK_EQ(plan_rows_per_cta(256, 132), 1);   // E2B / E4B: 256 CTAs of one row
  CHECK_EQ(plan_rows_per_cta(300, 132), 2);
  CHECK_EQ(plan_rows_per_cta(3, 132), 1);
}

// The fused glue kernels' tiles: every weight row read once per token tile (gate_up: gate and up rows
// of the same columns in one tile), the k steps covered exactly by the splits, the stage within its
// budget, and the real drafters' grids on an H200.
static void test_glue_plans() {
  for (GlueKind kind : {GlueKind::kLinear, GlueKind::kGateUp, GlueKind::kQRope}) {
    const int N = 200;
    std::vector<int> seen(2 * N, 0);
    const int cols = glue_cols_per_tile(kind);
    for (int tile = 0; tile * cols < N; ++tile)
      for (int r = 0; r < kGlueRows; ++r) {
        const int64_t row = glue_weight_row(kind, tile, r);
        if (row < N) ++seen[(glue_reads_up(kind, r) ? N : 0) + row];
        CHECK(row / cols == tile);  // the row feeds an output column of its own tile
      }
    for (int i = 0; i < 2 * N; ++i) CHECK_EQ(seen[i], (kind == GlueKind::kGateUp || i < N) ? 1 : 0);
  }
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t T = 1 + rng() % 200, H = rng() % 20000, N = 1 + rng() % 9000;
    const bool staged = rng() % 2;
    const auto kind = static_cast<GlueKind>(rng() % 3);
    const GluePlan p = plan_glue(kind, T, H, N, 1 + rng() % 200, staged);
    const int64_t steps = max64(1, ceil_div(H, kMmaStepK));
    CHECK(p.splits >= 1 && p.steps_per_split >= 1);
    CHECK(int64_t{p.splits} * p.steps_per_split >= steps);
    CHECK(int64_t{p.splits - 1} * p.steps_per_split < steps);  // no empty split
    CHECK(int64_t{p.token_tiles} * 16 * p.token_tiles_m16 >= T);
    CHECK(p.token_tiles_m16 == 1 || p.token_tiles_m16 == 2 || p.token_tiles_m16 == 4);
    CHECK(int64_t{p.row_tiles} * glue_cols_per_tile(kind) >= N);
    const int rows = glue_stage_rows(T, p.token_tiles_m16);
    CHECK_EQ(rows, static_cast<int>(std::min<int64_t>(T, 16 * p.token_tiles_m16)));
    if (staged) CHECK(glue_stage_bytes(p, T) <= kGlueStageBytes);
    // a step more would not fit the stage (the bound is the largest that does), unless k ran out first
    if (staged && p.splits > 1 && p.steps_per_split == glue_max_stage_steps(rows)) {
      GluePlan wider = p;
      wider.steps_per_split += 1;
      CHECK(glue_stage_bytes(wider, T) > kGlueStageBytes);
    }
    CHECK(glue_stage_stride(p.steps_per_split) % 64 == 32);  // 64 bytes past a multiple of 128
    CHECK(glue_stage_stride(p.steps_per_split) >= p.steps_per_split * kMmaStepK);
  }
  // one token on an H200 (132 SMs, two CTAs each): 31B's o_proj (16384 -> 1024) splits 8 ways, one wave
  // of 256 CTAs (a stage sized for 16 rows held 62 steps: 9 splits, 288 CTAs); 16 tokens fill the stage
  // (9 splits); its gate / up (1024 -> 2 x 8192) and q_proj (1024 -> 8192) fill the GPU unsplit
  GluePlan p = plan_glue(GlueKind::kLinear, 1, 16384, 1024, 132, true);
  CHECK_EQ(p.row_tiles, 32);
  CHECK_EQ(p.splits, 8);
  CHECK_EQ(glue_stage_bytes(p, 1), int64_t{2080} * 2);
  p = plan_glue(GlueKind::kLinear, 8, 16384, 1024, 132, true);
  CHECK_EQ(p.splits, 8);
  p = plan_glue(GlueKind::kLinear, 16, 16384, 1024, 132, true);
  CHECK_EQ(p.splits, 9);
  CHECK_EQ(p.steps_per_split, 62);
  p = plan_glue(GlueKind::kGateUp, 1, 1024, 8192, 132, true);
  CHECK_EQ(p.row_tiles, 512);
  CHECK_EQ(p.splits, 1);
  p = plan_glue(GlueKind::kQRope, 1, 1024, 8192, 132, true);
  CHECK_EQ(p.row_tiles, 256);
  CHECK_EQ(p.splits, 1);
  p = plan_glue(GlueKind::kLinear, 64, 1024, 5376, 132, true);  // a tree level of 64 tokens
  CHECK_EQ(p.token_tiles_m16, 4);
  CHECK_EQ(glue_counters(GlueKind::kQRope, plan_glue(GlueKind::kQRope, 70, 256, 1024, 8, true), 4),
           int64_t{2} * 4 + (plan_glue(GlueKind::kQRope, 70, 256, 1024, 8, true).splits > 1 ? 2 * 32 : 0));
}

// The whole MLP in one gate_up launch: when (the small drafters at up to 4 tokens), and its tree's groups
// cover every tile once.
static void test_glue_mlp_tree() {
  CHECK(glue_mlp_one_launch(1, 256, 2048, 256, 2));   // E2B / E4B, one token
  CHECK(glue_mlp_one_launch(4, 256, 2048, 256, 2));   // a (2, 2, 1) level of two requests
  CHECK(!glue_mlp_one_launch(5, 256, 2048, 256, 2));  // the partials grow with T
  CHECK(!glue_mlp_one_launch(0, 256, 2048, 256, 2));
  CHECK(!glue_mlp_one_launch(1, 1024, 8192, 1024, 2));  // 26B / 31B: 48 MiB from DRAM
  CHECK(!glue_mlp_one_launch(1, 256, 2048, 256, 8));    // fp32 E2B: 12 MiB
  GluePlan e2b = plan_glue(GlueKind::kGateUp, 1, 256, 2048, 132, true);
  CHECK_EQ(e2b.row_tiles, 128);
  CHECK_EQ(glue_mlp_group(e2b.row_tiles), 16);
  CHECK_EQ(glue_mlp_groups(e2b.row_tiles), 8);
  CHECK_EQ(glue_mlp_counters(e2b), int64_t{9});
  CHECK_EQ(glue_mlp_workspace_floats(e2b, 1, 256), int64_t{136} * 256);
  for (int tiles = 1; tiles <= 600; ++tiles) {
    const int G = glue_mlp_group(tiles), groups = glue_mlp_groups(tiles);
    CHECK(G * G >= tiles && (G == 1 || (G / 2) * (G / 2) < tiles));  // the power of two >= sqrt
    CHECK(groups * G >= tiles && (groups - 1) * G < tiles);            // every group has a tile
  }
}

int main() {
  test_attended_range();
  test_splits_cover_range();
  test_short_request_under_a_wide_plan();
  test_split_plan_fills_gpu();
  test_attention_shapes();
  test_attention_plans_of_the_drafters();
  test_attention_plans_fill_one_wave();
  test_attention_merge_paths();
  test_rows_per_cta();
  test_glue_plans();
  test_glue_mlp_tree();
  return finish("test_plan");
}
