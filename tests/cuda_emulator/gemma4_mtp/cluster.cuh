// Emulated stand-in for csrc/include/gemma4_mtp/cluster.cuh (found first on the emulator's include path):
// the blocks of a cluster launch run at once (emu.h's cudaLaunchKernelEx), meet at one barrier, and read
// each other's shared memory at the same offset. A block of a launch without clusters is a cluster of one.
#pragma once

#include <cstdint>

#include "emu.h"
#include "gemma4_mtp/common.cuh"

namespace gemma4_mtp {

constexpr bool kHasClusters = true;

inline void cluster_sync() {
  emu::Block* b = emu::block();
  emu::wait(b->cluster_barrier != nullptr ? *b->cluster_barrier : b->cta, true);
}

inline unsigned cluster_rank() { return emu::block()->cluster_rank; }

// p must lie in this block's shared memory; the same offset in block `rank`'s (an out-of-range rank or
// address fails the run).
template <class T>
inline T* cluster_peer(T* p, unsigned rank) {
  emu::Block* b = emu::block();
  const auto* bytes = reinterpret_cast<const unsigned char*>(p);
  if (bytes < b->smem || bytes >= b->smem + b->smem_bytes) emu::fail("cluster_peer: not this block's shared memory");
  const size_t size = b->cluster != nullptr ? b->cluster->size() : 1;
  if (rank >= size) emu::fail("cluster_peer: a rank outside the cluster");
  // the cluster's blocks are in schedule order, not rank order: the one of this rank
  emu::Block* target = b;
  if (b->cluster != nullptr)
    for (emu::Block& other : *b->cluster)
      if (other.cluster_rank == rank) target = &other;
  return reinterpret_cast<T*>(target->smem + (bytes - b->smem));
}

// The 16 bytes land in the peer's shared memory at once and count on its mbarrier (a phase may complete
// here, or later when its owner announces the bytes).
inline void st_async_peer(void* local_dst, unsigned rank, uint4 v, uint64_t* local_bar) {
  check_aligned(local_dst, 16, "misaligned st.async destination");
  unsigned char* dst = reinterpret_cast<unsigned char*>(cluster_peer(local_dst, rank));
  uint64_t* bar = cluster_peer(local_bar, rank);
  emu::Block* b = emu::block();
  emu::Block* peer = b;
  if (b->cluster != nullptr)
    for (emu::Block& other : *b->cluster)
      if (other.cluster_rank == rank) peer = &other;
  const auto it = peer->mbarriers.find(bar);
  if (it == peer->mbarriers.end()) emu::fail("st.async to an mbarrier the peer has not initialised");
  std::memcpy(dst, &v, 16);
  it->second.tx -= 16;
  ++emu::progress();
  mbarrier_try_complete(it->second, false);
}

}  // namespace gemma4_mtp
