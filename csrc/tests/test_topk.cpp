// Host logic of the centroid head and of the down projection's tensor-core path:
// - the (score, index) order, the centroid kernel's radix select run here sequentially (each pass's
//   histogram scanned in 32 chunks of 8 bins, as the kernel's lanes do) against a stable sort, the
//   argmax partial merge, and the work plan (every item owned by exactly one program);
// - the down projection's fragment mapping: one 32-wide k step of a warp, loaded the kernel's way and
//   multiplied by an emulation of mma.m16n8k16 written from the PTX ISA's fragment layouts, equals the
//   plain product; and its plan.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "gemma4_mtp/centroid_logic.h"
#include "gemma4_mtp/down_proj_logic.h"

using namespace gemma4_mtp;

// The clusters the kernel selects for one token, in rank order: radix passes, the tie rule, then the
// rank of each selected key among the selected ones (count of larger keys).
static std::vector<uint32_t> radix_topk(const std::vector<float>& scores, uint32_t k, int* passes = nullptr) {
  const size_t C = scores.size();
  std::vector<uint32_t> key(C);
  for (size_t i = 0; i < C; ++i) key[i] = orderable_bits(scores[i]);
  RadixState st = radix_init(k);
  while (st.pass < kRadixPasses) {
    uint32_t hist[kRadixBins] = {};
    for (size_t i = 0; i < C; ++i)
      if (radix_in_play(st, key[i])) ++hist[radix_digit(st, key[i])];
    // lane l holds bins 255 - 8l ... 248 - 8l; `above` is the warp's exclusive prefix sum
    int found = 0;
    RadixStep step{};
    uint32_t above = 0;
    for (int lane = 0; lane < 32; ++lane) {
      uint32_t c[8];
      uint32_t local = 0;
      for (int b = 0; b < 8; ++b) local += c[b] = hist[255 - 8 * lane - b];
      RadixStep s;
      if (radix_find(c, 8, 255 - 8 * lane, above, st.need, &s)) ++found, step = s;
      above += local;
    }
    CHECK_EQ(found, 1);
    st = radix_advance(st, step);
    if (st.done) break;
  }
  if (passes) *passes = st.pass;
  std::vector<uint64_t> sel;
  uint32_t tie = 0;
  for (size_t i = 0; i < C; ++i) {
    const bool eq = !st.done && key[i] == st.prefix;
    if (radix_selected(st, key[i], tie)) sel.push_back(topk_key(key[i], uint32_t(i)));
    tie += eq;
  }
  CHECK_EQ(sel.size(), size_t(k));
  std::vector<uint32_t> out(sel.size());
  for (uint64_t my : sel) {
    size_t rank = 0;
    for (uint64_t other : sel) rank += other > my;
    out[rank] = topk_key_index(my);
  }
  return out;
}

static std::vector<uint32_t> reference_topk(const std::vector<float>& scores, uint32_t k) {
  std::vector<uint32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0u);
  // torch.sort(descending, stable): NaN first, -0 == +0, equal scores in index order
  auto rank_of = [&](float s) { return s != s ? INFINITY : s; };
  std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
    const bool na = scores[a] != scores[a], nb = scores[b] != scores[b];
    if (na || nb) return na && !nb;
    return rank_of(scores[a]) > rank_of(scores[b]);
  });
  idx.resize(k);
  return idx;
}

static void test_order() {
  const float v[] = {-INFINITY, -1e30f, -2.f, -1.f, -1e-30f, 0.f, 1e-30f, 1.f, 2.f, 1e30f, INFINITY, NAN};
  for (size_t i = 0; i + 1 < sizeof v / sizeof v[0]; ++i) CHECK(orderable_bits(v[i]) < orderable_bits(v[i + 1]));
  CHECK(orderable_bits(-0.f) == orderable_bits(0.f));
  // a NaN ranks first whatever its sign bit (x86's default NaN has it set) and payload
  CHECK(std::signbit(-NAN) && orderable_bits(-NAN) == orderable_bits(NAN));
  CHECK(orderable_bits(std::nanf("7")) == orderable_bits(NAN));
  // equal scores: the lower index has the larger key
  CHECK(topk_key(orderable_bits(1.f), 3) > topk_key(orderable_bits(1.f), 4));
  CHECK(topk_key(orderable_bits(1.f), 4000) > topk_key(orderable_bits(0.5f), 0));
  CHECK_EQ(topk_key_index(topk_key(orderable_bits(-3.f), 1234)), 1234u);
}

