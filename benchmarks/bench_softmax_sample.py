"""softmax_sample (a sampled draft token and its q, two launches) vs what the decode loop ran before it:
torch's softmax of the logits / temperature, q copied into the round's buffer, an fp64 cumulative sum,
searchsorted and the rounding fallback (~14 launches, ~10 MiB per row at V = 262144; graph-replayed
like ours: it never reads the device from the host), and that composition under torch.compile.

Floor: the fp32 logits read once and q written once (roofline.softmax_sample).
"""
from __future__ import annotations

import torch

import gemma4_mtp_kernels as gk
from gemma4_mtp_kernels import reference

from . import roofline
from .common import Case, close, compiled, equal, ours

OP = "softmax_sample"
# The sampled draft token as graphs.draft_tree drew it before softmax_sample: the reference backend's
# torch ops, called directly (no public op around them)
torch_composite = reference.softmax_sample


def _inputs(B, V, support):
    def make(device, dtype, seed):
        # the heads' dense fp32 output (whatever the weights' dtype): -inf outside a centroid head's candidates
        g = torch.Generator(device=device).manual_seed(seed)
        logits = torch.randn(B, V, generator=g, device=device) * 3
        if support is not None:
            keep = torch.rand(B, V, generator=g, device=device).argsort(dim=1)[:, :support]
            logits = torch.full_like(logits, float("-inf")).scatter(1, keep, logits.gather(1, keep))
        return {"logits": logits, "temperature": torch.full((B,), 0.8, device=device),
                "uniforms": torch.rand(B, generator=g, device=device, dtype=torch.float64),
                "probs": torch.empty(B, V, device=device)}
    return make


def _call(fn, i, backend):
    return fn(i["logits"], i["temperature"], i["uniforms"], probs_out=i["probs"], backend=backend)


def _same(out, ref):
    tokens = equal(out[0], ref[0])
    probs = close(out[1], ref[1], rtol=1e-4, atol=1e-7)
    return {"ok": tokens["ok"] and probs["ok"], "mismatches": tokens["mismatches"], "max_abs_err": probs["max_abs_err"]}


def cases(dry: bool) -> list[Case]:
    composite_c = compiled(torch_composite, dry)
    V = 3000 if dry else roofline.DRAFTERS["E2B"]["vocab"]
    grid = [(2, None), (3, 40)] if dry else [(1, 4096), (1, None), (8, 4096), (32, 4096)]
    out = []
    for B, support in grid:
        def plain(fn):
            return lambda i: (lambda: fn(i["logits"], i["temperature"], i["uniforms"], probs_out=i["probs"]))

        what = "dense head" if support is None else f"centroid head ({support} candidates)"
        out.append(Case(
            op=OP, label=f"{what} B={B}", params=dict(B=B, V=V, support=support),
            cost=roofline.softmax_sample(B, V), make_inputs=_inputs(B, V, support),
            reference=lambda i: _call(gk.softmax_sample, i, "torch"),
            baselines={"torch_composite": plain(torch_composite), "torch_composite_compile": plain(composite_c),
                       "triton": ours(OP, "triton", _call), "cuda": ours(OP, "cuda", _call)},
            default_compare=_same))
    return out
