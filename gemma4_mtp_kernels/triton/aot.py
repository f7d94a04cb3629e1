"""Ahead-of-time compile of the Triton kernels for sm_80 / sm_90 without a GPU, and their resource use.

`launches()` lists every distinct compile the launchers pick for the real drafter shapes, derived
from the launchers' own config functions over the dispatch-time parameters below (SM counts, T, B,
queries per request, context lengths, tree sizes) in bf16, fp16 and fp32. `compile_launch` builds one for a `GPUTarget` and reads registers, shared memory and
local memory (spills) from `cuobjdump -res-usage` of the cubin. Used by tests/test_triton_aot.py and
benchmarks/triton_resources.py.
"""
from __future__ import annotations

import functools
import importlib
import itertools
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
from ..drafter_shapes import DRAFTERS  # noqa: E402

ARCHS = (80, 90)
DIV16 = "div16"  # an int argument that is a multiple of 16 (the JIT specialises those the same way)


class Launch(NamedTuple):
    name: str        # what the configuration is for
    kernel: object   # the @triton.jit function
    args: dict       # arg name -> "*bf16"-style pointer type, "i32", "fp32", DIV16, or a constexpr value
    num_warps: int
    num_stages: int
    dtype: str       # element type of the big operands; fp32 launches (a test dtype) may spill, not fail
    maxnreg: int | None = None  # register cap the launcher passes (None: ptxas chooses)


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
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if launch.maxnreg is not None:
        options["maxnreg"] = launch.maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    res = resource_usage(compiled.asm["cubin"])
    return compiled, res._replace(shared_bytes=res.shared_bytes + compiled.metadata.shared)


# The dispatch-time parameters the launchers see for the real drafters: SM counts (A100, H100/H200),
# tokens per draft step, requests per batch, queries per request (a chain step, tree levels of up to 8
# branches), attended lengths (block table width x block size) and draft tree sizes.
SMS = (108, 132)
TOKENS = (1, 8, 64)
BATCHES = (1, 8, 64)  # 64: enough programs that attention needs no key split (the single-launch path)
QUERIES = (1, 2, 4, 8)
CONTEXTS = (512, 8192, 131072)
TREE_NODES = (1, 8, 64)
# fp16 shares the bf16 tiles; fp32 (a test dtype on the GPU) has its own attention tiles. Kernels whose
# big operands are fp32 whatever the input dtype (merge, split-K reduce) compile in bf16 only.
DTYPES = {"bf16": "tf32", "fp16": "tf32", "fp32": "ieee"}
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _unique(launches):
    """One launch per distinct compile (kernel, argument types and constexprs, warps, stages)."""
    seen = {}
    for launch in launches:
        key = (launch.kernel.__name__, tuple(sorted((k, str(v)) for k, v in launch.args.items())),
               launch.num_warps, launch.num_stages, launch.maxnreg)
        seen.setdefault(key, launch)
    return list(seen.values())


