"""Build checks of the CUDA backend that need no GPU: the extension was built wherever the toolchain
allows it, the host-side C++ tests pass (CMake + ctest), and no kernel spills registers on any
target architecture (nvcc -Xptxas -v on every csrc/ops/*.cu, and on the benchmarks' own CUDA programs,
benchmarks/cuda/*.cu, which this compile is the only check of before they run on a GPU).

Run `pytest tests/test_cuda_build.py -s` to see the per-kernel register / spill table."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gemma4_mtp_kernels import _toolchain as toolchain
from gemma4_mtp_kernels import cuda as cuda_backend

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "csrc" / "ops").glob("*.cu")) + sorted((ROOT / "benchmarks" / "cuda").glob("*.cu"))
ARCHS = toolchain.archs()


def test_architectures_come_from_the_environment_never_the_machine(monkeypatch):
    monkeypatch.delenv("GEMMA4_MTP_CUDA_ARCHS", raising=False)
    assert toolchain.archs() == ["80", "90a"]
    monkeypatch.setenv("GEMMA4_MTP_CUDA_ARCHS", " 8.6; 90a;100a ;")
    assert toolchain.gencode_flags(toolchain.archs()) == [
        "-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_100a,code=sm_100a"]
    for bad in ("sm_90", "90x", ";"):
        monkeypatch.setenv("GEMMA4_MTP_CUDA_ARCHS", bad)
        with pytest.raises(ValueError, match="GEMMA4_MTP_CUDA_ARCHS"):
            toolchain.archs()


def test_extension_built_where_the_toolchain_allows():
    ok, why = cuda_backend.extension_status()
    status = cuda_backend._build_status()
    if status == "built":
        assert ok, f"setup.py recorded a build but the extension does not load: {why}"
        return
    can_build = (torch.version.cuda is not None and toolchain.nvcc() is not None
                 and os.environ.get("GEMMA4_MTP_NO_CUDA", "0") in ("", "0"))
    assert not can_build, f"nvcc and a CUDA build of torch are present, but the extension is {status}"
    pytest.skip(f"the extension is {status}")


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ctest") is None, reason="cmake/ctest not found")
def test_host_side_cpp_tests(tmp_path):
    """csrc/tests/*.cpp through CMake and ctest: the non-GPU logic of the kernels on the CPU."""
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"], check=True,
                   capture_output=True, text=True)
    subprocess.run(["cmake", "--build", str(build), "-j", os.environ.get("MAX_JOBS", "2")], check=True,
                   capture_output=True, text=True)
    run = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "100% tests passed" in run.stdout and "out of 3" in run.stdout, run.stdout


ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def ptxas_report(nvcc: str, source: Path) -> list[dict]:
    """One record per (kernel, arch): registers, stack, spill stores and loads."""
    cmd = [nvcc, *toolchain.NVCC_FLAGS, "-Xptxas=-v", *toolchain.gencode_flags(ARCHS),
           f"-I{ROOT / 'csrc' / 'include'}", "-c", str(source), "-o", os.devnull]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, f"nvcc failed on {source.name}:\n{run.stderr[-4000:]}"
    records, current = [], None
    for line in run.stderr.splitlines():
        if m := ENTRY.search(line):
            current = {"file": source.name, "kernel": m.group(1), "arch": m.group(2)}
            records.append(current)
        elif current is not None and (m := SPILL.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := USED.search(line)):
            current["registers"] = int(m.group(1))
    return records


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


@pytest.mark.skipif(toolchain.nvcc() is None, reason="nvcc not found")
def test_no_register_spills():
    nvcc = toolchain.nvcc()
    jobs = max(1, int(os.environ.get("MAX_JOBS", "2")))
    with ThreadPoolExecutor(jobs) as pool:
        records = [r for rs in pool.map(lambda s: ptxas_report(nvcc, s), SOURCES) for r in rs]
    assert records, "ptxas reported no kernels"
    names = demangle([r["kernel"] for r in records])
    lines = [f"{'arch':7s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s}  kernel"]
    for r, name in sorted(zip(records, names), key=lambda x: (x[0]["file"], x[1], x[0]["arch"])):
        short = re.sub(r"gemma4_mtp::", "", name.split("(")[0])
        lines.append(f"{r['arch']:7s} {r.get('registers', 0):4d} {r.get('stack', 0):5d} "
                     f"{r.get('spill_stores', 0):5d}/{r.get('spill_loads', 0):<5d}  {short}")
    print("\n" + "\n".join(lines), file=sys.stderr)
    spilling = [f"{n} ({r['arch']}): {r['spill_stores']} B stores, {r['spill_loads']} B loads"
                for r, n in zip(records, names) if r.get("spill_stores", 0) or r.get("spill_loads", 0)]
    assert not spilling, "register spills:\n" + "\n".join(spilling)
    assert {r["arch"] for r in records} == {f"sm_{a}" for a in ARCHS}