static void test_radix_select() {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  int max_passes = 0, sum_passes = 0, runs = 0;
  for (int C : {1, 2, 3, 32, 100, 2048, 3000, 4096}) {
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<float> s(C);
      for (auto& x : s) x = trial == 1 ? float(int(nd(rng) * 2)) : nd(rng);  // trial 1: many ties
      if (trial == 2 && C > 3) s[1] = -0.f, s[2] = 0.f, s[0] = NAN, s[C - 1] = -NAN;  // both NaNs first
      if (trial == 3) std::fill(s.begin(), s.end(), 0.25f);  // all equal: the lowest indices
      if (trial == 4 && C > 8) s[C / 2] = INFINITY, s[C / 3] = -INFINITY, s[C - 1] = s[C - 2] = 7.f;
      for (uint32_t k : {1u, 2u, 32u, uint32_t(C) / 2, uint32_t(C)}) {
        if (k < 1 || k > uint32_t(C)) continue;
        int passes = 0;
        CHECK(radix_topk(s, k, &passes) == reference_topk(s, k));
        if (trial == 0 && C == 2048 && k == 32) max_passes = std::max(max_passes, passes), sum_passes += passes, ++runs;
      }
    }
  }
  // random E2B-like scores: the early exit leaves before the fourth pass
  CHECK(runs > 0 && max_passes <= 3);
  std::printf("radix select, C = 2048, k = 32, gaussian scores: %d pass(es)\n", max_passes);
  (void)sum_passes;
}

static void test_candidate_merge() {
  const ArgMax bad{NAN, kBadIndex}, a{1.f, 7}, b{1.f, 3}, c{2.f, 9};
  CHECK_EQ(candidate_merge(a, b).index, 3);  // tie: lower id
  CHECK_EQ(candidate_merge(b, c).index, 9);
  CHECK_EQ(candidate_merge(c, bad).index, kBadIndex);
  CHECK_EQ(candidate_merge(bad, c).index, kBadIndex);
  CHECK_EQ(candidate_merge(argmax_identity(), ArgMax{-INFINITY, 5}).index, 5);
}

static void test_plan() {
  // E2B / E4B at T = 1 on 132 SMs: 32 clusters x 4 items of 32 rows, 128 programs
  CentroidPlan e2b = centroid_plan(1, 32, 128, 2048, 132, 16);
  CHECK_EQ(e2b.chunks, 4);
  CHECK_EQ(e2b.rows, 32);
  CHECK_EQ(e2b.items, 128);
  CHECK_EQ(e2b.grid, 128);
  CentroidPlan t64 = centroid_plan(64, 32, 128, 2048, 132, 16);
  CHECK_EQ(t64.chunks, 1);
  CHECK_EQ(t64.grid, 132);
  CentroidPlan tiny = centroid_plan(1, 2, 4, 8, 132, 16);
  CHECK(tiny.grid >= 1 && tiny.rows * tiny.chunks >= 4);
  CHECK(!e2b.cluster_major && !t64.cluster_major);
  // cluster-major once the pairs outnumber the SMs (argmax, topk), as the Triton plan(); a forced order stays
  CHECK(centroid_order(CentroidOrder::kAuto, 4, 32, 132, true) == CentroidOrder::kTokens);  // 128 pairs
  CHECK(centroid_order(CentroidOrder::kAuto, 5, 32, 132, true) == CentroidOrder::kClusters);
  CHECK(centroid_order(CentroidOrder::kAuto, 64, 32, 132, false) == CentroidOrder::kTokens);
  CHECK(centroid_order(CentroidOrder::kTokens, 64, 32, 132, true) == CentroidOrder::kTokens);
  CHECK(centroid_order(CentroidOrder::kClusters, 1, 1, 132, false) == CentroidOrder::kClusters);
  // E2B T = 8: 256 pairs for 132 x 16 warps, each pair's 128 rows in 8 items of 16; T = 64: whole clusters
  CentroidPlan c8 = centroid_plan(8, 32, 128, 2048, 132, 16, CentroidOrder::kClusters, 16);
  CHECK(c8.cluster_major);
  CHECK_EQ(c8.chunks, 8);
  CHECK_EQ(c8.rows, 16);
  CHECK_EQ(c8.items, 256);
  CHECK_EQ(c8.grid, 132);
  CentroidPlan c64 = centroid_plan(64, 32, 128, 2048, 132, 16, CentroidOrder::kClusters, 16);
  CHECK_EQ(c64.chunks, 1);
  CHECK_EQ(c64.rows, 128);
  CHECK_EQ(c64.items, 2048);
  CHECK_EQ(c64.grid, 132);
  // few selected clusters: phase 1 still wants C / 16 programs
  CHECK_EQ(centroid_plan(3, 2, 64, 256, 132, 16, CentroidOrder::kClusters, 16).grid, 16);
  for (int64_t items : {1, 2, 5, 128, 2048, 4097})
    for (int64_t grid : {1, 3, 128, 132}) {
      int64_t next = 0;
      for (int64_t p = 0; p < grid; ++p) {
        CHECK_EQ(items_begin(p, grid, items), next);
        next = items_begin(p + 1, grid, items);
        for (int64_t i = items_begin(p, grid, items); i < next; ++i) CHECK_EQ(program_of_item(i, grid, items), p);
      }
      CHECK_EQ(next, items);
    }
}

