"""tree_verify vs what a PyTorch decode loop does: argmax (or softmax) of every node's logits on the
device, then the walk in Python on the host; the compiled device half; FlashInfer's chain
speculative sampling when importable (sampled chain drafts only).

Floor: every node's target logits read once (roofline.tree_verify).
"""
from __future__ import annotations

import torch

import gemma4_mtp_kernels as gk

from . import roofline
from .common import Case, Missing, compiled, equal, external, needs_cuda, ours

OP = "tree_verify"


def greedy_argmax(target_logits):
    return target_logits.argmax(dim=-1)


def python_walk(draft_tokens, parents, best):
    """The host-side greedy walk over device argmaxes (one sync), as a Python decode loop runs it."""
    tokens, par, best = draft_tokens.tolist(), parents.tolist(), best.tolist()
    B, N = len(tokens), len(tokens[0])
    accept = torch.zeros(B, dtype=torch.int32)
    out = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        u, path = 0, []
        while True:
            t = best[b][u]
            child = next((c for c in range(u + 1, N) if par[b][c] == u and tokens[b][c] == t), None)
            if child is None:
                break
            path.append(child)
            u = child
        accept[b] = len(path)
        out[b, : len(path) + 1] = torch.tensor([tokens[b][c] for c in path] + [t])
    return accept, out


def _tree(B, N, branching):
    """Parents of a complete tree with `branching` children per node (1 = chain), nodes in BFS order."""
    par = [-1] + [(i - 1) // branching for i in range(1, N)]
    return torch.tensor([par] * B, dtype=torch.int32)


def _inputs(B, N, V, branching, sampling):
    def make(device, dtype, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        logits = torch.randn(B, N, V, generator=g, device=device) * 3
        parents = _tree(B, N, branching).to(device)
        draft = torch.randint(0, V, (B, N), generator=g, device=device)
        # make the target agree with about half the drafted nodes so walks go a few levels deep
        best = logits.argmax(-1)
        agree = torch.rand(B, N, generator=g, device=device) < 0.6
        for i in range(1, N):
            p = parents[:, i].long()
            take = agree[:, i]
            draft[take, i] = best[take, p[take]]
        inp = {"draft_tokens": draft, "parents": parents, "target_logits": logits.to(dtype)}
        if sampling:
            inp["temperature"] = torch.full((B,), 0.8, device=device)
            inp["uniforms"] = torch.rand(B, N, 2, generator=g, device=device)
            inp["draft_probs"] = torch.softmax(torch.randn(B, N, V, generator=g, device=device), -1).to(dtype)
        return inp
    return make


def _call(fn, i, backend):
    return fn(i["draft_tokens"], i["parents"], i["target_logits"], temperature=i.get("temperature"),
              uniforms=i.get("uniforms"), draft_probs=i.get("draft_probs"), backend=backend)


def _same(out, ref):
    return equal((out.accept_len, out.output_tokens), (ref.accept_len, ref.output_tokens))


def cases(dry: bool) -> list[Case]:
    argmax_c = compiled(greedy_argmax, dry)
    V = 512 if dry else 262144
    if dry:
        grid = [(2, 5, 1, False), (2, 7, 2, False), (2, 4, 1, True)]
    else:
        grid = [(1, 5, 1, False), (8, 5, 1, False), (64, 5, 1, False), (8, 16, 4, False), (8, 5, 1, True)]
    out = []
    for B, N, branching, sampling in grid:
        shape = "chain" if branching == 1 else f"tree b={branching}"
        if sampling:
            baselines = {"flashinfer_chain_speculative_sampling": _flashinfer_chain,
                         "triton": ours(OP, "triton", _call), "cuda": ours(OP, "cuda", _call)}
            compare = {"flashinfer_chain_speculative_sampling": lambda o, r: {
                "ok": None, "detail": "draws its own uniforms: same distribution, different samples"}}
        else:
            def walk(fn):
                return lambda i: (lambda: python_walk(i["draft_tokens"], i["parents"], fn(i["target_logits"])))
            baselines = {"torch_argmax_python_walk": walk(greedy_argmax),
                         "torch_compile_argmax_python_walk": walk(argmax_c),
                         "triton": ours(OP, "triton", _call), "cuda": ours(OP, "cuda", _call)}
            compare = {k: (lambda o, r: equal(o, (r.accept_len, r.output_tokens)))
                       for k in ("torch_argmax_python_walk", "torch_compile_argmax_python_walk")}
        out.append(Case(
            op=OP, label=f"{'sampling' if sampling else 'greedy'} {shape} B={B} N={N}",
            params=dict(B=B, N=N, V=V, branching=branching, sampling=sampling),
            cost=roofline.tree_verify(B, N, V, sampling=sampling, draft_probs=sampling),
            make_inputs=_inputs(B, N, V, branching, sampling),
            reference=lambda i: _call(gk.tree_verify, i, "torch"),
            baselines=baselines, compare=compare, default_compare=_same,
            eager=frozenset({"torch_argmax_python_walk", "torch_compile_argmax_python_walk"})))
    return out


def _flashinfer_chain(i):
    needs_cuda(i, "FlashInfer sampling")
    fn = external("flashinfer.sampling", "chain_speculative_sampling")
    logits, probs = i["target_logits"], i["draft_probs"]
    B, N, V = logits.shape
    if not bool((i["parents"][:, 1:] == torch.arange(N - 1, device=logits.device)).all()):
        raise Missing("FlashInfer's chain speculative sampling takes chains only")
    draft = i["draft_tokens"][:, 1:].to(torch.int32)
    q = probs[:, :-1].float()
    temp = i["temperature"].view(B, 1, 1)
    return lambda: fn(q, draft, torch.softmax(logits.float() / temp, dim=-1))
