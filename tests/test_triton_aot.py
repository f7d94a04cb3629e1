"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed) at the launch
configurations the launchers pick for the real drafter shapes (T 1/8/64, B 1/8/64, tree sizes, A100
and H100 SM counts; gemma4_mtp_kernels.triton.aot), within the shared memory of an A100 / H100 block
(a launch over it fails on the GPU) and, for bf16/fp16, without local-memory spills.

The compile runs in a subprocess: under TRITON_INTERPRET=1 (set for the CPU tests) the kernels are
interpreter objects that cannot be compiled.
"""
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "gemma4_mtp_kernels.triton.aot"], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_every_kernel_compiles_for_sm80_and_sm90(compiled):
    kernels = {"_down_proj_kernel", "_split_k_reduce_kernel", "_attn_kernel", "_merge_kernel", "_scores",
               "_candidates", "_argmax", "_verify"}
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in compiled if r["arch"] == arch} == kernels


def test_dispatch_paths_are_covered(compiled):
    """The enumeration over the real drafters reaches the paths that matter: split and single-launch
    attention, split-K and direct down_proj, every dtype's tiles."""
    attn = [r for r in compiled if r["kernel"] == "_attn_kernel"]
    assert any(r["name"].endswith(" split") for r in attn) and any("split" not in r["name"] for r in attn)
    down = [r["name"] for r in compiled if r["kernel"] == "_down_proj_kernel"]
    assert any("split-K" in n for n in down) and any("split-K" not in n for n in down)
    assert {r["dtype"] for r in attn} == {"bf16", "fp16", "fp32"}


def test_no_spills_and_shared_memory_fits(compiled):
    bad = [f"{r['name']} {r['arch']}: {'; '.join(r['problems'])}" for r in compiled if r["problems"]]
    assert not bad, "\n".join(bad)
    assert all(0 < r["registers"] <= 255 for r in compiled)
