// Device helpers shared by the kernels: element conversion, 16-byte vector loads, warp reductions,
// cp.async. Framework free (CUDA runtime only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemma4_mtp/host_device.h"
#include "gemma4_mtp/packed.h"

namespace gemma4_mtp {

template <class T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements of T in one 16-byte vector.
template <class T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Loads N consecutive elements (N * sizeof(T) == 16: one 16-byte load; N == 1: a scalar) as floats.
template <int N, class T>
__device__ __forceinline__ void load_float(const T* __restrict__ p, float* out) {
  if constexpr (N == 1) {
    out[0] = to_float(*p);
  } else {
    static_assert(N * sizeof(T) == 16, "vector loads are 16 bytes");
    union {
      uint4 raw;
      T e[N];
    } v;
    v.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.e[i]);
  }
}

template <int N, class T>
__device__ __forceinline__ void load_packed(const T* __restrict__ p, Packed<N, T>& out) {
  if constexpr (N == 1) {
    out.e[0] = *p;
  } else {
    out.raw = *reinterpret_cast<const uint4*>(p);
  }
}

template <int N, class T>
__device__ __forceinline__ void zero_packed(Packed<N, T>& out) {
  if constexpr (N == 1) {
    out.e[0] = from_float<T>(0.f);
  } else {
    out.raw = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Hint: bring the 128-byte line holding p into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A load that sees every write published before a release that this thread's acquire synchronized with.
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// *p += v, returning the old value, as a release at GPU scope: the writes this thread has seen (its
// block's, through a preceding bar.sync) are visible to whoever acquires the new value. Cheaper than
// __threadfence() + atomicAdd (on sm_90: MEMBAR.ALL.GPU instead of MEMBAR.SC.GPU and an L1 invalidate).
__device__ __forceinline__ uint32_t atomic_add_release(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int HALF>
__device__ __forceinline__ void transpose_sum_step(float* v, int lane) {
  const bool upper = lane & HALF;
#pragma unroll
  for (int k = 0; k < HALF; ++k) {
    const float send = upper ? v[k] : v[k + HALF];
    const float keep = upper ? v[k + HALF] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, HALF);
  }
}

// Reduces 32 values per lane across the warp so that lane c returns the warp-wide sum of v[c]
// (recursive halving: at each step a lane keeps the half of the values that its lane bit selects and
// adds the partner's copy of that half; 31 shuffles instead of 32 x 5). v is clobbered.
__device__ __forceinline__ float warp_transpose_sum(float (&v)[32], int lane) {
  transpose_sum_step<16>(v, lane);
  transpose_sum_step<8>(v, lane);
  transpose_sum_step<4>(v, lane);
  transpose_sum_step<2>(v, lane);
  transpose_sum_step<1>(v, lane);
  return v[0];
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline bool host_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16-byte asynchronous global->shared copy; zero-fills the destination when !valid (src is then not
// read, but must still be a legal address expression).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_size));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// D += A B for one m16n8k16 tile, fp32 accumulation (sm_80+). A: 4 registers of two T each, B: 2.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(sizeof(T) == 2, "bf16 / fp16 tensor-core mma");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// ---- Tensor-core operands (sm_80+): ldmatrix, and the fragment layouts of mma_m16n8k16 above ----
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 * group + quad:
//   A 16x16 (row major): a0 (row group, cols 2 quad + {0,1}), a1 (row group + 8), a2 (cols + 8), a3 (both)
//   B 16x8 (column major): b0 (rows 2 quad + {0,1}, col group), b1 (rows + 8)
//   C 16x8 fp32: c0, c1 (row group, cols 2 quad + {0,1}), c2, c3 (row group + 8)
// ldmatrix .x4: lanes 8i..8i+7 address the 8 rows (16 bytes each) of matrix i; register i of lane t
// holds matrix i's (row t / 4, cols 2 (t % 4) + {0,1}), or with .trans its (rows 2 (t % 4) + {0,1}, col t / 4).

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 32-bit word i (0..3) of a 16-byte vector: a register of an mma fragment loaded as one vector.
__device__ __forceinline__ uint32_t uint4_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Two floats rounded to T (nearest even) in one register, lo in the low half (the lower column).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(sizeof(T) == 2, "pack2 packs 16-bit elements");
  union {
    uint32_t u;
    __nv_bfloat162 b;
    __half2 h;
  } v;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    v.b = __floats2bfloat162_rn(lo, hi);
  } else {
    v.h = __floats2half2_rn(lo, hi);
  }
  return v.u;
}

// ---- Hopper (sm_90) asynchronous bulk copies, mbarriers and programmatic dependent launch ----
// The bodies exist only where the PTX does; callers select them with kHasBulkCopy (false in the
// sm_80 pass, where they are never called).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasBulkCopy = true;
#else
constexpr bool kHasBulkCopy = false;
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
#endif
}

// Makes initialised mbarriers visible to the asynchronous proxy (the bulk-copy engine).
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Orders this thread's earlier generic-proxy shared-memory writes before its later bulk copies.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// One arrival on `bar` that also announces `bytes` more transaction bytes for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// What an mbarrier wait acquires: the CTA's own (bulk copies into its shared memory, its threads'
// arrivals), or at cluster scope what other programs of its cluster stored into it (cluster.cuh's
// st_async_peer).
enum class Scope { kCta, kCluster };

// Blocks until the phase of `bar` with the given parity has completed (acquire: the bytes the bulk
// copies of that phase wrote, or at kCluster the stores other programs pushed, are visible to this
// thread afterwards).
template <Scope kScope = Scope::kCta>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned done = 0;
  do {
    if constexpr (kScope == Scope::kCta) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity)
          : "memory");
    } else {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(smem_addr(bar)), "r"(parity)
          : "memory");
    }
  } while (!done);
#endif
}

// bytes (a multiple of 16) from 16-byte aligned global `src` to 16-byte aligned shared `dst`,
// completing as transaction bytes on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and for launches without the attribute):
// wait until the preceding grid in the stream has completed and its writes are visible, and let the
// next grid (launched with the attribute) be scheduled before this one finishes.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// The block's dynamic shared memory (16-byte aligned; the launch sets its size).
__device__ __forceinline__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char g4_dynamic_smem[];
  return g4_dynamic_smem;
}

// cp.async.wait_group with a run-time count (the pipeline depth is chosen per device at launch).
__device__ __forceinline__ void cp_async_wait_dyn(int pending) {
  switch (pending) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    default: cp_async_wait<6>(); break;
  }
}

}  // namespace gemma4_mtp
