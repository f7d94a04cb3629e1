"""Ahead-of-time compile of the Triton kernels for sm_80 / sm_90 without a GPU, and their resource use.

`LAUNCHES` lists every kernel at the launch configurations the launchers pick for the real drafter
shapes (bf16). `compile_launch` builds one for a `GPUTarget` and reads registers, shared memory and
local memory (spills) from `cuobjdump -res-usage` of the cubin. Used by tests/test_triton_aot.py and
benchmarks/triton_resources.py.
"""
from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# the package re-exports the op functions under the module names, so import the modules by path
cl = importlib.import_module("gemma4_mtp_kernels.triton.centroid_logits")
fc = importlib.import_module("gemma4_mtp_kernels.triton.fused_concat_down_proj")
qa = importlib.import_module("gemma4_mtp_kernels.triton.q_only_attention")
tv = importlib.import_module("gemma4_mtp_kernels.triton.tree_verify")

ARCHS = (80, 90)
DIV16 = "div16"  # an int argument that is a multiple of 16 (the JIT specialises those the same way)


class Launch(NamedTuple):
    name: str        # what the configuration is for
    kernel: object   # the @triton.jit function
    args: dict       # arg name -> "*bf16"-style pointer type, "i32", "fp32", DIV16, or a constexpr value
    num_warps: int
    num_stages: int


class Resources(NamedTuple):
    registers: int
    shared_bytes: int
    local_bytes: int   # local memory per thread: register spills (none of the kernels uses local arrays)
    stack_bytes: int


def _signature(kernel, args):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        spec = args[name]
        if isinstance(spec, str) and spec.startswith("*"):
            signature[name] = spec
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif spec == DIV16:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif spec in ("i32", "i64", "fp32"):
            signature[name] = spec
        else:
            signature[name] = "constexpr"
            constexprs[name] = spec
    return signature, constexprs, attrs


@functools.lru_cache(maxsize=None)
def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> Resources:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], check=True, capture_output=True,
                              text=True).stdout
    fields = dict(re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", text))
    return Resources(int(fields["REG"]), int(fields["SHARED"]), int(fields["LOCAL"]), int(fields["STACK"]))


def compile_launch(launch: Launch, arch: int):
    """The compiled kernel for one target and its resource use (shared memory includes Triton's
    dynamic allocation, which cuobjdump's static count does not see)."""
    signature, constexprs, attrs = _signature(launch.kernel, launch.args)
    src = ASTSource(launch.kernel, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    res = resource_usage(compiled.asm["cubin"])
    return compiled, res._replace(shared_bytes=res.shared_bytes + compiled.metadata.shared)


def _attention_launches():
    out = []
    kv = "*bf16"
    for D, rows, what in ((256, 4, "E2B/E4B swa, Q=1 (G=4/2)"), (512, 4, "E2B/E4B full, Q=1"),
                          (256, 64, "26B/31B swa, Q x G = 64 rows"), (512, 64, "31B full, Q=8 x G=8")):
        cfg = qa.kernel_config(D, rows)
        for partial in (True, False):
            args = {n: "i32" for n in qa._attn_kernel.arg_names}
            args.update(q_ptr=kv, k_ptr=kv, v_ptr=kv, table_ptr="*i32", lens_ptr="*i32",
                        out_ptr="*fp32" if partial else kv, lse_ptr="*fp32", scale_log2="fp32", softcap="fp32",
                        D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HAS_WINDOW=(D == 256),
                        HAS_SOFTCAP=False, WRITE_LSE=True, PARTIAL=partial, PREC="tf32", INTERP=False)
            for n in ("sq_b", "sq_q", "sq_h", "sk_b", "sk_s", "sk_h", "sv_b", "sv_s", "sv_h",
                      "so_b", "so_q", "so_h"):
                args[n] = DIV16
            out.append(Launch(f"attention D={D} {what}{' split' if partial else ''}", qa._attn_kernel, args,
                              cfg["num_warps"], cfg["num_stages"]))
        merge = {n: "i32" for n in qa._merge_kernel.arg_names}
        merge.update(po_ptr="*fp32", plse_ptr="*fp32", out_ptr=kv, lse_ptr="*fp32", D=D, BLOCK_S=128,
                     WRITE_LSE=True, INTERP=False)
        out.append(Launch(f"attention merge D={D}", qa._merge_kernel, merge, 4, 1))
    return out


def _down_proj_launches():
    out = []
    for name, Hb, Hd in (("E2B", 1536, 256), ("31B", 5376, 1024)):
        for T in (1, 64):
            cfg = fc.launch_config(T, Hb, Hd, 132)
            partial = cfg["split_k"] > 1
            args = {n: "i32" for n in fc._down_proj_kernel.arg_names}
            args.update(tok_ptr="*i64", emb_ptr="*bf16", hid_ptr="*bf16", w_ptr="*bf16",
                        dst_ptr="*fp32" if partial else "*bf16", scale="fp32",
                        stride_emb=DIV16, stride_hid=DIV16, stride_w=DIV16, stride_t=DIV16,
                        BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], PREC="tf32",
                        INTERP=False)
            out.append(Launch(f"down_proj {name} T={T} split_k={cfg['split_k']}", fc._down_proj_kernel, args,
                              cfg["num_warps"], 1))
    red = dict(part_ptr="*fp32", out_ptr="*bf16", numel="i32", split_k="i32", BLOCK=fc.REDUCE_BLOCK, INTERP=False)
    out.append(Launch("down_proj split-K reduce", fc._split_k_reduce_kernel, red, 4, 1))
    return out


def _centroid_launches():
    return [Launch(f"centroid {what}", kernel, cl.aot_args(kernel, "*bf16", **kw), warps, 1)
            for what, kernel, kw, warps in cl.aot_configs()]


def _tree_verify_launches():
    return [Launch(f"tree_verify {what}", kernel, tv.aot_args(kernel, "*bf16", **kw), warps, 1)
            for what, kernel, kw, warps in tv.aot_configs()]


def launches() -> list[Launch]:
    return _down_proj_launches() + _attention_launches() + _centroid_launches() + _tree_verify_launches()
