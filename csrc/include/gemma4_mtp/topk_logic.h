// Ordering and selection logic of the centroid head (centroid_logits.cuh), tested on the CPU by
// csrc/tests/test_topk.cpp:
// - the order of (score, index) pairs: higher score first, then lower index (the reference's stable
//   descending sort), NaN above +inf, -0 == +0;
// - the radix select that picks the top_k clusters of one token: 4 passes over the 32 order bits of
//   the scores, 8 bits each, narrowing a prefix until the keys that share it are exactly the ones
//   still needed (early exit) or the full 32 bits are fixed (then equal scores go by lower index);
// centroid_logic.h has the rest (argmax partials, work plan). tree_logic.h uses orderable_bits.
#pragma once

#include "gemma4_mtp/host_device.h"

namespace gemma4_mtp {

// Monotone map of floats to unsigned ints in torch.sort's order: -0 and +0 equal, every NaN above +inf
// whatever its sign bit (x86's default NaN has it set: a bit-level map alone ranked it below -inf); the
// NaNs share one value, so their order among themselves is the index's.
G4_HD uint32_t orderable_bits(float f) {
  if (f != f) return 0xffffffffu;
  if (f == 0.f) f = 0.f;
  const uint32_t b = float_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The inverse of orderable_bits: a NaN's bits come back as a NaN, -0 as +0.
G4_HD float order_bits_value(uint32_t ob) { return bits_float((ob & 0x80000000u) ? ob & 0x7fffffffu : ~ob); }

// One 64-bit key per (score order bits, index) whose descending order is the reference's order.
G4_HD uint64_t topk_key(uint32_t order_bits, uint32_t index) {
  return (static_cast<uint64_t>(order_bits) << 32) | static_cast<uint32_t>(~index);
}

G4_HD uint32_t topk_key_index(uint64_t key) { return ~static_cast<uint32_t>(key & 0xffffffffu); }
G4_HD float topk_key_value(uint64_t key) { return order_bits_value(static_cast<uint32_t>(key >> 32)); }

constexpr int kRadixBins = 256;
constexpr int kRadixPasses = 4;

// Where the key of rank `need` (1-based, among the keys still in play) falls in one pass.
struct RadixStep {
  uint32_t digit;  // its digit in this pass
  uint32_t above;  // keys in play with a larger digit (all selected)
  uint32_t count;  // keys in play with this digit
};

// Scans n bins of digits d0, d0 - 1, ..., d0 - n + 1 (descending) with counts c[0..n); `above` keys in
// play have a digit above d0. Returns whether the rank-`need` key has one of these digits (then *out
// says which). The kernel's lanes each scan 8 bins after a warp prefix sum gives them `above`.
G4_HD bool radix_find(const uint32_t* c, int n, uint32_t d0, uint32_t above, uint32_t need, RadixStep* out) {
  for (int b = 0; b < n; ++b) {
    if (above < need && above + c[b] >= need) {
      *out = RadixStep{d0 - static_cast<uint32_t>(b), above, c[b]};
      return true;
    }
    above += c[b];
  }
  return false;
}

// The state of one selection: keys whose bits under `mask` equal `prefix` are still in play, and
// `need` of them are to be selected.
struct RadixState {
  uint32_t prefix, mask, need;
  int pass;
  bool done;  // every key in play is selected
};

G4_HD RadixState radix_init(uint32_t k) { return RadixState{0u, 0u, k, 0, false}; }

G4_HD bool radix_in_play(RadixState s, uint32_t key) { return (key & s.mask) == s.prefix; }

G4_HD uint32_t radix_digit(RadixState s, uint32_t key) { return (key >> (24 - 8 * s.pass)) & 0xffu; }

G4_HD RadixState radix_advance(RadixState s, RadixStep step) {
  const int shift = 24 - 8 * s.pass;
  s.prefix |= step.digit << shift;
  s.mask |= 0xffu << shift;
  s.need -= step.above;
  s.done = step.count == s.need;
  s.pass += 1;
  return s;
}

// Whether a key is selected once the passes are over. If they ended without `done`, the keys still in
// play all have the same 32 bits (equal scores) and `tie_order` is the key's position among them in
// ascending index: the `need` lowest indices are selected.
G4_HD bool radix_selected(RadixState s, uint32_t key, uint32_t tie_order) {
  const uint32_t high = key & s.mask;
  if (high != s.prefix) return high > s.prefix;
  return s.done || tie_order < s.need;
}

}  // namespace gemma4_mtp
