// Centroid top-k ordering: the 64-bit keys sort as "higher score, then lower index" (the reference's
// stable descending sort), and the kernel's bitonic network, run here sequentially, sorts them.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"
#include "gemma4_mtp/topk_logic.h"

using namespace gemma4_mtp;

// The kernel's network: n slots (padding keys 0), every element computes its new value from the old
// values of itself and its partner (as threads and lanes do in parallel).
static std::vector<uint32_t> bitonic_topk(const std::vector<float>& scores, int k, int n) {
  const int C = int(scores.size());
  std::vector<uint64_t> keys(n, 0);
  for (int i = 0; i < C; ++i) keys[i] = topk_key(scores[i], uint32_t(i));
  for (int kk = 2; kk <= n; kk <<= 1)
    for (int j = kk >> 1; j > 0; j >>= 1) {
      std::vector<uint64_t> next(n);
      for (int i = 0; i < n; ++i) next[i] = bitonic_exchange(uint32_t(i), uint32_t(j), uint32_t(kk), keys[i], keys[i ^ j]);
      keys.swap(next);
    }
  std::vector<uint32_t> out(k);
  for (int i = 0; i < k; ++i) out[i] = topk_key_index(keys[i]);
  return out;
}

static std::vector<uint32_t> reference_topk(const std::vector<float>& scores, int k) {
  std::vector<uint32_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return scores[a] > scores[b]; });
  idx.resize(k);
  return idx;
}

static void test_orderable() {
  const float v[] = {-INFINITY, -1e30f, -2.f, -1.f, -1e-30f, 0.f, 1e-30f, 1.f, 2.f, 1e30f, INFINITY};
  for (size_t i = 0; i + 1 < sizeof v / sizeof v[0]; ++i) CHECK(orderable_bits(v[i]) < orderable_bits(v[i + 1]));
  CHECK(orderable_bits(-0.f) == orderable_bits(0.f));
  // equal scores: the lower index has the larger key
  CHECK(topk_key(1.f, 3) > topk_key(1.f, 4));
  CHECK(topk_key(1.f, 4000) > topk_key(0.5f, 0));
  CHECK_EQ(topk_key_index(topk_key(-3.f, 1234)), 1234u);
}

static void test_sort() {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int C : {1, 2, 3, 32, 100, 2048, 3000, 4096}) {
    for (int trial = 0; trial < 3; ++trial) {
      std::vector<float> s(C);
      for (auto& x : s) x = trial == 1 ? float(int(nd(rng) * 2)) : nd(rng);  // trial 1: many ties
      if (trial == 2 && C > 3) s[1] = -0.f, s[2] = 0.f;
      const int k = std::min(C, 32);
      CHECK(bitonic_topk(s, k, C <= 2048 ? 2048 : 4096) == reference_topk(s, k));  // the kernel's sizes
      int pow2 = 1;
      while (pow2 < C) pow2 <<= 1;
      CHECK(bitonic_topk(s, C, pow2) == reference_topk(s, C));  // the whole order, tightest size
    }
  }
}

int main() {
  test_orderable();
  test_sort();
  return finish("test_topk");
}