def _attention_launches():
    out = []
    for dtype, prec in DTYPES.items():
        kv = "*" + dtype
        for name, d in DRAFTERS.items():
            for layer in ("swa", "full"):
                D, G = d[f"D_{layer}"], d["Hq"] // d[f"Hkv_{layer}"]
                for Qn, B, ctx, sms in itertools.product(QUERIES, BATCHES, CONTEXTS, SMS):
                    cfg = qa.kernel_config(D, Qn * G, ELEM_BYTES[dtype])
                    max_len = min(ctx, d["window"]) if layer == "swa" else ctx
                    row_tiles = triton.cdiv(Qn * G, cfg["BLOCK_M"])
                    splits = qa.num_splits(B, d[f"Hkv_{layer}"], row_tiles, max_len, cfg["BLOCK_N"], sms)
                    partial = splits > 1
                    args = {n: "i32" for n in qa._attn_kernel.arg_names}
                    args.update(q_ptr=kv, k_ptr=kv, v_ptr=kv, table_ptr="*i32", lens_ptr="*i32",
                                out_ptr="*fp32" if partial else kv, lse_ptr="*fp32", scale_log2="fp32",
                                softcap="fp32", D=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                MIN_CHUNK=qa.MIN_TILES_PER_SPLIT * cfg["BLOCK_N"], HAS_WINDOW=layer == "swa",
                                HAS_SOFTCAP=False, WRITE_LSE=partial, PARTIAL=partial, PREC=prec, INTERP=False)
                    for n in ("sq_b", "sq_q", "sq_h", "sk_b", "sk_s", "sk_h", "sv_b", "sv_s", "sv_h",
                              "so_b", "so_q", "so_h"):
                        args[n] = DIV16
                    what = f"attention {dtype} {name} {layer} D={D} Q={Qn} rows={Qn * G}"
                    out.append(Launch(f"{what}{' split' if partial else ''}", qa._attn_kernel, args,
                                      cfg["num_warps"], cfg["num_stages"], dtype))
                    if partial and dtype == "bf16":
                        merge = {n: "i32" for n in qa._merge_kernel.arg_names}
                        merge.update(po_ptr="*fp32", plse_ptr="*fp32", out_ptr=kv, lse_ptr="*fp32", D=D,
                                     BLOCK_S=pow2_at_least(splits, 2), WRITE_LSE=False, INTERP=False)
                        out.append(Launch(f"attention merge {dtype} D={D} splits={splits}", qa._merge_kernel,
                                          merge, 4, 1, dtype))
    # the optional features on the bf16 tile shapes: softcap, and lse from a single-split launch
    extra = []
    for launch in out:
        if launch.kernel is qa._attn_kernel and launch.dtype == "bf16":
            extra.append(launch._replace(name=launch.name + ", softcap", args=dict(launch.args, HAS_SOFTCAP=True)))
            extra.append(launch._replace(name=launch.name + ", lse", args=dict(launch.args, WRITE_LSE=True)))
        elif launch.kernel is qa._merge_kernel and launch.dtype == "bf16":
            extra.append(launch._replace(name=launch.name + ", lse", args=dict(launch.args, WRITE_LSE=True)))
    return _unique(out + extra)


def _down_proj_launches():
    out = []
    for dtype, prec in DTYPES.items():
        # T = 256 (a large batch of one-token steps): enough row tiles for the direct, unsplit store
        for (name, d), T, sms in itertools.product(DRAFTERS.items(), TOKENS + (256,), SMS):
            cfg = fc.launch_config(T, d["Hb"], d["Hd"], sms)
            partial = cfg["split_k"] > 1
            args = {n: "i32" for n in fc._down_proj_kernel.arg_names}
            args.update(tok_ptr="*i64", emb_ptr="*" + dtype, hid_ptr="*" + dtype, w_ptr="*" + dtype,
                        dst_ptr="*fp32" if partial else "*" + dtype, scale="fp32",
                        stride_emb=DIV16, stride_hid=DIV16, stride_w=DIV16, stride_t=DIV16,
                        BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], BLOCK_K=cfg["BLOCK_K"], PREC=prec,
                        INTERP=False)
            out.append(Launch(f"down_proj {dtype} {name} T={T}{' split-K' if partial else ''}",
                              fc._down_proj_kernel, args, cfg["num_warps"], cfg["num_stages"], dtype))
    red = dict(part_ptr="*fp32", out_ptr="*bf16", numel="i32", split_k="i32", BLOCK=fc.REDUCE_BLOCK, INTERP=False)
    out.append(Launch("down_proj split-K reduce", fc._split_k_reduce_kernel, red, 4, 1, "bf16"))
    return _unique(out)


