"""The CPU emulation of CUDA (tests/cuda_emulator) faults where a GPU faults: checks of the emulation itself,
so that a kernel test passing under it means what it says.

A vector load or store (uint4, float4, uint2, float2) at an address its size does not divide faults on the GPU
(cudaErrorMisalignedAddress: the first GPU run's suite died on one) and goes through on x86; the emulation's
vector types carry CUDA's alignment and its builds check every dereference (UBSan's alignment check,
tests/emulated.py)."""
from __future__ import annotations

import subprocess

import pytest

from emulated import EMU, compiler_flags

# A kernel reading one 16- or 8-byte vector at `offset` 4-byte words into a 16-byte aligned buffer.
SOURCE = r"""
#include "emu.h"
template <class V>
__global__ void __launch_bounds__(32) load(const unsigned* p, int offset, unsigned* out) {
  const V v = *reinterpret_cast<const V*>(p + offset);
  out[threadIdx.x] = v.x;
}
int main(int argc, char** argv) {
  const int offset = std::atoi(argv[2]);
  emu::devices().push_back({227 * 1024, 9, 132});  // an H100 / H200
  alignas(16) static unsigned buf[16] = {7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};
  static unsigned out[32];
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(32);
  const bool wide = argv[1][0] == '4';
  const cudaError_t err = wide ? cudaLaunchKernelEx(&cfg, load<uint4>, buf, offset, out)
                               : cudaLaunchKernelEx(&cfg, load<uint2>, buf, offset, out);
  std::printf(err == cudaSuccess && out[31] == 7 ? "OK\n" : "FAIL\n");
  return 0;
}
"""


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    flags = compiler_flags()
    if "-fsanitize=address,alignment" not in flags:
        pytest.skip("g++ here builds without the sanitizers' runtimes: the emulation runs unchecked")
    d = tmp_path_factory.mktemp("emulator_alignment")
    (d / "load.cpp").write_text(SOURCE)
    done = subprocess.run([*flags, f"-I{EMU}", str(d / "load.cpp"), "-o", str(d / "load")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return d / "load"


@pytest.mark.parametrize("vector, offset, ok", [
    ("4", 0, True), ("4", 4, True), ("4", 1, False), ("4", 2, False),  # uint4: 16-byte aligned or faults
    ("2", 0, True), ("2", 2, True), ("2", 1, False),                    # uint2: 8-byte
])
def test_vector_loads_fault_where_the_gpu_faults(loader, vector, offset, ok):
    done = subprocess.run([str(loader), vector, str(offset)], capture_output=True, text=True, timeout=120)
    if ok:
        assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]
    else:
        assert done.returncode != 0 and "misaligned address" in done.stderr, (done.stdout, done.stderr[-2000:])
