// tree_verify's decision rules: argmax ties, softmax statistics merging, the blocked inverse-CDF
// search (arranged exactly as tree::block_inverse_cdf arranges it: tiles of threads x items,
// an exclusive scan of per-thread sums, then the minimum of the threads' first crossings) against
// the reference's sequential rule, the child decisions and the walk along them, and the launch plan.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "check.h"
#include "gemma4_mtp/tree_logic.h"

using namespace gemma4_mtp;

static void test_argmax_ties() {
  ArgMax a = argmax_identity();
  const float vals[] = {1.f, 3.f, -2.f, 3.f, 0.f};
  for (int i = 0; i < 5; ++i) a = argmax_merge(a, ArgMax{vals[i], i});
  CHECK_EQ(a.index, 1);
  // merge order does not matter (the grid combines chunks in any order)
  ArgMax b = argmax_identity();
  for (int i = 4; i >= 0; --i) b = argmax_merge(b, ArgMax{vals[i], i});
  CHECK_EQ(b.index, 1);
  // all -inf: the lowest index, like torch.argmax
  ArgMax c = argmax_identity();
  for (int i = 3; i >= 0; --i) c = argmax_merge(c, ArgMax{-INFINITY, i});
  CHECK_EQ(c.index, 0);
  // NaN is the maximum and the first NaN wins, like torch.argmax, in any merge order; a row of NaN
  // logits must give a real id, never kNoIndex (it becomes a token)
  const float n = NAN;
  const float with_nan[] = {1.f, n, 2.f, n, INFINITY};
  ArgMax d = argmax_identity(), e = argmax_identity();
  for (int i = 0; i < 5; ++i) d = argmax_merge(d, ArgMax{with_nan[i], i});
  for (int i = 4; i >= 0; --i) e = argmax_merge(e, ArgMax{with_nan[i], i});
  CHECK_EQ(d.index, 1);
  CHECK_EQ(e.index, 1);
  CHECK_EQ(argmax_merge(ArgMax{n, 3}, ArgMax{n, 2}).index, 2);
  CHECK_EQ(argmax_merge(ArgMax{n, 3}, ArgMax{INFINITY, 0}).index, 3);
  ArgMax f = argmax_identity();
  for (int i = 3; i >= 0; --i) f = argmax_merge(f, ArgMax{n, i});
  CHECK_EQ(f.index, 0);
  // argmax_push (a thread's scan in ascending ids) agrees with argmax_merge, NaN and ties included
  const float row[] = {-INFINITY, 2.f, n, 2.f, INFINITY, n, -1.f};
  ArgMax merged = argmax_identity(), pushed = argmax_identity();
  for (int i = 0; i < 7; ++i) {
    merged = argmax_merge(merged, ArgMax{row[i], i});
    pushed = argmax_push(pushed, row[i], i);
    CHECK_EQ(pushed.index, merged.index);
  }
  CHECK_EQ(pushed.index, 2);
}

