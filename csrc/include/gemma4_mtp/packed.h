// A 16-byte vector of N elements of T (or one element when N == 1) kept packed until converted, so that
// many loads can be in flight without holding N floats each. Plain C++ over CUDA's uint4, so the CPU
// emulation of the kernels (tests/cuda_emulator) shares it; include it after uint4 is declared.
#pragma once

namespace gemma4_mtp {

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

}  // namespace gemma4_mtp
