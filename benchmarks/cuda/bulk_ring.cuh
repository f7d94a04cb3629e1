// The ring of bulk-copied shared-memory buffers through which the benchmark's streaming kernels read their
// weights, keys and values (cluster_gemv.cuh, stream_gemv.cuh, stream_attention.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gemma4_mtp/common.cuh"

// kSlots buffers of kSlotBytes, filled by bulk copies (cp.async.bulk) in the order of a kernel's stream: chunk j
// lands in buffer j % kSlots, whose mbarrier completes its (j / kSlots)-th phase when the chunk's bytes are in,
// so waiting for chunk j is waiting for that parity. A buffer is refilled (chunk j + kSlots) only after every
// thread's reads of chunk j, behind a barrier: the phases of one buffer never overtake each other.
template <int kSlots, int kSlotBytes>
struct BulkRing {
  static constexpr size_t kBytes = static_cast<size_t>(kSlots) * kSlotBytes;

  unsigned char* buf;  // kBytes of shared memory
  uint64_t* full;      // kSlots mbarriers

  // Thread 0, before fence_mbarrier_init: each phase one arrival, the filling thread's.
  __device__ void init() const {
    for (int b = 0; b < kSlots; ++b) gemma4_mtp::mbarrier_init(&full[b], 1);
  }
  // Thread 0: chunk j, `bytes` of src (at most kSlotBytes, a multiple of 16, src 16-byte aligned).
  __device__ void fill(int j, const void* src, unsigned bytes) const {
    uint64_t* bar = &full[j % kSlots];
    gemma4_mtp::mbarrier_arrive_expect_tx(bar, bytes);
    gemma4_mtp::bulk_copy_g2s(slot<unsigned char>(j), src, bytes, bar);
  }
  // Thread 0: chunk j gathered from `rows` rows of `row_bytes` each, `stride` bytes apart in global memory (one
  // key-value head's rows of a page whose rows interleave the heads), `dst_stride` apart in the buffer (padded
  // rows: ldmatrix without bank conflicts); one copy where both are contiguous.
  __device__ void fill_rows(int j, const void* src, int rows, unsigned row_bytes, size_t stride,
                            unsigned dst_stride) const {
    if (stride == row_bytes && dst_stride == row_bytes) return fill(j, src, static_cast<unsigned>(rows) * row_bytes);
    uint64_t* bar = &full[j % kSlots];
    gemma4_mtp::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(rows) * row_bytes);  // before any copy lands
    for (int r = 0; r < rows; ++r)
      gemma4_mtp::bulk_copy_g2s(slot<unsigned char>(j) + static_cast<size_t>(r) * dst_stride,
                                static_cast<const unsigned char*>(src) + static_cast<size_t>(r) * stride, row_bytes,
                                bar);
  }
  // Every thread: until chunk j's bytes are in.
  __device__ void wait(int j) const {
    gemma4_mtp::mbarrier_wait(&full[j % kSlots], static_cast<unsigned>(j / kSlots) & 1u);
  }
  // Chunk j's buffer.
  template <class T>
  __device__ T* slot(int j) const {
    return reinterpret_cast<T*>(buf + static_cast<size_t>(j % kSlots) * kSlotBytes);
  }
};
