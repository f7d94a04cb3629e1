"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed) at the launch
configurations the launchers pick for the real drafter shapes, without local-memory spills and
within the shared memory of an A100 / H100 block.

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
               "_candidates", "_argmax", "_chunk_stats", "_sample", "_walk"}
    for arch in ("sm_80", "sm_90"):
        assert {r["kernel"] for r in compiled if r["arch"] == arch} == kernels


def test_no_spills_and_shared_memory_fits(compiled):
    bad = [f"{r['name']} {r['arch']}: {'; '.join(r['problems'])}" for r in compiled if r["problems"]]
    assert not bad, "\n".join(bad)
    assert all(0 < r["registers"] <= 255 for r in compiled)
