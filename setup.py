"""Build script. Pure-Python parts always install; the CUDA extension `gemma4_mtp_kernels._C` is
built only when torch is a CUDA build and nvcc is found. What to build is decided from the toolchain,
never from whether a GPU is present (torch.cuda.is_available()), so wheels build on GPU-less hosts.

Environment:
  GEMMA4_MTP_CUDA_ARCHS   semicolon list of SM targets, default "80;90a" (A100 and Hopper wgmma/TMA)
  GEMMA4_MTP_NO_CUDA=1    skip the extension even when it could be built
  MAX_JOBS                parallel nvcc jobs (torch's ninja builder honours it)
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
STATUS_FILE = os.path.join(ROOT, "gemma4_mtp_kernels", "_build_status.txt")
DEFAULT_ARCHS = "80;90a"


def arch_flags(spec: str) -> list[str]:
    flags = []
    for arch in filter(None, (a.strip() for a in spec.split(";"))):
        num = arch.replace(".", "")
        if not num.rstrip("af").isdigit():
            raise SystemExit(f"GEMMA4_MTP_CUDA_ARCHS: bad entry {arch!r} (expected e.g. '80;90a')")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def find_cuda_home() -> None:
    """Point CUDA_HOME at the real toolkit when the environment does not.

    torch guesses CUDA_HOME as the folder above `which nvcc`, which is wrong when nvcc on PATH is a
    wrapper script (e.g. /usr/local/bin/nvcc exec-ing /usr/local/cuda-13.0/bin/nvcc); nvcc's own
    dry run names its install (TOP=...)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        dry = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        tops = [ln.split("TOP=", 1)[1].strip() for ln in (dry.stdout + dry.stderr).splitlines() if "TOP=" in ln]
        candidates = [os.path.realpath(t) for t in tops] + candidates
    except (OSError, subprocess.SubprocessError):
        pass
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = home
            return


def cuda_extension():
    """(extension list, cmdclass, reason it was not built or None)."""
    if os.environ.get("GEMMA4_MTP_NO_CUDA", "0") not in ("", "0"):
        return [], {}, "GEMMA4_MTP_NO_CUDA is set"
    find_cuda_home()  # before cpp_extension computes its CUDA_HOME at import
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}, "torch is not importable at build time (install torch first, then pip install --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} is not a CUDA build"
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc") if cpp_extension.CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return [], {}, "nvcc was not found (put it on PATH or set CUDA_HOME)"
    sources = sorted(glob.glob("csrc/ops/*.cu")) + sorted(glob.glob("csrc/*.cpp"))
    if not sources:
        return [], {}, "there are no CUDA sources in csrc/ yet"
    includes = [os.path.join(ROOT, "csrc", "include")]
    cxx_flags = ["-O3", "-std=c++20"]  # torch's headers need C++20 (only csrc/*.cpp include them)
    # torch's nvidia wheels carry headers (cusparse.h, ...) that ATen's CUDA headers include and a
    # bare toolkit may lack. -idirafter: only for headers the toolkit lacks, so the toolkit's own
    # (cuda_runtime_api.h and its crt/ companions) always win.
    nvidia_inc = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "cu13", "include")
    if os.path.isdir(nvidia_inc):
        cxx_flags += ["-idirafter", nvidia_inc]
    archs = os.environ.get("GEMMA4_MTP_CUDA_ARCHS", DEFAULT_ARCHS)
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-v", "-lineinfo"] + arch_flags(archs)
    ext = cpp_extension.CUDAExtension(
        name="gemma4_mtp_kernels._C",
        sources=sources,
        include_dirs=includes,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},  # the kernels stay C++17
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}, None


ext_modules, cmdclass, not_built = cuda_extension()
status = "built" if not_built is None else f"not built because {not_built}"
if not_built is not None:
    print(f"gemma4-mtp-kernels: the CUDA extension is {status}; installing the Python parts "
          "(torch reference and Triton backends).", file=sys.stderr)
with open(STATUS_FILE, "w") as f:
    f.write(status + "\n")

setup(
    packages=find_packages(include=["gemma4_mtp_kernels", "gemma4_mtp_kernels.*"])
    + ["gemma4_mtp"] + ["gemma4_mtp." + p for p in find_packages("python_api/gemma4_mtp")],
    package_dir={"gemma4_mtp": "python_api/gemma4_mtp"},
    package_data={"gemma4_mtp_kernels": ["_build_status.txt"], "gemma4_mtp": ["assets/**/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
