// Emulated stand-in for csrc/include/gemma4_mtp/common.cuh (found first on the emulator's include path):
// the same helpers with the same signatures, implemented on tests/cuda_emulator/emu.h. Only what the
// attention and the fused glue kernels use. EMU_BULK selects the sm_90 code path (bulk copies + mbarriers) or sm_80's.
#pragma once

#include "emu.h"
#include "gemma4_mtp/host_device.h"
#include "gemma4_mtp/packed.h"

namespace gemma4_mtp {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <class T>
inline float to_float(T x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return bits_to_float(uint32_t{x.bits} << 16); }
template <>
inline float to_float<__half>(__half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}

template <class T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return {0x7FC0};
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return {static_cast<uint16_t>(u >> 16)};
}
template <>
inline __half from_float<__half>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  __half out;
  std::memcpy(&out.bits, &h, 2);
  return out;
}

template <class T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

inline void check_aligned(const void* p, unsigned a, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % a) emu::fail(what);
}

template <int N, class T>
inline void load_float(const T* p, float* out) {
  if constexpr (N > 1) check_aligned(p, 16, "misaligned 16-byte load");
  for (int i = 0; i < N; ++i) out[i] = to_float(p[i]);
}

// 16-byte vectors kept packed (gemma4_mtp/packed.h), loaded with an alignment check.
template <int N, class T>
inline void load_packed(const T* p, Packed<N, T>& out) {
  if constexpr (N == 1) {
    out.e[0] = *p;
  } else {
    check_aligned(p, 16, "misaligned 16-byte load");
    std::memcpy(&out.raw, p, 16);
  }
}

template <int N, class T>
inline void zero_packed(Packed<N, T>& out) {
  if constexpr (N == 1) {
    out.e[0] = from_float<T>(0.f);
  } else {
    out.raw = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <class V>
inline V __ldg(const V* p) {
  return *p;
}

// Polled in a spin (the grid barrier): a spin, as __nanosleep (emu.h).
inline uint32_t load_acquire(const uint32_t* p) {
  __nanosleep(0);
  return *p;
}

inline uint32_t atomic_add_release(uint32_t* p, uint32_t v) { return atomicAdd(p, v); }

inline uint4 __ldg(const uint4* p) {
  check_aligned(p, 16, "misaligned 16-byte load");
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}

// Data other blocks of the launch wrote: checked at the launch's end (emu::check_published_reads).
template <class V>
inline V __ldcg(const V* p) {
  const V v = *p;
  emu::note_published_read(p, &v, sizeof(V));
  return v;
}

inline void prefetch_l2(const void*) {}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline uint32_t uint4_word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

inline double warp_sum(double x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int HALF>
inline void transpose_sum_step(float* v, int lane) {
  const bool upper = lane & HALF;
  for (int k = 0; k < HALF; ++k) {
    const float send = upper ? v[k] : v[k + HALF];
    const float keep = upper ? v[k + HALF] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
  }
}

inline float warp_transpose_sum(float (&v)[32], int lane) {
  transpose_sum_step<16>(v, lane);
  transpose_sum_step<8>(v, lane);
  transpose_sum_step<4>(v, lane);
  transpose_sum_step<2>(v, lane);
  transpose_sum_step<1>(v, lane);
  return v[0];
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool host_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline unsigned char* dynamic_smem() { return emu::block()->smem; }

inline void check_smem(const void* p, size_t bytes, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < emu::block()->smem || c + bytes > emu::block()->smem + emu::block()->smem_bytes) emu::fail(what);
}

// ---- cp.async (sm_80 path) ----
inline void cp_async16(void* smem, const void* gmem, bool valid) {
  check_smem(smem, 16, "cp.async destination outside shared memory");
  check_aligned(smem, 16, "misaligned cp.async destination");
  if (valid) check_aligned(gmem, 16, "misaligned cp.async source");
  const emu::Copy c{smem, valid ? gmem : nullptr, 16};
  if (emu::late_copies())
    emu::self().open.push_back(c);
  else
    emu::perform(c);
}

inline void cp_async_commit() {
  emu::Fiber& f = emu::self();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}

inline void cp_async_wait_n(int n) {
  emu::Fiber& f = emu::self();
  while (static_cast<int>(f.groups.size()) > n) {
    for (const emu::Copy& c : f.groups.front()) emu::perform(c);
    f.groups.pop_front();
  }
}

template <int N>
inline void cp_async_wait() {
  cp_async_wait_n(N);
}

inline void cp_async_wait_dyn(int pending) { cp_async_wait_n(pending > 6 ? 6 : pending); }

// ---- ldmatrix / mma ----
inline uint16_t load_u16(uint64_t addr) {
  uint16_t v;
  std::memcpy(&v, reinterpret_cast<const void*>(addr), 2);
  return v;
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  check_smem(smem_row, 16, "ldmatrix row outside shared memory");
  check_aligned(smem_row, 16, "misaligned ldmatrix row");
  const uint64_t mine = reinterpret_cast<uint64_t>(smem_row);
  const auto x = emu::exchange(&mine, 1);
  const int lane = emu::lane();
  for (int i = 0; i < 4; ++i) std::memcpy(&r[i], reinterpret_cast<const void*>(x[8 * i + lane / 4][0] + 4 * (lane % 4)), 4);
}

inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  check_smem(smem_row, 16, "ldmatrix row outside shared memory");
  check_aligned(smem_row, 16, "misaligned ldmatrix row");
  const uint64_t mine = reinterpret_cast<uint64_t>(smem_row);
  const auto x = emu::exchange(&mine, 1);
  const int lane = emu::lane();
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = load_u16(x[8 * i + 2 * (lane % 4)][0] + 2 * (lane / 4));
    const uint16_t hi = load_u16(x[8 * i + 2 * (lane % 4) + 1][0] + 2 * (lane / 4));
    r[i] = uint32_t{lo} | uint32_t{hi} << 16;
  }
}

template <class T>
inline float half_word(uint32_t w, int hi) {
  T v;
  const uint16_t b = static_cast<uint16_t>(hi ? w >> 16 : w & 0xFFFF);
  std::memcpy(&v, &b, 2);
  return to_float(v);
}

// D = A B + C for a warp: A 16 x 16 (row major), B 16 x 8, C and D 16 x 8, the lanes' fragments laid out
// as the PTX ISA defines them for mma.m16n8k16 (lane l = 4 g + q holds A rows g and g + 8, columns 2q, 2q + 1
// and 2q + 8, 2q + 9; B rows 2q, 2q + 1, 2q + 8, 2q + 9 of column g; C / D rows g, g + 8 of columns 2q,
// 2q + 1). A lane reads from the others' fragments only its two rows of A and two columns of B (all of them,
// rebuilt in every lane, made the emulation of mma-bound kernels several times slower), and sums k in order.
template <class T>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(sizeof(T) == 2, "bf16 / fp16 tensor-core mma");
  const uint64_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const auto x = emu::exchange(mine, 6);
  const int lane = emu::lane(), g = lane >> 2, q = lane & 3;
  float A[2][16], B[2][16];  // rows g, g + 8 of A; columns 2q, 2q + 1 of B
  for (int k = 0; k < 16; ++k) {
    const int from = (k & 7) / 2, hi = k & 1;  // the lane (of its group of 4) and half word holding element k
    for (int r = 0; r < 2; ++r)
      A[r][k] = half_word<T>(static_cast<uint32_t>(x[4 * g + from][r + 2 * (k >> 3)]), hi);
    for (int n = 0; n < 2; ++n)
      B[n][k] = half_word<T>(static_cast<uint32_t>(x[4 * (2 * q + n) + from][4 + (k >> 3)]), hi);
  }
  for (int i = 0; i < 4; ++i) {
    float acc = c[i];  // C at (g + 8 (i >= 2), 2q + (i & 1)): this lane's own
    for (int k = 0; k < 16; ++k) acc += A[i >> 1][k] * B[i & 1][k];
    c[i] = acc;
  }
}