static void test_maxsum() {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 5.f);
  std::vector<float> y(1000);
  for (auto& v : y) v = nd(rng);
  const float m = *std::max_element(y.begin(), y.end());
  double s = 0;
  for (float v : y) s += std::exp(double(v) - m);
  MaxSum parts[7];
  for (auto& p : parts) p = maxsum_identity();
  for (size_t i = 0; i < y.size(); ++i) parts[(i * 31) % 7] = maxsum_add(parts[(i * 31) % 7], &y[i], 1);
  MaxSum all = maxsum_identity();
  for (int i = 6; i >= 0; --i) all = maxsum_merge(all, parts[i]);
  CHECK(all.m == m);
  CHECK(std::fabs(all.s - s) <= 1e-5 * s);
  CHECK(maxsum_merge(maxsum_identity(), maxsum_identity()).s == 0.f);

  // masked (-inf) logits add nothing, wherever they fall in a chunk: first, last, or the whole chunk
  MaxSum masked = maxsum_identity();
  const float row[] = {-INFINITY, -INFINITY, 1.f, -INFINITY, 2.f, -INFINITY};
  for (float v : row) masked = maxsum_add(masked, &v, 1);
  CHECK(masked.m == 2.f);
  CHECK(std::fabs(masked.s - (1.f + std::exp(-1.f))) <= 1e-6f);
  MaxSum all_masked = maxsum_identity();
  const float minus_inf = -INFINITY;
  for (int i = 0; i < 4; ++i) all_masked = maxsum_add(all_masked, &minus_inf, 1);
  CHECK(all_masked.s == 0.f);
  const MaxSum merged = maxsum_merge(all_masked, masked);
  CHECK(merged.m == 2.f && merged.s == masked.s);
  CHECK(maxsum_merge(masked, all_masked).s == masked.s);

  // batches (a lane's vector at a time) give the statistics of one value at a time
  for (int n : {2, 8, 32}) {
    MaxSum batched = maxsum_identity();
    for (size_t i = 0; i + n <= y.size(); i += n) batched = maxsum_add(batched, &y[i], n);
    MaxSum single = maxsum_identity();
    for (size_t i = 0; i < y.size() / n * n; ++i) single = maxsum_add(single, &y[i], 1);
    CHECK(batched.m == single.m);
    CHECK(std::fabs(batched.s - single.s) <= 1e-5f * single.s);
  }
  const float batch_masked[] = {-INFINITY, 1.f, -INFINITY, 2.f};
  const MaxSum bm = maxsum_add(maxsum_identity(), batch_masked, 4);
  CHECK(bm.m == 2.f && std::fabs(bm.s - (1.f + std::exp(-1.f))) <= 1e-6f);
  // a NaN poisons the sum wherever it falls: alone with masked values (the maximum is still -inf),
  // first in a batch, or after a larger maximum; +inf (overflowed x / T) too
  const float n = NAN;
  const float nan_masked[] = {-INFINITY, n};
  CHECK(std::isnan(maxsum_add(maxsum_identity(), nan_masked, 2).s));
  const float nan_first[] = {n, 1.f, 2.f};
  CHECK(std::isnan(maxsum_add(maxsum_identity(), nan_first, 3).s));
  CHECK(std::isnan(maxsum_add(bm, &n, 1).s));
  const float overflow[] = {1.f, INFINITY};
  CHECK(!has_distribution(maxsum_add(maxsum_identity(), overflow, 2)));
}

static int sequential_inverse_cdf(const std::vector<float>& p, double u) {
  double cdf = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    cdf += p[i];
    if (cdf > u) return int(i);
  }
  for (int i = int(p.size()) - 1; i >= 0; --i)
    if (p[i] > 0.f) return i;
  return -1;
}

static int blocked_inverse_cdf(const std::vector<float>& p, double u, int threads, int items) {
  const int V = int(p.size());
  double carry = 0;
  int last = -1;
  for (int base = 0; base < V; base += threads * items) {
    std::vector<double> sums(threads, 0.0);
    std::vector<float> tile(size_t(threads) * items, 0.f);
    for (int t = 0; t < threads; ++t)
      for (int e = 0; e < items; ++e) {
        const int i = base + t * items + e;
        const float v = i < V ? p[i] : 0.f;
        tile[size_t(t) * items + e] = v;
        sums[t] += v;
        if (v > 0.f) last = std::max(last, i);
      }
    double excl = 0, total = 0;
    for (double s : sums) total += s;
    int found = kNoIndex;
    double found_before = 0;
    for (int t = 0; t < threads; ++t) {
      double before = -1;
      const int local = first_crossing(&tile[size_t(t) * items], items, carry + excl, u, &before);
      if (local != kNoIndex && base + t * items + local < found) {
        found = base + t * items + local;
        found_before = before;
      }
      excl += sums[t];
    }
    if (found != kNoIndex) {
      // the cumulative weight before the answer, which the kernel carries into the granule's rescan
      double cdf = 0;
      for (int i = 0; i < found; ++i) cdf += p[i];
      CHECK(std::fabs(found_before - cdf) <= 1e-9);
      return found;
    }
    carry += total;
  }
  return last;
}

