"""Building and running the CUDA kernels' CPU emulation (tests/cuda_emulator: a driver per kernel header,
compiled with g++ against emu.h under AddressSanitizer and UBSan's alignment check), shared by the
tests/test_*_emulated.py files.

A driver takes key=value arguments, exchanges tensors with the test as packed rows in files of a
directory, and prints one last line, "OK key=value ..." or "FAIL ..."."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "cuda_emulator"
BENCH_CUDA = ROOT / "benchmarks" / "cuda"  # device code of the benchmarks (stage_boundary.cuh)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # the drivers' dtype=


def sources(main: str) -> list[Path]:
    """What an emulator build of `main` compiles (the key of its cached binary): the emulation, the
    driver, every kernel header, the host-side launchers (csrc/ops) and the benchmarks' device headers,
    so that no edit of an included file reuses a stale binary."""
    return [EMU / "emu.h", EMU / "io.h", *sorted((EMU / "gemma4_mtp").iterdir()), EMU / "cuda" / "atomic", EMU / main,
            *sorted(EMU.glob("cuda_*.h")), *sorted((ROOT / "csrc" / "include" / "gemma4_mtp").iterdir()),
            *sorted((ROOT / "csrc" / "ops").iterdir()), *sorted(BENCH_CUDA.glob("*.cuh"))]


def compiler_flags() -> list[str]:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    # AddressSanitizer: a read or write out of any buffer; UBSan's alignment check: a vector load or store
    # (uint4, float4, ...) at an address its size does not divide, which faults on the GPU (cudaErrorMisalignedAddress)
    # and goes through silently on x86
    sanitize = ["-fsanitize=address,alignment", "-fno-sanitize-recover=alignment", "-fno-omit-frame-pointer"]
    probe = subprocess.run([gxx, *sanitize, "-x", "c++", "-", "-o", os.devnull],
                           input="int main() { return 0; }", capture_output=True, text=True)
    if probe.returncode != 0:  # a compiler without the sanitizers' runtimes still runs the kernels, unchecked
        sanitize = []
    # the kernels' source as host C++: an implicit float -> integer conversion is an error (a float score
    # passed where order bits were expected once ranked every token of the dense head by its integer part)
    return [gxx, "-std=c++20", "-O1", "-Werror=float-conversion", *sanitize]


def build(request, main: str, name: str, defines: tuple[str, ...] = ()) -> Path:
    """The driver `main` built with `defines` (-D...), cached in pytest's cache by a hash of its sources
    and flags. Built under a name of its own and renamed into place: pytest-xdist's workers (the README's
    test command) may build the same driver at once, and none may run another's half-written binary."""
    flags = [*compiler_flags(), *defines]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources(main)) + " ".join(flags).encode()).hexdigest()[:16]
    exe = Path(request.config.cache.mkdir("cuda_emulator")) / f"{name}_{digest}"
    if not exe.exists():
        part = exe.with_name(f"{exe.name}.{os.getpid()}.part")
        cmd = [*flags, f"-I{EMU}", f"-I{ROOT / 'csrc' / 'include'}", f"-I{BENCH_CUDA}", str(EMU / main), "-o", str(part)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stderr[-4000:]
        os.replace(part, exe)
    return exe


def run(binary: Path, args: str, ok_prefix: str = "OK") -> dict:
    """Runs the driver; asserts that it printed OK (or the driver's other success word, ok_prefix) and
    returns the key=value pairs of that line."""
    env = dict(os.environ, ASAN_OPTIONS="detect_stack_use_after_return=0:detect_leaks=0")
    done = subprocess.run([str(binary), *args.split()], capture_output=True, text=True, env=env, timeout=1200)
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert done.returncode == 0 and last.startswith(ok_prefix), f"{binary.name} {args}\n{last}\n{done.stderr[-3000:]}"
    return dict(kv.split("=", 1) for kv in last.split()[1:] if "=" in kv)


def write(path: Path, t: torch.Tensor) -> None:
    """t's elements as packed rows (the layout the drivers' io.h loads)."""
    path.write_bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def read(path: Path, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).view(dtype).reshape(shape)