template <class T>
inline uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(T) == 2, "pack2 packs 16-bit elements");
  const T l = from_float<T>(lo), h = from_float<T>(hi);
  uint16_t lb, hb;
  std::memcpy(&lb, &l, 2);
  std::memcpy(&hb, &h, 2);
  return uint32_t{lb} | uint32_t{hb} << 16;
}

// ---- bulk copies and mbarriers (sm_90 path) ----
#ifndef EMU_BULK
#define EMU_BULK 0
#endif
constexpr bool kHasBulkCopy = EMU_BULK != 0;

inline emu::MBarrier& mbar(uint64_t* bar) {
  auto it = emu::block()->mbarriers.find(bar);
  if (it == emu::block()->mbarriers.end()) emu::fail("mbarrier used before mbarrier.init");
  return it->second;
}

inline void mbarrier_init(uint64_t* bar, unsigned count) {
  check_smem(bar, 8, "mbarrier outside shared memory");
  check_aligned(bar, 8, "misaligned mbarrier");
  emu::MBarrier m;
  m.expected = m.pending = static_cast<int>(count);
  emu::block()->mbarriers[bar] = m;
}

inline void fence_mbarrier_init() {}
inline void fence_proxy_async_shared() {}

inline void mbarrier_try_complete(emu::MBarrier& m, bool perform_late) {
  if (m.pending != 0) return;
  if (perform_late && !m.copies.empty()) {
    ++emu::progress();
    for (const emu::Copy& c : m.copies) {
      emu::perform(c);
      m.tx -= c.bytes;
    }
    m.copies.clear();
  }
  if (m.tx == 0 && m.copies.empty()) {
    ++m.phase;
    m.pending = m.expected;
    ++emu::progress();
  }
}

inline void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  emu::MBarrier& m = mbar(bar);
  if (m.pending <= 0) emu::fail("more arrivals on an mbarrier than its count");
  m.tx += bytes;
  --m.pending;
  ++emu::progress();
  mbarrier_try_complete(m, false);
}

enum class Scope { kCta, kCluster };

template <Scope = Scope::kCta>  // threads run one at a time here: every wait sees every completed store
inline void mbarrier_wait(uint64_t* bar, unsigned parity) {
  for (;;) {
    emu::MBarrier& m = mbar(bar);
    mbarrier_try_complete(m, true);  // late mode: the copies land only now, when someone waits
    if ((m.phase & 1) != parity) return;
    emu::yield();
  }
}

inline void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  check_smem(dst, bytes, "bulk copy destination outside shared memory");
  check_aligned(dst, 16, "misaligned bulk copy destination");
  check_aligned(src, 16, "misaligned bulk copy source");
  if (bytes % 16) emu::fail("bulk copy size not a multiple of 16");
  emu::MBarrier& m = mbar(bar);
  const emu::Copy c{dst, src, bytes};
  ++emu::progress();
  if (emu::late_copies()) {
    m.copies.push_back(c);
  } else {
    emu::perform(c);
    m.tx -= bytes;
    mbarrier_try_complete(m, false);
  }
}

inline void griddep_wait() {}
inline void griddep_launch_dependents() {}

}  // namespace gemma4_mtp
