"""dense_lm_head (the 26B / 31B drafters' 262144 x 1024 head with the top-k fused in) vs what ran before
issue 11 (an fp32 copy of the head, an fp32 GEMV, a full sort) and what Hugging Face runs (a bf16
linear, the [T, V] logits materialised, argmax / topk).

Floor: the head read once plus T hidden rows (roofline.dense_head without materialised logits).
"""
from __future__ import annotations

import math

import torch

import gemma4_mtp_kernels as gk

from . import roofline
from .common import Case, compiled, ours

OP = "dense_lm_head"


def fp32_copy_sort(hidden, lm_head, k: int):
    """The drafter's top_tokens before issue 11."""
    scores = hidden.float() @ lm_head.float().T
    return torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]


def hf_linear_topk(hidden, lm_head, k: int):
    """Hugging Face's assistant head: bf16 logits, then the top k."""
    return torch.topk(torch.nn.functional.linear(hidden, lm_head), k, dim=-1).indices


def _inputs(Hd, V, T):
    def make(device, dtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return {"hidden": torch.randn(T, Hd, generator=g, device=device).to(dtype),
                "lm_head": (torch.randn(V, Hd, generator=g, device=device) / math.sqrt(Hd)).to(dtype)}
    return make


def cases(dry: bool) -> list[Case]:
    hf_c = compiled(hf_linear_topk, dry)
    if dry:
        grid = [("31B-tiny", 32, 3000, T, k) for T, k in ((1, 1), (3, 4))]
    else:
        grid = [(n, roofline.DRAFTERS[n]["Hd"], roofline.DRAFTERS[n]["vocab"], T, k)
                for n in ("31B", "26B-A4B") for T in (1, 8, 32) for k in (1, 2, 8)]
        grid.sort(key=lambda c: (c[0] != "31B", c[3], c[4]))
    out = []
    for name, Hd, V, T, k in grid:
        def call(fn, i, backend, k=k):
            return fn(i["hidden"], i["lm_head"], k=k, backend=backend)

        def plain(fn, k=k):
            return lambda i: (lambda: fn(i["hidden"], i["lm_head"], k))

        ids = lambda o, r: {"ok": None, "detail": "ids only"}  # noqa: E731
        out.append(Case(
            op=OP, label=f"{name} top{k} T={T}", params=dict(drafter=name, Hd=Hd, V=V, T=T, k=k),
            cost=roofline.dense_head(Hd, V, T, materialise_logits=False),
            make_inputs=_inputs(Hd, V, T), reference=lambda i, call=call: call(gk.dense_lm_head, i, "torch"),
            baselines={"fp32_copy_sort": plain(fp32_copy_sort), "hf_linear_topk": plain(hf_linear_topk),
                       "hf_linear_topk_compile": plain(hf_c), "triton": ours(OP, "triton", call),
                       "cuda": ours(OP, "cuda", call)},
            compare={"fp32_copy_sort": lambda o, r: {"ok": bool(torch.equal(o.cpu(), r[0].cpu()))},
                     "hf_linear_topk": ids, "hf_linear_topk_compile": ids,
                     "triton": lambda o, r: {"ok": bool(torch.equal(o[0].cpu(), r[0].cpu()))},
                     "cuda": lambda o, r: {"ok": bool(torch.equal(o[0].cpu(), r[0].cpu()))}}))
    return out
