"""The CUDA toolchain facts shared by setup.py (the extension), tests/test_cuda_build.py (the spill check)
and benchmarks/bench_stage_boundary.py (a standalone binary): which nvcc, which architectures, the common
nvcc flags. Standard library only: setup.py loads this file before the package can be imported."""
from __future__ import annotations

import os
import shutil
import subprocess

DEFAULT_ARCHS = "80;90a"  # A100, and Hopper with its arch-specific features (wgmma, TMA, setmaxnreg)
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]  # the kernels are C++17


def archs() -> list[str]:
    """GEMMA4_MTP_CUDA_ARCHS (a semicolon list such as "80;90a"), else DEFAULT_ARCHS; never the build
    machine's GPU. ValueError naming the variable on a malformed entry."""
    spec = os.environ.get("GEMMA4_MTP_CUDA_ARCHS", DEFAULT_ARCHS)
    out = []
    for arch in filter(None, (a.strip() for a in spec.split(";"))):
        num = arch.replace(".", "")
        if not num.rstrip("af").isdigit():
            raise ValueError(f"GEMMA4_MTP_CUDA_ARCHS: bad entry {arch!r} (expected e.g. '80;90a')")
        out.append(num)
    if not out:
        raise ValueError(f"GEMMA4_MTP_CUDA_ARCHS: no architecture in {spec!r} (expected e.g. '80;90a')")
    return out


def gencode_flags(arch_list: list[str]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]


def find_cuda_home() -> None:
    """Point CUDA_HOME at the real toolkit when the environment does not.

    torch guesses CUDA_HOME as the folder above `which nvcc`, which is wrong when nvcc on PATH is a
    wrapper script (e.g. /usr/local/bin/nvcc exec-ing /usr/local/cuda-13.0/bin/nvcc); nvcc's own
    dry run names its install (TOP=...)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc_on_path = shutil.which("nvcc")
    if not nvcc_on_path:
        return
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc_on_path)))]
    try:
        dry = subprocess.run([nvcc_on_path, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        tops = [ln.split("TOP=", 1)[1].strip() for ln in (dry.stdout + dry.stderr).splitlines() if "TOP=" in ln]
        candidates = [os.path.realpath(t) for t in tops] + candidates
    except (OSError, subprocess.SubprocessError):
        pass
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = home
            return


def nvcc() -> str | None:
    """$CUDA_HOME/bin/nvcc (or $CUDA_PATH's), else the nvcc on PATH; None without one."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")
