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


def _build(tmp_path_factory, name: str, source: str, flags: list[str]):
    """`source` (a kernel and its main, including emu.h) built with the compiler command `flags`."""
    d = tmp_path_factory.mktemp(name)
    (d / "main.cpp").write_text(source)
    done = subprocess.run([*flags, f"-I{EMU}", str(d / "main.cpp"), "-o", str(d / "main")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return d / "main"


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    flags = compiler_flags()
    if "-fsanitize=address,alignment" not in flags:
        pytest.skip("g++ here builds without the sanitizers' runtimes: the emulation runs unchecked")
    return _build(tmp_path_factory, "emulator_alignment", SOURCE, flags)


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


# Four warps whose threads switch in block barriers and shuffles with an array on their own stacks: the
# fiber switch (emu.h Context: x86-64's own, or _setjmp / _longjmp with EMU_SETJMP_SWITCH) must resume each
# thread with its registers and stack as it left them, and AddressSanitizer must still see the array's bounds
# after a switch.
SWITCH_SOURCE = r"""
#include "emu.h"
__global__ void __launch_bounds__(128) kernel(const int* in, int* out, int index) {
  __shared__ int s[128];
  int local[4];  // on the thread's fiber stack (a run-time index keeps it there)
  const int t = threadIdx.x;
  for (int i = 0; i < 4; ++i) local[i] = in[t] * (i + 1);
  s[t] = local[0];
  __syncthreads();
  int v = s[127 - t] + local[index];  // index 4: one past the array
  for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffff, v, m);
  __syncthreads();
  if (t % 32 == 0) out[t / 32] = v;
}
int main(int argc, char** argv) {
  emu::devices().push_back({227 * 1024, 9, 132});
  static int in[128], out[4];
  for (int t = 0; t < 128; ++t) in[t] = (t * 37) % 101 - 50;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(128);
  if (cudaLaunchKernelEx(&cfg, kernel, in, out, std::atoi(argv[1])) != cudaSuccess) return 1;
  std::printf("OK %d %d %d %d\n", out[0], out[1], out[2], out[3]);
  return 0;
}
"""


@pytest.fixture(scope="module", params=["own", "setjmp"])
def switcher(request, tmp_path_factory):
    flags = compiler_flags()
    define = ["-DEMU_SETJMP_SWITCH"] if request.param == "setjmp" else []
    exe = _build(tmp_path_factory, f"emulator_switch_{request.param}", SWITCH_SOURCE, [*flags, *define])
    return request.param, exe, "-fsanitize=address,alignment" in flags


def test_fibers_resume_where_they_left(switcher):
    _, exe, _ = switcher
    done = subprocess.run([str(exe), "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    x = [(t * 37) % 101 - 50 for t in range(128)]
    want = [sum(x[127 - t] + 4 * x[t] for t in range(32 * w, 32 * w + 32)) for w in range(4)]
    assert done.stdout.split() == ["OK", *map(str, want)]


def test_address_sanitizer_sees_a_fibers_stack_after_a_switch(switcher):
    _, exe, sanitized = switcher
    if not sanitized:
        pytest.skip("g++ here builds without the sanitizers' runtimes")
    done = subprocess.run([str(exe), "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "stack-buffer-overflow" in done.stderr, (done.stdout, done.stderr[-2000:])
