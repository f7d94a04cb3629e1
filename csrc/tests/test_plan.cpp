// Window, split and block-column arithmetic of the attention kernel, and the work plans.
#include <random>

#include "check.h"
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
    const SplitPlan plan = plan_kv_splits(bound, 1 + rng() % 8, 132, 16, 64, 256);
    CHECK(plan.num_splits >= 1 && plan.num_splits <= 256);
    CHECK(plan.chunk % 16 == 0);
    CHECK(int64_t{plan.num_splits} * plan.chunk >= bound);
    const KeyRange r = attended_range(len, window);
    const int64_t chunk = request_chunk(r.end - r.start, plan.num_splits, 16, 64);
    CHECK(chunk % 16 == 0 && chunk >= 64);
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
  const SplitPlan plan = plan_kv_splits(131072, 1, 132, 16, 64, 256);
  CHECK_EQ(plan.num_splits, 256);
  const int64_t chunk = request_chunk(1000, plan.num_splits, 16, 64);
  CHECK_EQ(chunk, 64);
  CHECK_EQ(ceil_div(1000, chunk), 16);
  CHECK_EQ(request_chunk(0, 7, 16, 64), 64);
  CHECK_EQ(request_chunk(100000, 7, 16, 64), round_up(ceil_div(100000, 7), 16));
}

static void test_split_plan_fills_gpu() {
  // B = 1, one KV head, 8K context: enough splits for two CTAs per SM, each at least 64 keys.
  const SplitPlan p = plan_kv_splits(8192, 1, 132, 16, 64, 256);
  CHECK_EQ(p.num_splits, 128);
  CHECK_EQ(p.chunk, 64);
  // A full batch needs no split.
  CHECK_EQ(plan_kv_splits(8192, 512, 132, 16, 64, 256).num_splits, 1);
  // Empty bound.
  CHECK_EQ(plan_kv_splits(0, 1, 132, 16, 64, 256).num_splits, 1);
}

static void test_rows_per_cta() {
  CHECK_EQ(plan_rows_per_cta(1024, 132), 4);  // 31B / 26B drafters: 256 CTAs
  CHECK_EQ(plan_rows_per_cta(256, 132), 1);   // E2B / E4B: 256 CTAs of one row
  CHECK_EQ(plan_rows_per_cta(300, 132), 2);
  CHECK_EQ(plan_rows_per_cta(3, 132), 1);
}

static void test_row_chunks() {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t n = 1 + rng() % 300000;
    const int64_t rows = 1 + rng() % 300;
    const ChunkPlan c = plan_row_chunks(n, rows, 132, 4096, 8);
    CHECK(c.chunk % 8 == 0);
    CHECK(int64_t{c.num_chunks} * c.chunk >= n);
    CHECK(int64_t{c.num_chunks - 1} * c.chunk < n);  // no empty chunk
  }
}

int main() {
  test_attended_range();
  test_splits_cover_range();
  test_short_request_under_a_wide_plan();
  test_split_plan_fills_gpu();
  test_rows_per_cta();
  test_row_chunks();
  return finish("test_plan");
}
