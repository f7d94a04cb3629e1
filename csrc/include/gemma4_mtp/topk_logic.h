// Ordering of (score, index) pairs for the centroid top-k: one 64-bit key whose descending order is
// "higher score first, then lower index", which is the stable descending sort of the reference.
// The kernel sorts keys with a bitonic network whose steps are bitonic_exchange; the host tests run
// the same network, every element deciding on its own, on the CPU (csrc/tests/test_topk.cpp).
#pragma once

#include "gemma4_mtp/host_device.h"

namespace gemma4_mtp {

// Monotone map of floats to unsigned ints (-0 and +0 compare equal, as in torch.sort).
G4_HD uint32_t orderable_bits(float f) {
  if (f == 0.f) f = 0.f;
  const uint32_t b = float_bits(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

G4_HD uint64_t topk_key(float score, uint32_t index) {
  return (static_cast<uint64_t>(orderable_bits(score)) << 32) | static_cast<uint32_t>(~index);
}

G4_HD uint32_t topk_key_index(uint64_t key) { return ~static_cast<uint32_t>(key & 0xffffffffu); }

// One compare-exchange of a descending bitonic sort over a power-of-two array: element i and its
// partner i ^ j in the merge stage of size k. Returns whether a[i] and a[i ^ j] must be swapped
// (call only for i < (i ^ j)).
G4_HD bool bitonic_should_swap(uint32_t i, uint32_t k, uint64_t a_i, uint64_t a_partner) {
  const bool descending = (i & k) == 0;
  return descending ? (a_i < a_partner) : (a_i > a_partner);
}

// The same step seen from either side of the pair: the new value of element i, given its value and
// its partner's. Both elements of a pair evaluate it independently (the kernel's threads and lanes
// exchange values instead of swapping in place).
G4_HD uint64_t bitonic_exchange(uint32_t i, uint32_t j, uint32_t k, uint64_t mine, uint64_t theirs) {
  const uint32_t partner = i ^ j;
  if (i < partner) return bitonic_should_swap(i, k, mine, theirs) ? theirs : mine;
  return bitonic_should_swap(partner, k, theirs, mine) ? theirs : mine;
}

}  // namespace gemma4_mtp
