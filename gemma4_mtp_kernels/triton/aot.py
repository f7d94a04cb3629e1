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
from ._common import pow2_at_least  # noqa: E402

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
                        D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                        MIN_CHUNK=qa.MIN_TILES_PER_SPLIT * cfg["BLOCK_N"], HAS_WINDOW=(D == 256),
                        HAS_SOFTCAP=False, WRITE_LSE=True, PARTIAL=partial, PREC="tf32", INTERP=False)
            for n in ("sq_b", "sq_q", "sq_h", "sk_b", "sk_s", "sk_h", "sv_b", "sv_s", "sv_h",
                      "so_b", "so_q", "so_h"):
                args[n] = DIV16
            out.append(Launch(f"attention D={D} {what}{' split' if partial else ''}", qa._attn_kernel, args,
                              cfg["num_warps"], cfg["num_stages"]))
            if D == 256 and rows == 4 and partial:
                capped = dict(args, HAS_SOFTCAP=True)
                out.append(Launch(f"attention D={D} {what} split, softcap", qa._attn_kernel, capped,
                                  cfg["num_warps"], cfg["num_stages"]))
    for D in (256, 512):
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
                              cfg["num_warps"], cfg["num_stages"]))
    red = dict(part_ptr="*fp32", out_ptr="*bf16", numel="i32", split_k="i32", BLOCK=fc.REDUCE_BLOCK, INTERP=False)
    out.append(Launch("down_proj split-K reduce", fc._split_k_reduce_kernel, red, 4, 1))
    return out


def _centroid_launches():
    C, CS, Hd, top_k = 2048, 128, 256, 32  # E2B / E4B
    sc = cl.score_config(1)
    scores = dict(h_ptr="*bf16", c_ptr="*bf16", s_ptr="*fp32", T="i32", C=DIV16, Hd=DIV16, s_h=DIV16, s_c=DIV16,
                  BLOCK_C=sc["BLOCK_C"], BLOCK_T=sc["BLOCK_T"], BLOCK_K=sc["BLOCK_K"], PREC="tf32", INTERP=False)
    out = [Launch("centroid scores T<=16", cl._scores, scores, sc["num_warps"], sc["num_stages"])]
    cfg = cl.candidate_config(C, CS, Hd)
    for output in ("argmax", "sparse", "dense"):
        args = dict(h_ptr="*bf16", s_ptr="*fp32", order_ptr="*i64", lm_ptr="*bf16", best_ptr="*fp32",
                    best_id_ptr="*i32", ids_ptr="*i64", logit_ptr="*fp32", dense_ptr="*fp32",
                    C=DIV16, V=DIV16, Hd=DIV16, CS=DIV16, top_k=DIV16, s_h=DIV16, s_lm=DIV16, s_dense=DIV16,
                    **{k: v for k, v in cfg.items() if not k.startswith("num_")}, OUTPUT=output)
        out.append(Launch(f"centroid candidates {output}", cl._candidates, args, cfg["num_warps"],
                          cfg["num_stages"]))
    red = dict(best_ptr="*fp32", best_id_ptr="*i32", token_ptr="*i64", logit_ptr="*fp32", top_k=DIV16,
               BLOCK_K=top_k)
    out.append(Launch("centroid argmax", cl._argmax, red, 4, 1))
    return out


def _tree_verify_launches():
    V = 262144
    chunk = tv.chunk_size(8, V, 132)  # B = 1, N = 8 on an H100/H200
    block_c = pow2_at_least(triton.cdiv(V, chunk), 2)
    ints = dict(N="i32", V=DIV16, chunk=DIV16, nch="i32", s_b=DIV16, s_n=DIV16, sq_b=DIV16, sq_n=DIV16)
    out = []
    for has_temp in (False, True):
        args = dict(logit_ptr="*bf16", temp_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", arg_ptr="*i32",
                    **{k: ints[k] for k in ("N", "V", "chunk", "nch", "s_b", "s_n")},
                    HAS_TEMP=has_temp, BLOCK=tv.BLOCK)
        out.append(Launch(f"tree_verify chunk stats{' (temperature)' if has_temp else ''}", tv._chunk_stats, args,
                          *tv.LAUNCH["chunk_stats"]))
    for has_draft in (False, True):
        args = dict(logit_ptr="*bf16", q_ptr="*bf16", temp_ptr="*fp32", unif_ptr="*fp32", max_ptr="*fp32",
                    sum_ptr="*fp32", sample_ptr="*i32", res_ptr="*fp32", **ints,
                    HAS_DRAFT=has_draft, BLOCK_C=block_c, BLOCK=tv.BLOCK)
        out.append(Launch(f"tree_verify sample{' + residual' if has_draft else ''}", tv._sample, args,
                          *tv.LAUNCH["sample"]))
    for has_temp, has_draft in ((False, False), (True, False), (True, True)):
        args = dict(tok_ptr="*i64", par_ptr="*i32", logit_ptr="*bf16", q_ptr="*bf16", temp_ptr="*fp32",
                    unif_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", arg_ptr="*i32", sample_ptr="*i32",
                    res_ptr="*fp32", len_ptr="*i32", acc_ptr="*i32", out_ptr="*i64", last_ptr="*i32", **ints,
                    HAS_TEMP=has_temp, HAS_DRAFT=has_draft, BLOCK_NODES=16, BLOCK_C=block_c, BLOCK=tv.BLOCK)
        what = "greedy" if not has_temp else ("sampling, draft_probs" if has_draft else "sampling")
        out.append(Launch(f"tree_verify walk ({what})", tv._walk, args, *tv.LAUNCH["walk"]))
    return out


def launches() -> list[Launch]:
    return _down_proj_launches() + _attention_launches() + _centroid_launches() + _tree_verify_launches()


# Largest shared memory one block may use (opt-in), per architecture.
SHARED_LIMIT = {80: 166912, 90: 232448}


def report(archs=ARCHS) -> list[dict]:
    """Every launch compiled for every arch: resources and whether it fits without spilling."""
    rows = []
    for launch in launches():
        for arch in archs:
            _, res = compile_launch(launch, arch)
            problems = []
            if res.local_bytes or res.stack_bytes:
                problems.append(f"spills: {res.local_bytes} B local, {res.stack_bytes} B stack per thread")
            if res.shared_bytes > SHARED_LIMIT[arch]:
                problems.append(f"shared memory {res.shared_bytes} B > {SHARED_LIMIT[arch]} B")
            rows.append(dict(name=launch.name, kernel=launch.kernel.__name__, arch=f"sm_{arch}",
                             num_warps=launch.num_warps, num_stages=launch.num_stages, **res._asdict(),
                             problems=problems))
    return rows


if __name__ == "__main__":
    import json
    import sys

    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the AOT compile needs the real @triton.jit kernels")
    json.dump(report(), sys.stdout, indent=1)