static void test_inverse_cdf() {
  std::mt19937 rng(4);
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int V = 1 + rng() % 5000;
    std::vector<float> p(V);
    double z = 0;
    const bool sparse = trial % 3 == 0;
    for (auto& v : p) {
      v = (sparse && rng() % 4) ? 0.f : float(std::exp(6.0 * unif(rng)));
      z += v;
    }
    if (z == 0) {
      p[rng() % V] = 1.f;
      z = 1;
    }
    for (auto& v : p) v = float(v / z);
    for (int k = 0; k < 5; ++k) {
      const double u = k == 4 ? std::nextafter(1.0, 0.0) : unif(rng);
      const int want = sequential_inverse_cdf(p, u);
      CHECK_EQ(blocked_inverse_cdf(p, u, 256, 8), want);  // the kernel's kThreads x kItems
      CHECK_EQ(blocked_inverse_cdf(p, u, 256, 16), want);
      CHECK_EQ(blocked_inverse_cdf(p, u, 32, 3), want);
      CHECK(want >= 0 && p[want] > 0.f);  // never a zero-probability id
    }
  }
  // total rounding below u: the last id with nonzero probability
  std::vector<float> p = {0.25f, 0.25f, 0.25f, 0.f};
  CHECK_EQ(blocked_inverse_cdf(p, 0.9, 2, 1), 2);
  CHECK_EQ(sequential_inverse_cdf(p, 0.9), 2);

  // A thread whose parallel start (its exclusive prefix) rounds above u must answer with its first
  // item of nonzero probability, never with a masked (p = 0) id before it.
  double before = -1;
  const float masked_head[] = {0.f, 0.f, 0.5f, 0.5f};
  CHECK_EQ(first_crossing(masked_head, 4, 0.6, 0.5, &before), 2);
  CHECK(before == 0.6);
  const float all_masked[] = {0.f, 0.f};
  CHECK_EQ(first_crossing(all_masked, 2, 0.6, 0.5, &before), kNoIndex);
  // the ordinary case is unchanged: the first item that pushes the running sum above u
  const float plain[] = {0.25f, 0.f, 0.25f, 0.5f};
  CHECK_EQ(first_crossing(plain, 4, 0.0, 0.3, &before), 2);
  CHECK(before == 0.25);
  CHECK_EQ(first_crossing(plain, 4, 0.0, 0.2, &before), 0);
  CHECK(before == 0.0);
}

// Statistics of one row of logits / temperature split over `chunks` chunks, merged like the kernel.
static MaxSum row_stats(const std::vector<float>& x, float temperature, int chunks) {
  std::vector<MaxSum> parts(chunks, maxsum_identity());
  const size_t per = (x.size() + chunks - 1) / chunks;
  for (size_t i = 0; i < x.size(); ++i) {
    const float y = x[i] / temperature;
    parts[i / per] = maxsum_add(parts[i / per], &y, 1);
  }
  MaxSum all = maxsum_identity();
  for (const MaxSum& p : parts) all = maxsum_merge(all, p);
  return all;
}

// Rows the GPU does not check: no distribution means token -1, never a sample from NaN probabilities.
static void test_has_distribution() {
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(float(i)) * 4.f;
  for (int chunks : {1, 4}) {
    CHECK(has_distribution(row_stats(x, 1.f, chunks)));
    CHECK(has_distribution(row_stats(x, 1e30f, chunks)));  // x / T -> 0: uniform, still a distribution
    std::vector<float> masked(x.size(), -INFINITY);
    CHECK(!has_distribution(row_stats(masked, 1.f, chunks)));
    masked[37] = 0.5f;  // one unmasked id is enough
    CHECK(has_distribution(row_stats(masked, 1.f, chunks)));
    for (size_t at : {size_t(0), size_t(37), x.size() - 1}) {  // a NaN first, inside, or last in a chunk
      std::vector<float> nan_row = x;
      nan_row[at] = NAN;
      CHECK(!has_distribution(row_stats(nan_row, 1.f, chunks)));
    }
    // x / T overflows: to +inf for the logits above 3.4 (several) or for one, to -inf for the others
    CHECK(!has_distribution(row_stats(x, 1e-38f, chunks)));
    std::vector<float> one_big(x.size(), -10.f);
    one_big[5] = 10.f;
    CHECK(!has_distribution(row_stats(one_big, 1e-38f, chunks)));
    // ... and when every logit overflows to -inf there is no mass at all
    std::vector<float> negative(x.size(), -10.f);
    CHECK(!has_distribution(row_stats(negative, 1e-38f, chunks)));
  }
  CHECK(!has_distribution(maxsum_identity()));
  CHECK(!has_distribution(MaxSum{0.f, INFINITY}));
  CHECK(!has_distribution(MaxSum{NAN, 1.f}));
}

