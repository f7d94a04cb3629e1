"""fused_concat_down_proj vs the composition Hugging Face runs (scaled embedding, cat, linear).

Floor: the pre_projection weight [Hd, 2Hb] once plus T embedding and hidden rows (roofline.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import gemma4_mtp_kernels as gk

from . import roofline
from .common import Case, close, compiled, ours

OP = "fused_concat_down_proj"


def hf_composition(token_ids, embed_table, hidden, weight, scale):
    # Gemma's scaled embedding multiplies by the scale already rounded to the table dtype
    emb = F.embedding(token_ids, embed_table) * scale
    return F.linear(torch.cat([emb, hidden], dim=-1), weight)


def _inputs(Hb, Hd, V, T):
    def make(device, dtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return {
            "token_ids": torch.randint(0, V, (T,), generator=g, device=device),
            "embed_table": (torch.randn(V, Hb, generator=g, device=device) * 0.05).to(dtype),
            "hidden": torch.randn(T, Hb, generator=g, device=device).to(dtype),
            "weight": (torch.randn(Hd, 2 * Hb, generator=g, device=device) / math.sqrt(2 * Hb)).to(dtype),
            "embed_scale": math.sqrt(Hb),
        }
    return make


def _call(fn, i, backend):
    return fn(i["token_ids"], i["embed_table"], i["hidden"], i["weight"], embed_scale=i["embed_scale"],
              backend=backend)


def cases(dry: bool) -> list[Case]:
    hf_c = compiled(hf_composition, dry)

    def hf(fn):
        def factory(i):
            scale = torch.tensor(i["embed_scale"], dtype=i["embed_table"].dtype, device=i["hidden"].device)
            return lambda: fn(i["token_ids"], i["embed_table"], i["hidden"], i["weight"], scale)
        return factory

    baselines = {"hf_torch": hf(hf_composition), "hf_torch_compile": hf(hf_c),
                 "triton": ours(OP, "triton", _call), "cuda": ours(OP, "cuda", _call)}
    # vocab rows are gathered, never scanned: a 262144-row table only costs memory, so GPU cases use
    # a 32768-row table (same bytes moved) to keep many rotating input sets affordable
    if dry:
        grid = [("E2B-tiny", 96, 32, 1024, T) for T in (1, 5)]
    else:
        grid = [(n, d["Hb"], d["Hd"], 32768, T) for n, d in roofline.DRAFTERS.items() for T in (1, 8, 64)]
        grid.sort(key=lambda g: (g[0] not in ("31B", "E2B"), g[4]))  # issue 5 targets first
    out = []
    for name, Hb, Hd, V, T in grid:
        out.append(Case(
            op=OP, label=f"{name} T={T}", params=dict(drafter=name, Hb=Hb, Hd=Hd, T=T),
            cost=roofline.concat_down_proj(Hb, Hd, T), make_inputs=_inputs(Hb, Hd, V, T),
            reference=lambda i: _call(gk.fused_concat_down_proj, i, "torch"),
            baselines=baselines, default_compare=close))
    return out
