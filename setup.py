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
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
STATUS_FILE = os.path.join(ROOT, "gemma4_mtp_kernels", "_build_status.txt")


def _load_toolchain():
    """gemma4_mtp_kernels/_toolchain.py by path: the package itself imports torch."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_gemma4_mtp_toolchain",
                                                  os.path.join(ROOT, "gemma4_mtp_kernels", "_toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = _load_toolchain()


def cuda_extension():
    """(extension list, cmdclass, reason it was not built or None)."""
    if os.environ.get("GEMMA4_MTP_NO_CUDA", "0") not in ("", "0"):
        return [], {}, "GEMMA4_MTP_NO_CUDA is set"
    toolchain.find_cuda_home()  # before cpp_extension computes its CUDA_HOME at import
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
    try:
        archs = toolchain.archs()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    nvcc_flags = [*toolchain.NVCC_FLAGS, "-Xptxas=-v", "-lineinfo", *toolchain.gencode_flags(archs)]
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