struct Walk {
  int n, last;
  std::vector<int> nodes;
  std::vector<int64_t> tokens;
};

// Decisions as the kernel makes them (the token rule, or accept flags for draft-probability chains:
// the first child), then the walk along them.
static Walk run_walk(const std::vector<int>& parents, const std::vector<int64_t>& draft, const std::vector<int>& tok,
                     const std::vector<int>* accept) {
  const int N = int(parents.size());
  std::vector<int> next(N, kNoNode);
  for (int u = 0; u < N; ++u) {
    for (int c = N - 1; c > u; --c) {  // the lowest matching child wins
      if (accept != nullptr ? (parents[c] == u && tok[u] != kNoToken && (*accept)[u])
                            : token_accepts(parents[c], draft[c], u, tok[u]))
        next[u] = c;
    }
  }
  Walk w;
  w.nodes.assign(N, 7);
  w.tokens.assign(N, 7);
  auto node = [&](int u, int64_t* t, int* nx) {
    *t = tok[u];
    *nx = next[u];
  };
  w.n = follow_path(node, N, w.nodes.data(), w.tokens.data(), &w.last);
  return w;
}

static void test_walk() {
  // chain -1,0,1,2 with drafts 5,6,7,8: target agrees at nodes 0 and 1, then says 9
  {
    const Walk w = run_walk({-1, 0, 1, 2}, {5, 6, 7, 8}, {6, 7, 9, 0}, nullptr);
    CHECK_EQ(w.n, 2);
    CHECK_EQ(w.last, 2);
    CHECK(w.nodes == (std::vector<int>{1, 2, -1, -1}));
    CHECK(w.tokens == (std::vector<int64_t>{6, 7, 9, -1}));
  }
  // whole chain accepted: the bonus comes from the leaf
  {
    const Walk w = run_walk({-1, 0, 1}, {5, 6, 7}, {6, 7, 42}, nullptr);
    CHECK_EQ(w.n, 2);
    CHECK(w.tokens == (std::vector<int64_t>{6, 7, 42}));
  }
  // nothing accepted
  {
    const Walk w = run_walk({-1, 0}, {5, 6}, {3, 0}, nullptr);
    CHECK_EQ(w.n, 0);
    CHECK_EQ(w.last, 0);
    CHECK(w.nodes == (std::vector<int>{-1, -1}));
    CHECK(w.tokens == (std::vector<int64_t>{3, -1}));
  }
  // tree: root children 1 (tok 4), 2 (tok 4, duplicate), 3 (tok 5); node 2 has child 4; padding 5.
  // The lowest-index child holding the target's token wins, so node 1 is taken, not node 2.
  {
    const Walk w = run_walk({-1, 0, 0, 0, 2, -1}, {9, 4, 4, 5, 8, 0}, {4, 11, 8, 0, 0, 0}, nullptr);
    CHECK_EQ(w.n, 1);
    CHECK_EQ(w.last, 1);
    CHECK(w.tokens == (std::vector<int64_t>{4, 11, -1, -1, -1, -1}));
  }
  // the second branch: root picks 5 -> node 3, a leaf
  {
    const Walk w = run_walk({-1, 0, 0, 0, 3}, {9, 4, 4, 5, 8}, {5, 0, 0, 8, 2}, nullptr);
    CHECK_EQ(w.n, 2);
    CHECK(w.nodes == (std::vector<int>{3, 4, -1, -1, -1}));
    CHECK(w.tokens == (std::vector<int64_t>{5, 8, 2, -1, -1}));
  }
  // draft-probability chains: accept flags decide, the token of the rejecting node is the bonus
  {
    const std::vector<int> acc = {1, 0, 1};
    const Walk w = run_walk({-1, 0, 1}, {5, 6, 7}, {6, 13, 0}, &acc);
    CHECK_EQ(w.n, 1);
    CHECK(w.tokens == (std::vector<int64_t>{6, 13, -1}));
  }
  {
    const std::vector<int> acc = {1, 1, 0};  // leaf: no child, bonus drawn from p_leaf
    const Walk w = run_walk({-1, 0, 1}, {5, 6, 7}, {6, 7, 21}, &acc);
    CHECK_EQ(w.n, 2);
    CHECK_EQ(w.last, 2);
    CHECK(w.tokens == (std::vector<int64_t>{6, 7, 21}));
  }
  // a row without a distribution (kNoToken) ends the walk with bonus -1, even where an unchecked draft
  // token is -1 too or the draft-probs decision says accept
  {
    const Walk w = run_walk({-1, 0, 1}, {5, 6, 7}, {6, kNoToken, 9}, nullptr);
    CHECK_EQ(w.n, 1);
    CHECK_EQ(w.last, 1);
    CHECK(w.nodes == (std::vector<int>{1, -1, -1}));
    CHECK(w.tokens == (std::vector<int64_t>{6, -1, -1}));
  }
  {
    const Walk w = run_walk({-1, 0, 0}, {5, -1, 3}, {kNoToken, 1, 2}, nullptr);
    CHECK_EQ(w.n, 0);
    CHECK_EQ(w.last, 0);
    CHECK(w.nodes == (std::vector<int>{-1, -1, -1}));
    CHECK(w.tokens == (std::vector<int64_t>{-1, -1, -1}));
  }
  {
    const std::vector<int> acc = {1, 1, 0};
    const Walk w = run_walk({-1, 0, 1}, {5, 6, 7}, {kNoToken, 7, 21}, &acc);
    CHECK_EQ(w.n, 0);
    CHECK(w.tokens == (std::vector<int64_t>{-1, -1, -1}));
  }
  // single node
  {
    const Walk w = run_walk({-1}, {5}, {17}, nullptr);
    CHECK_EQ(w.n, 0);
    CHECK(w.tokens == (std::vector<int64_t>{17}));
  }
  // a decision pointing nowhere useful (not a later node) stops the walk instead of looping
  {
    Walk w;
    w.nodes.assign(3, 7);
    w.tokens.assign(3, 7);
    const int next[] = {1, 0, 5};
    auto node = [&](int u, int64_t* t, int* nx) {
      *t = 10 + u;
      *nx = next[u];
    };
    w.n = follow_path(node, 3, w.nodes.data(), w.tokens.data(), &w.last);
    CHECK_EQ(w.n, 1);
    CHECK(w.tokens == (std::vector<int64_t>{10, 11, -1}));
  }
}

static void test_plan() {
  for (int64_t rows : {1, 5, 8, 40, 320, 4096})
    for (int64_t V : {1, 50, 3001, 8192, 20001, 262144})
      for (int64_t tile : {1024, 4096, 8192}) {
        const TreePlan p = tree_plan(rows, V, 132, tile, 4, 8);
        CHECK(p.chunk % tile == 0 && p.chunk >= tile && p.chunk <= 4 * tile);
        CHECK(int64_t(p.num_chunks) * p.chunk >= V);        // the chunks cover the row ...
        CHECK(int64_t(p.num_chunks - 1) * p.chunk < V);     // ... and none is empty
        CHECK(p.granule * 8 == p.chunk && p.granules == p.num_chunks * 8);
      }
  // small batches get one batch of loads per CTA (most CTAs), large ones long chunks
  CHECK_EQ(tree_plan(5, 262144, 132, 8192, 4, 8).chunk, 8192);
  CHECK_EQ(tree_plan(320, 262144, 132, 8192, 4, 8).chunk, 4 * 8192);
}

int main() {
  test_argmax_ties();
  test_maxsum();
  test_has_distribution();
  test_inverse_cdf();
  test_walk();
  test_plan();
  return finish("test_tree");
}
