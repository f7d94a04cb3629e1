// Portability macros so that the non-GPU logic headers compile with a plain C++ compiler (host tests)
// and with nvcc (kernels) from the same source.
#pragma once

#if defined(__CUDACC__)
#define G4_HD __host__ __device__ __forceinline__
#else
#define G4_HD inline
#endif

#include <cstdint>
#include <cstring>

namespace gemma4_mtp {

G4_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
G4_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
G4_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
G4_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

G4_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

G4_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

}  // namespace gemma4_mtp
