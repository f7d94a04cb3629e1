// Decision rules of tree_verify that are not GPU specific: argmax and softmax-statistics merging,
// the inverse-CDF crossing search over one thread's items, and the walk of a draft tree. They mirror
// gemma4_mtp_kernels/reference/tree_verify.py and are exercised on the CPU by csrc/tests/test_tree.cpp.
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
G4_HD uint64_t argmax_key(ArgMax a) {
  const uint32_t order = a.value != a.value ? 0xffffffffu : orderable_bits(a.value);
  return (static_cast<uint64_t>(order) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(a.index));
}

G4_HD ArgMax argmax_merge(ArgMax a, ArgMax b) { return argmax_key(b) > argmax_key(a) ? b : a; }

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

G4_HD MaxSum maxsum_add(MaxSum a, float y) {
  // a -inf logit (a masked token) adds nothing; without this, an empty a (m = -inf) would compute
  // exp(-inf - -inf) = NaN
  if (y == -INFINITY) return a;
  if (y > a.m) {
    const float s = a.s * expf(a.m - y) + 1.f;  // exp(-inf) = 0 when a is empty
    return {y, s};
  }
  return {a.m, a.s + expf(y - a.m)};
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

// Inverse CDF over one thread's `n` contiguous probabilities p[0..n) whose cumulative sum starts at
// `cdf0`: the first local index where the running sum exceeds u, or kNoIndex. A block combines the
// threads' answers with a minimum (prefix sums computed in parallel are not monotone across threads,
// so the first crossing, not any crossing, is the answer). Only an item with p > 0 can cross: in the
// sequential rule the crossing step always adds mass, but a thread's parallel start cdf0 can round
// above u while its left neighbour's own running sum stayed at or below u, and the thread must then
// not answer with a zero-probability (masked) id.
G4_HD int first_crossing(const float* p, int n, double cdf0, double u) {
  double cdf = cdf0;
  for (int i = 0; i < n; ++i) {
    cdf += static_cast<double>(p[i]);
    if (cdf > u && p[i] > 0.f) return i;
  }
  return kNoIndex;
}

// Greedy and deterministic-draft sampling: at node u the target picked token tok[u]; the lowest-index
// child of u holding it is accepted. Chain drafts with draft probabilities: the decision at node u is
// accept[u] (accept the only child) with tok[u] the bonus on rejection or at the leaf.
// accept == nullptr selects the token-matching rule. Writes accepted_nodes[0..N) and output_tokens[0..N)
// (then -1), returns the accepted length and sets *last_node. IntPtr may be a volatile pointer (the
// kernel reads decisions that other CTAs wrote). A node whose decision is kNoToken (no distribution)
// ends the walk with bonus -1 even if an (unchecked, invalid) draft token is -1 too.
template <class TokT, class IntPtr>
G4_HD int walk_tree(const int* parents, const TokT* draft, IntPtr tok, IntPtr accept, int N,
                    int* accepted_nodes, int64_t* output_tokens, int* last_node) {
  int u = 0, n = 0;
  int64_t bonus = -1;
  for (;;) {
    int child = -1;
    const int64_t t = tok[u];
    if (t != kNoToken) {
      for (int c = u + 1; c < N && child < 0; ++c)
        if (parents[c] == u && (accept != nullptr ? accept[u] != 0 : static_cast<int64_t>(draft[c]) == t)) child = c;
    }
    if (child < 0) {
      bonus = t;
      break;
    }
    accepted_nodes[n] = child;
    output_tokens[n] = static_cast<int64_t>(draft[child]);
    ++n;
    u = child;
  }
  for (int i = n; i < N; ++i) accepted_nodes[i] = -1;
  output_tokens[n] = bonus;  // n < N: every accepted node is a distinct non-root node
  for (int i = n + 1; i < N; ++i) output_tokens[i] = -1;
  *last_node = n ? accepted_nodes[n - 1] : 0;
  return n;
}

}  // namespace gemma4_mtp