// mma.m16n8k16 (row.col, fp32 accumulate) as the PTX ISA lays out its fragments, g = lane / 4,
// c = lane % 4: A register r holds elements a_{2r}, a_{2r+1}; a_i sits at row g (i in 0,1,4,5) or g + 8,
// column 2c + (i & 1) (+ 8 for i >= 4). B register r holds b_{2r}, b_{2r+1} at row 2c + (i & 1) (+ 8 for
// i >= 2), column g. D element i at row g (i < 2) or g + 8, column 2c + (i & 1).
static void mma_emulated(const float (&a)[32][8], const float (&b)[32][4], float (&d)[32][4]) {
  float A[16][16] = {}, B[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, c = lane % 4;
    for (int i = 0; i < 8; ++i) A[g + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0)][2 * c + (i & 1) + (i >= 4 ? 8 : 0)] = a[lane][i];
    for (int i = 0; i < 4; ++i) B[2 * c + (i & 1) + (i >= 2 ? 8 : 0)][g] = b[lane][i];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, c = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * c + (i & 1);
      for (int k = 0; k < 16; ++k) d[lane][i] += A[row][k] * B[k][col];
    }
  }
}

static void test_mma_mapping() {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> small(-8, 8);
  float X[16][kMmaStepK], W[8][kMmaStepK];  // 16 tokens, 8 weight rows, one k step
  for (auto& r : X)
    for (auto& v : r) v = float(small(rng));
  for (auto& r : W)
    for (auto& v : r) v = float(small(rng));
  // the kernel: lane loads 8 elements at k = mma_lane_k(lane) of token rows mma_a_row(lane, 0 / 1) and of
  // weight row mma_b_row(lane), and feeds the two k16 halves from them
  float d[32][4] = {};
  for (int kb = 0; kb < 2; ++kb) {
    float a[32][8], b[32][4];
    for (int lane = 0; lane < 32; ++lane) {
      const int k = mma_lane_k(lane);
      for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 2; ++e) a[lane][2 * r + e] = X[mma_a_row(lane, r)][k + mma_a_elem(kb, r) + e];
      for (int r = 0; r < 2; ++r)
        for (int e = 0; e < 2; ++e) b[lane][2 * r + e] = W[mma_b_row(lane)][k + mma_b_elem(kb, r) + e];
    }
    mma_emulated(a, b, d);
  }
  int checked = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int c = 0; c < 4; ++c) {
      const int t = mma_c_token(lane, c), n = mma_c_row(lane, c);
      float want = 0.f;
      for (int k = 0; k < kMmaStepK; ++k) want += X[t][k] * W[n][k];
      CHECK(d[lane][c] == want);
      ++checked;
    }
  CHECK_EQ(checked, 16 * 8);  // every (token, row) of the tile is some lane's accumulator exactly once
}

static void test_down_proj_plan() {
  // 31B (Hb 5376, Hd 1024) at T = 1 on 132 SMs: 32 row tiles x 4 k splits of 84 steps
  DownProjPlan p = plan_down_proj(1, 5376, 1024, 132);
  CHECK_EQ(p.token_tiles_m16, 1);
  CHECK_EQ(p.row_tiles, 32);
  CHECK_EQ(p.splits, 4);
  CHECK_EQ(p.steps_per_split, 84);
  CHECK_EQ(down_proj_counters(p), 32);
  // E2B (Hb 1536, Hd 256): 8 row tiles, k split 12 ways (one step per warp)
  p = plan_down_proj(1, 1536, 256, 132);
  CHECK_EQ(p.row_tiles, 8);
  CHECK_EQ(p.splits, 12);
  CHECK_EQ(p.steps_per_split, 8);
  // T = 64: one 64-token tile; T = 300: five
  p = plan_down_proj(64, 5376, 1024, 132);
  CHECK_EQ(p.token_tiles_m16, 4);
  CHECK_EQ(p.token_tiles, 1);
  p = plan_down_proj(300, 256, 1024, 132);
  CHECK_EQ(p.token_tiles, 5);
  CHECK_EQ(p.splits, 1);
  CHECK_EQ(down_proj_counters(p), 0);
  // the splits cover every step exactly: splits * steps_per_split >= steps > (splits - 1) * steps_per_split
  for (int64_t Hb : {0, 8, 24, 100, 1536, 5376})
    for (int64_t T : {1, 17, 64, 65})
      for (int64_t Hd : {5, 256, 1024}) {
        p = plan_down_proj(T, Hb, Hd, 132);
        const int64_t steps = ceil_div(2 * Hb, kMmaStepK);
        CHECK(p.splits >= 1 && p.steps_per_split >= 1);
        CHECK(int64_t(p.splits) * p.steps_per_split >= steps);
        CHECK(int64_t(p.splits - 1) * p.steps_per_split < max64(steps, 1));
        CHECK(int64_t(p.row_tiles) * kMmaRowsPerCta >= Hd && int64_t(p.token_tiles) * 16 * p.token_tiles_m16 >= T);
      }
}

int main() {
  test_order();
  test_radix_select();
  test_candidate_merge();
  test_plan();
  test_mma_mapping();
  test_down_proj_plan();
  return finish("test_topk");
}
