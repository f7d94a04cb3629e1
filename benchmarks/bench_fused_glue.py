"""The fused glue of a drafter layer (rms_norm_q_rope, rms_norm_linear, rms_norm_gate_up) per call, at
the real projections of E2B and 31B: the Triton and the CUDA kernels against the unfused PyTorch
composition they replace (the reference backend: Hugging Face's norms, adds, linears, gelu and RoPE as
separate ops).

This is where the two GEMV designs meet on the same bytes: Triton's tl.dot tile loop and the CUDA
kernel's 16-byte fragment loads (csrc/include/gemma4_mtp/rms_norm_linear.cuh). Floor: the weight once
plus the activations (roofline.fused_glue). Prediction: benchmarks/README.md, "CUDA glue".
"""
from __future__ import annotations

import importlib
import math
from unittest import mock

import torch

import gemma4_mtp_kernels as gk

from . import roofline
from .common import Case, close, ours

# the module (the package's attribute of that name is the op function it re-exports)
_gate_up_module = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_gate_up")

TINY = dict(Hb=96, Hd=64, inter=128, Hq=2, D_swa=64, D_full=128)


def projections(d: dict) -> list[tuple[str, str, int, int, int | None, str]]:
    """(label, op, H, N, head dim or down_proj rows, prologue) of one layer's calls: the full layer's q and
    o_proj, the MLP's two halves, the whole MLP (gate_up with its down_weight: what a step runs), the
    post-projection (the final norm in front), and the sliding layers' q and o_proj (most of a step's layers:
    the launch-configuration sweep times every shape a step launches)."""
    Hd, Hq, D, Ds = d["Hd"], d["Hq"], d["D_full"], d["D_swa"]
    return [("q_proj full", "rms_norm_q_rope", Hd, Hq * D, D, "layer"),
            ("o_proj full", "rms_norm_linear", Hq * D, Hd, None, "none"),
            ("gate_up", "rms_norm_gate_up", Hd, d["inter"], None, "layer"),
            ("down_proj", "rms_norm_linear", d["inter"], Hd, None, "none"),
            ("mlp", "rms_norm_gate_up", Hd, d["inter"], Hd, "layer"),
            ("post_projection", "rms_norm_linear", Hd, d["Hb"], None, "layer"),
            ("q_proj sliding", "rms_norm_q_rope", Hd, Hq * Ds, Ds, "layer"),
            ("o_proj sliding", "rms_norm_linear", Hq * Ds, Hd, None, "none")]


def _inputs(op, H, N, D, T, prologue):
    def make(device, dtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*shape, scale=1.0, mean=0.0):
            return (mean + scale * torch.randn(*shape, generator=g, device=device)).to(dtype)
        i = {"x": rnd(T, H), "weight": rnd(N, H, scale=1 / math.sqrt(H)), "kw": {}}
        if prologue == "layer":
            i["kw"] = dict(norm_weight=rnd(H, scale=0.2, mean=1.0), residual=rnd(T, H),
                           residual_norm_weight=rnd(H, scale=0.2, mean=1.0), layer_scalar=rnd(1, scale=0.1, mean=0.7),
                           residual_out=torch.empty(T, H, dtype=dtype, device=device))
        if op == "rms_norm_gate_up":
            i["args"] = (rnd(N, H, scale=1 / math.sqrt(H)),)
            if D is not None:  # the whole MLP: D is down_proj's rows
                i["kw"]["down_weight"] = rnd(D, N, scale=1 / math.sqrt(N))
        elif op == "rms_norm_q_rope":
            inv = 1.0 / (10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
            i["args"] = (rnd(D, scale=0.2, mean=1.0), torch.full((T,), 8191, dtype=torch.long, device=device), inv)
        else:
            i["args"] = ()
        return i
    return make


def _call(op):
    def call(fn, i, backend):
        return fn(i["x"], i["weight"], *i["args"], backend=backend, **i["kw"])
    return call


def _two_launches(call):
    """`call` with the one-launch MLP off (Triton's MLP_MAX_T 0) while it runs, a graph capture included."""
    def two(fn, i, backend):
        with mock.patch.object(_gate_up_module, "MLP_MAX_T", 0):
            return call(fn, i, backend)
    return two


def _cuda_two_launch_mlp(fn, i, backend):
    """The whole MLP as the CUDA binding runs it above its one-launch rule (glue_logic.h
    glue_mlp_one_launch): gate_up into m, then down_proj."""
    kw = {k: v for k, v in i["kw"].items() if k != "down_weight"}
    m = fn(i["x"], i["weight"], *i["args"], backend=backend, **kw)
    return gk.rms_norm_linear(m, i["kw"]["down_weight"], backend=backend)


def cases(dry: bool) -> list[Case]:
    grid = [("tiny", TINY, T) for T in (1, 3)] if dry else [("31B", roofline.DRAFTERS["31B"], 1),
                                                             ("E2B", roofline.DRAFTERS["E2B"], 1),
                                                             ("31B", roofline.DRAFTERS["31B"], 8)]
    out = []
    for name, d, T in grid:
        for label, op, H, N, D, prologue in projections(d):
            call = _call(op)
            mlp = label == "mlp"
            params = dict(drafter=name, H=H, N=N, T=T, D=D)
            baselines = {"torch_composition": ours(op, "torch", call), "triton": ours(op, "triton", call),
                         "cuda": ours(op, "cuda", call)}
            if mlp:  # the same call as two launches (gate_up, then down_proj), as above the one-launch rules
                baselines["triton_two_launch_mlp"] = ours(op, "triton", _two_launches(call))
                baselines["cuda_two_launch_mlp"] = ours(op, "cuda", _cuda_two_launch_mlp)
                params["down"] = D  # down_proj's rows: a shape parameter of the call (make_verified.SHAPES)
            out.append(Case(
                op=op, label=f"{name} {label} T={T}", params=params,
                cost=roofline.fused_glue(op, H, N, T, prologue=prologue != "none", down=D if mlp else None),
                make_inputs=_inputs(op, H, N, D, T, prologue),
                reference=lambda i, call=call, op=op: call(getattr(gk, op), i, "torch"),
                baselines=baselines, default_compare=close))
    return out
