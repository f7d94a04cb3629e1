"""dense_lm_head inputs, the fp64 oracle and the check of a backend's top-k (all backends).

Ranks must be the oracle's except where the competing exact scores lie within the fp32 summation
error bound of each other (any summation order): the check verifies each such exception."""
from __future__ import annotations

import torch

import gemma4_mtp_kernels as g

U32 = 2.0 ** -24


def make(T, Hd, V, dtype, gen):
    return torch.randn(T, Hd, generator=gen).to(dtype), torch.randn(V, Hd, generator=gen).to(dtype)


def exact_scores(hidden, lm_head):
    """fp64 logits and a bound on the fp32-accumulation error of any summation order."""
    h, w = hidden.double().cpu(), lm_head.double().cpu()
    return h @ w.T, h.shape[1] * U32 * (h.abs() @ w.abs().T) + 1e-30


def check_topk(hidden, lm_head, k, backend, device="cpu", what="", call=None):
    """`backend`'s top-k (or `call`'s: the same arguments without backend=, e.g. the CUDA kernels on
    the CPU emulator) against the fp64 oracle."""
    fn = call if call is not None else lambda h, w, k: g.dense_lm_head(h, w, k=k, backend=backend)
    ids, vals = fn(hidden.to(device), lm_head.to(device), k)
    T, V = hidden.shape[0], lm_head.shape[0]
    assert ids.shape == (T, k) and ids.dtype == torch.int64 and vals.shape == (T, k) and vals.dtype == torch.float32
    assert ids.is_contiguous() and vals.is_contiguous()
    ids, vals = ids.cpu(), vals.cpu()
    exact, bound = exact_scores(hidden, lm_head)
    assert bool(((ids >= 0) & (ids < V)).all()), f"{what}: ids out of range"
    for t in range(T):
        assert len(set(ids[t].tolist())) == k, f"{what}: repeated ids in row {t}"
    got_exact = exact.gather(1, ids)
    # each returned logit is its id's logit (fp32 sums of the exact products)
    assert bool(((vals.double() - got_exact).abs() <= bound.gather(1, ids)).all()), f"{what}: logits off"
    want = torch.sort(exact, dim=1, descending=True, stable=True)
    for t in range(T):
        for r in range(k):
            # rank r holds a token whose exact score is the exact r-th score, up to two error bounds
            i, j = int(ids[t, r]), int(want.indices[t, r])
            tie = bound[t, i] + bound[t, j]
            assert abs(exact[t, i] - exact[t, j]) <= tie, f"{what}: row {t} rank {r}: id {i}, expected {j}"
            if i != j:  # only a near tie may swap: then both must be among the near-equal scores
                assert abs(exact[t, i] - want.values[t, r]) <= tie
    # best first: the returned logits never increase
    assert bool((vals[:, 1:] <= vals[:, :-1]).all()), f"{what}: not best first"
    return ids, vals


def ties_case(dtype):
    """Rows 7, 3 and 11 equal (the highest logit), row 5 the next: ties go to the lower id."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.ones(1, 16, dtype=dtype)
    lm_head = (0.01 * torch.randn(40, 16, generator=gen)).to(dtype)
    for r in (7, 3, 11):
        lm_head[r] = 1.0
    lm_head[5] = 0.5
    return hidden, lm_head, [3, 7, 11, 5]