def _centroid_launches():
    out = []
    for dtype, prec in DTYPES.items():
        for name, d in DRAFTERS.items():
            if d["centroids"] is None:
                continue
            C, Hd, top_k = d["centroids"], d["Hd"], d["top_k"]
            for T in TOKENS:
                sc = cl.score_config(T)
                scores = dict(h_ptr="*" + dtype, c_ptr="*" + dtype, s_ptr="*fp32", T="i32", C=DIV16, Hd=DIV16,
                              s_h=DIV16, s_c=DIV16, BLOCK_C=sc["BLOCK_C"], BLOCK_T=sc["BLOCK_T"],
                              BLOCK_K=sc["BLOCK_K"], PREC=prec, INTERP=False)
                out.append(Launch(f"centroid scores {dtype} {name} T={T}", cl._scores, scores, sc["num_warps"],
                                  sc["num_stages"], dtype))
            cfg = cl.candidate_config(C, d["vocab"] // C, Hd)
            for output in ("argmax", "sparse", "dense"):
                args = dict(h_ptr="*" + dtype, s_ptr="*fp32", order_ptr="*i64", lm_ptr="*" + dtype, best_ptr="*fp32",
                            best_id_ptr="*i32", ids_ptr="*i64", logit_ptr="*fp32", dense_ptr="*fp32",
                            C=DIV16, V=DIV16, Hd=DIV16, CS=DIV16, top_k=DIV16, s_h=DIV16, s_lm=DIV16, s_dense=DIV16,
                            **{k: v for k, v in cfg.items() if not k.startswith("num_")}, OUTPUT=output)
                out.append(Launch(f"centroid candidates {dtype} {name} {output}", cl._candidates, args,
                                  cfg["num_warps"], cfg["num_stages"], dtype))
            red = dict(best_ptr="*fp32", best_id_ptr="*i32", token_ptr="*i64", logit_ptr="*fp32", top_k=DIV16,
                       BLOCK_K=pow2_at_least(top_k, 2))
            out.append(Launch(f"centroid argmax top_k={top_k}", cl._argmax, red, 4, 1, "fp32"))
    return _unique(out)


def _tree_verify_launches():
    V = 262144
    ints = dict(N="i32", V=DIV16, chunk=DIV16, nch="i32", s_b=DIV16, s_n=DIV16, sq_b=DIV16, sq_n=DIV16)
    out = []
    for dtype, B, N, sms in itertools.product(DTYPES, BATCHES, TREE_NODES, SMS):
        chunk = tv.chunk_size(B * N, V, sms)
        block_c = pow2_at_least(triton.cdiv(V, chunk), 2)
        logits = "*" + dtype
        for has_temp, has_draft in ((False, False), (True, False), (True, True)):
            args = dict(tok_ptr="*i64", par_ptr="*i32", logit_ptr=logits, q_ptr=logits, temp_ptr="*fp32",
                        unif_ptr="*fp32", max_ptr="*fp32", sum_ptr="*fp32", arg_ptr="*i32", dec_ptr="*i32",
                        cnt_ptr="*i32", len_ptr="*i32", acc_ptr="*i32", out_ptr="*i64", last_ptr="*i32", **ints,
                        HAS_TEMP=has_temp, HAS_DRAFT=has_draft, BLOCK_NODES=pow2_at_least(N, 2), BLOCK_C=block_c,
                        BLOCK=min(tv.BLOCK, chunk))
            kind = "greedy" if not has_temp else ("sampling, draft_probs" if has_draft else "sampling")
            out.append(Launch(f"tree_verify {dtype} B={B} N={N} chunk={chunk} ({kind})", tv._verify, args,
                              *tv.LAUNCH, dtype, tv.SAMPLING_MAXNREG if has_temp else None))
    return _unique(out)


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
            if (res.local_bytes or res.stack_bytes) and launch.dtype != "fp32":
                problems.append(f"spills: {res.local_bytes} B local, {res.stack_bytes} B stack per thread")
            if res.shared_bytes > SHARED_LIMIT[arch]:
                problems.append(f"shared memory {res.shared_bytes} B > {SHARED_LIMIT[arch]} B")
            rows.append(dict(name=launch.name, kernel=launch.kernel.__name__, arch=f"sm_{arch}", dtype=launch.dtype,
                             num_warps=launch.num_warps, num_stages=launch.num_stages, **res._asdict(),
                             problems=problems))
    return rows


if __name__ == "__main__":
    import json
    import sys

    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the AOT compile needs the real @triton.jit kernels")
    json.dump(report(), sys.stdout, indent=1)
