// Decision rules of tree_verify that are not GPU specific: argmax and softmax-statistics merging,
// the inverse-CDF crossing search over one thread's items, which child a decision accepts, the walk
// along the accepted children, and the launch plan. They mirror gemma4_mtp_kernels/reference/tree_verify.py
// and are exercised on the CPU by csrc/tests/test_tree.cpp.
#pragma once

#include <cmath>

#include "gemma4_mtp/host_device.h"
#include "gemma4_mtp/topk_logic.h"

namespace gemma4_mtp {

constexpr int kNoIndex = 0x7fffffff;

struct ArgMax {
  float value;
  int index;
};

G4_HD ArgMax argmax_identity() { return {-INFINITY, kNoIndex}; }

// torch.argmax semantics: highest value, ties to the lowest index, and NaN above everything (the first
// NaN wins), so that a row of NaN logits still yields an id in [0, V), never kNoIndex.
// Compared as one 64-bit key: the value's order bits (NaN above +inf, -0 == +0), then the inverted
// index, so the larger key wins.
G4_HD uint64_t argmax_key(ArgMax a) { return topk_key(orderable_bits(a.value), static_cast<uint32_t>(a.index)); }

G4_HD ArgMax argmax_merge(ArgMax a, ArgMax b) { return argmax_key(b) > argmax_key(a) ? b : a; }

// The (value, index) of an argmax_key (NaN for the order bits of NaN; -0 comes back +0).
G4_HD ArgMax argmax_of_key(uint64_t key) { return ArgMax{topk_key_value(key), static_cast<int>(topk_key_index(key))}; }

// argmax_merge(a, {value, index}) for an index above every index already in a (one thread's scan in
// ascending ids): a tie never replaces an element (only the empty identity), so only "greater, NaN
// greatest" is tested.
G4_HD ArgMax argmax_push(ArgMax a, float value, int index) {
  const bool greater = value > a.value || (value != value && a.value == a.value);
  return (greater || a.index == kNoIndex) ? ArgMax{value, index} : a;
}

// Softmax statistics of a set of values y: m = max y, s = sum exp(y - m).
struct MaxSum {
  float m;
  float s;
};

G4_HD MaxSum maxsum_identity() { return {-INFINITY, 0.f}; }

// Adds n values at once: one exp per value against the running maximum after the batch (no rescale
// per value). -inf values (masked tokens) add nothing; a NaN value makes s NaN (and the row one
// without a distribution, see has_distribution), even when it comes first or every other value is
// -inf; an overflowed +inf makes s NaN too. The shift is 0 while the maximum is -inf, so that no
// exp(-inf - -inf) = NaN comes from masked values alone.
G4_HD MaxSum maxsum_add(MaxSum a, const float* y, int n) {
  float mb = -INFINITY;
  for (int i = 0; i < n; ++i) mb = fmaxf(mb, y[i]);  // fmaxf skips NaN
  const float m = fmaxf(a.m, mb);
  const float shift = m == -INFINITY ? 0.f : m;
  float s = a.s * expf(a.m - shift);
  for (int i = 0; i < n; ++i) s += expf(y[i] - shift);
  return {m, s};
}

G4_HD MaxSum maxsum_merge(MaxSum a, MaxSum b) {
  if (b.s == 0.f) return a;
  if (a.s == 0.f) return b;
  const float m = a.m > b.m ? a.m : b.m;
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Whether a sampling row's softmax statistics (over logits / temperature) describe a distribution.
// The public op refuses rows without one only where it checks values (CPU); on the GPU such a row
// reaches the kernel: all logits -inf leave s = 0, a NaN logit makes s NaN, and a temperature so small
// that x / T overflows makes m = +inf (or s NaN when two ids overflow). Its probabilities would all be
// NaN, so the row emits kNoToken and accepts nothing, like the Triton backend.
G4_HD bool has_distribution(MaxSum ms) {
  return ms.s > 0.f && ms.s < INFINITY && ms.m > -INFINITY && ms.m < INFINITY;  // false for NaN too
}

constexpr int kNoToken = -1;
constexpr int kNoNode = -1;

// Inverse CDF over one thread's `n` contiguous probabilities p[0..n) whose cumulative sum starts at
// `cdf0`: the first local index where the running sum exceeds u, or kNoIndex; *before gets the
// running sum before that index. A block combines the threads' answers with a minimum (prefix sums
// computed in parallel are not monotone across threads, so the first crossing, not any crossing, is
// the answer). Only an item with p > 0 can cross: in the sequential rule the crossing step always
// adds mass, but a thread's parallel start cdf0 can round above u while its left neighbour's own
// running sum stayed at or below u, and the thread must then not answer with a zero-probability
// (masked) id.
G4_HD int first_crossing(const float* p, int n, double cdf0, double u, double* before) {
  double cdf = cdf0;
  for (int i = 0; i < n; ++i) {
    const double next = cdf + static_cast<double>(p[i]);
    if (next > u && p[i] > 0.f) {
      *before = cdf;
      return i;
    }
    cdf = next;
  }
  return kNoIndex;
}

// Whether node c (of a request whose nodes hold `parent_c` and `draft_c`) is a child of u that the
// token rule accepts for the target's token t. The accepted child is the lowest such c (duplicates:
// the lowest index wins); a row without a distribution (t == kNoToken) accepts nothing, even an
// unchecked draft token -1.
G4_HD bool token_accepts(int parent_c, int64_t draft_c, int u, int64_t t) {
  return t != kNoToken && parent_c == u && draft_c == t;
}

// Where each node's decision leads: tok[u] is the target's token at u (the bonus when the walk stops
// there) and next[u] the accepted child (kNoNode: stop). Decisions come from token_accepts (greedy,
// deterministic-draft sampling) or from the draft-probability test (chains); an accepted child always
// holds tok[u] and has a higher index than u. Node(u, &tok, &next) reads one node's decision, so the
// kernel can read them from shared or global memory. Writes accepted_nodes[0..N) and
// output_tokens[0..N) (then -1), returns the accepted length and sets *last_node.
template <class Node>
G4_HD int follow_path(Node node, int N, int* accepted_nodes, int64_t* output_tokens, int* last_node) {
  int u = 0, n = 0;
  int64_t tok;
  int next;
  for (;;) {
    node(u, &tok, &next);
    if (next <= u || next >= N) break;  // kNoNode; anything else that is not a later node stops the walk too
    accepted_nodes[n] = next;
    output_tokens[n] = tok;
    ++n;
    u = next;
  }
  for (int i = n; i < N; ++i) accepted_nodes[i] = -1;
  output_tokens[n] = tok;  // the bonus; n < N: every accepted node is a distinct non-root node
  for (int i = n + 1; i < N; ++i) output_tokens[i] = -1;
  *last_node = n ? accepted_nodes[n - 1] : 0;
  return n;
}

// The launch plan: each node's row of V logits is cut into chunks of `chunk` ids (one CTA each, a
// multiple of `tile`, the ids a CTA loads in one batch), each chunk into `warps` granules (one warp
// each) whose statistics the row's decision merges. Chunks are as long as up to `max_tiles` batches
// while the grid still has about 8 CTAs per SM (between two and three waves of the 3 that fit): long
// chunks amortise a CTA's counter round trips, short ones fill the GPU for small batches.
struct TreePlan {
  int num_chunks;
  int64_t chunk;
  int64_t granule;  // ids per granule (chunk / warps)
  int granules;     // per row: num_chunks * warps
};

inline TreePlan tree_plan(int64_t rows, int64_t V, int num_sms, int64_t tile, int max_tiles, int warps) {
  const int64_t want = 8 * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  int64_t tiles = rows * ceil_div(V, tile) / want;
  tiles = max64(1, min64(tiles, min64(max_tiles, ceil_div(V, tile))));
  const int64_t chunk = tiles * tile;
  const int num_chunks = static_cast<int>(ceil_div(V, chunk));
  return {num_chunks, chunk, chunk / warps, num_chunks * warps};
}

}  // namespace gemma4_mtp
