// Device helpers shared by the kernels: element conversion, 16-byte vector loads, warp reductions,
// cp.async. Framework free (CUDA runtime only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemma4_mtp/host_device.h"

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
__device__ __forceinline__ void load_float_cg(const T* __restrict__ p, float* out) {
  // L2-only load, for data another CTA of this launch wrote (L1 is not coherent across SMs).
  if constexpr (N == 1) {
    out[0] = to_float(*p);
  } else {
    union {
      uint4 raw;
      T e[N];
    } v;
    v.raw = __ldcg(reinterpret_cast<const uint4*>(p));
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.e[i]);
  }
}

// A 16-byte vector (or one element when N == 1) kept packed until converted, so that many loads can be
// in flight without holding N floats each.
template <int N, class T>
struct Packed {
  static_assert(N * sizeof(T) == 16, "vector loads are 16 bytes");
  union {
    uint4 raw;
    T e[N];
  };
};

template <class T>
struct Packed<1, T> {
  T e[1];
};

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

inline int device_sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) return 1;
  return sms;
}

}  // namespace gemma4_mtp
