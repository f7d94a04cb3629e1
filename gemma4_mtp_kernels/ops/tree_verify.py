"""Public `tree_verify` (SPEC §4.4): validation, then dispatch."""
from __future__ import annotations

import torch

from .. import _checks as C
from .._dispatch import resolve

OP = "tree_verify"


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None,
                backend="auto"):
    """Accept the longest drafted path the target agrees with; returns a VerifyResult.

    draft_tokens [B, N] int32/int64 (node 0 = last committed token); parents [B, N] int32
    (parents[:, 0] == -1, 0 <= parents[b, i] < i or -1 for padding); target_logits [B, N, V].
    temperature None (all greedy), a float, or [B] fp32 (0 = greedy row); uniforms [B, N, 2] fp32 in
    [0, 1), required for sampling rows; draft_probs [B, N, V] for chain drafts sampled from q.
    The rows of used nodes hold no NaN, and in a sampling request target_logits / temperature has a
    finite maximum (no all -inf row, no +inf, no overflow from a tiny temperature): there is no
    distribution to sample otherwise. Checked on CPU (and on CUDA with value checks); the reference
    raises the same ValueError when it reaches such a row.
    """
    C.tensor(OP, "draft_tokens", draft_tokens, ndim=2, dtypes=C.INDEX_DTYPES)
    C.tensor(OP, "parents", parents, ndim=2, dtypes=(torch.int32,))
    C.tensor(OP, "target_logits", target_logits, ndim=3, dtypes=C.FLOAT_DTYPES)
    B, N, V = target_logits.shape
    if N < 1:
        C.fail_value(OP, "target_logits", "at least one node (shape[1] >= 1)", f"shape {tuple(target_logits.shape)}")
    if V < 1:
        C.fail_value(OP, "target_logits", "a non-empty vocabulary (shape[2] >= 1)", f"shape {tuple(target_logits.shape)}")
    for name, t in (("draft_tokens", draft_tokens), ("parents", parents)):
        if tuple(t.shape) != (B, N):
            C.fail_value(OP, name, f"of shape (B, N) = {(B, N)} from target_logits", f"shape {tuple(t.shape)}")
    C.inner_contiguous(OP, "target_logits", target_logits)
    C.contiguous(OP, "parents", parents)
    C.contiguous(OP, "draft_tokens", draft_tokens)
    dev = target_logits.device
    C.same_device(OP, "target_logits", target_logits, [("draft_tokens", draft_tokens), ("parents", parents)])

    all_greedy = False  # known on the host without reading a tensor
    if temperature is not None and not isinstance(temperature, torch.Tensor):
        t = C.finite_float(OP, "temperature", temperature)
        if t < 0:
            C.fail_value(OP, "temperature", ">= 0", t)
        all_greedy = t == 0
        temperature = torch.full((B,), t, dtype=torch.float32, device=dev)
    if temperature is not None:
        C.tensor(OP, "temperature", temperature, ndim=1, dtypes=(torch.float32,))
        C.dim(OP, "temperature", temperature, 0, B, "B")
        C.same_device(OP, "target_logits", target_logits, [("temperature", temperature)])
        C.contiguous(OP, "temperature", temperature)
    if uniforms is not None:
        C.tensor(OP, "uniforms", uniforms, ndim=3, dtypes=(torch.float32,))
        if tuple(uniforms.shape) != (B, N, 2):
            C.fail_value(OP, "uniforms", f"of shape (B, N, 2) = {(B, N, 2)}", f"shape {tuple(uniforms.shape)}")
        C.same_device(OP, "target_logits", target_logits, [("uniforms", uniforms)])
        C.contiguous(OP, "uniforms", uniforms)
    if draft_probs is not None:
        C.tensor(OP, "draft_probs", draft_probs, ndim=3, dtypes=C.FLOAT_DTYPES)
        if tuple(draft_probs.shape) != (B, N, V):
            C.fail_value(OP, "draft_probs", f"of shape (B, N, V) = {(B, N, V)}", f"shape {tuple(draft_probs.shape)}")
        C.same_device(OP, "target_logits", target_logits, [("draft_probs", draft_probs)])
        C.inner_contiguous(OP, "draft_probs", draft_probs)
        if temperature is None:
            C.fail_value(OP, "draft_probs", "None when temperature is None (greedy rows ignore draft probabilities)",
                         "a tensor")

    if temperature is not None and uniforms is None and not all_greedy:
        if not C.values_checkable(temperature) or bool((temperature > 0).any()):
            C.fail_value(OP, "uniforms", "a [B, N, 2] fp32 tensor when any row samples (temperature > 0)", "None")
    if C.values_checkable(parents):
        _check_tree(parents, draft_probs is not None)
        C.index_range(OP, "draft_tokens", draft_tokens[parents >= 0],
                      0, V, "vocabulary ids of drafted nodes")
        if temperature is not None:
            if not bool((torch.isfinite(temperature) & (temperature >= 0)).all()):
                C.fail_value(OP, "temperature", "finite and >= 0 in every row", temperature.tolist())
        _check_logits(target_logits, parents, temperature)
        if uniforms is not None and uniforms.numel():
            if bool(((uniforms < 0) | (uniforms >= 1) | torch.isnan(uniforms)).any()):
                C.fail_value(OP, "uniforms", "in [0, 1)", f"min {float(uniforms.min())}, max {float(uniforms.max())}")
    if uniforms is None:
        # the checks above admit no uniforms only when every row is greedy: hand the backends the
        # plain greedy call rather than a temperature they would have to prove all zero
        temperature = draft_probs = None
    impl = resolve(OP, backend, dev, target_logits.dtype,
                   {"B": B, "N": N, "V": V, "sampling": uniforms is not None, "draft_probs": draft_probs is not None})
    return impl(draft_tokens, parents, target_logits, temperature=temperature, uniforms=uniforms,
                draft_probs=draft_probs)


def _check_tree(parents: torch.Tensor, chain_only: bool) -> None:
    B, N = parents.shape
    if B == 0:
        return
    if bool((parents[:, 0] != -1).any()):
        b = int((parents[:, 0] != -1).nonzero()[0])
        C.fail_value(OP, "parents", "-1 at node 0 (the root)", f"parents[{b}, 0] = {int(parents[b, 0])}")
    idx = torch.arange(N, device=parents.device)
    bad = (parents < -1) | (parents >= idx[None, :])
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        C.fail_value(OP, "parents", "topological: -1 or 0 <= parents[b, i] < i",
                     f"parents[{b}, {i}] = {int(parents[b, i])}")
    used = parents >= 0
    used[:, 0] = True
    par = parents.clamp(min=0).long()
    orphan = (parents >= 0) & ~torch.gather(used, 1, par)
    if bool(orphan.any()):
        b, i = orphan.nonzero()[0].tolist()
        C.fail_value(OP, "parents", "pointing at used nodes (padding slots have no children)",
                     f"parents[{b}, {i}] = {int(parents[b, i])}, a padding slot")
    if chain_only:
        children = torch.zeros(B, N, dtype=torch.int64, device=parents.device)
        children.scatter_add_(1, par, (parents >= 0).long())
        if bool((children > 1).any()):
            b, i = (children > 1).nonzero()[0].tolist()
            C.fail_value(OP, "draft_probs", "given only for chain drafts (at most one child per node)",
                         f"node {i} of request {b} with {int(children[b, i])} children")


def _check_logits(target_logits, parents, temperature) -> None:
    """Rows of used nodes hold no NaN; sampling rows have a distribution (see tree_verify)."""
    used = parents >= 0
    used[:, 0] = True
    rows = target_logits[used]
    if bool(torch.isnan(rows).any()):
        C.fail_value(OP, "target_logits", "free of NaN in the rows of used nodes", "NaN")
    if temperature is None:
        return
    sampling = used & (temperature > 0)[:, None]
    if not bool(sampling.any()):
        return
    b, i = sampling.nonzero().unbind(1)
    x = target_logits[b, i].float()
    peak = x.amax(dim=1)
    bad = (peak == float("inf")) | (peak == float("-inf"))
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        C.fail_value(OP, "target_logits", "finite at its maximum in every used node of a sampling request "
                     "(all -inf or +inf leaves no distribution to sample)", f"maximum {float(peak[j])} at request {int(b[j])}, node {int(i[j])}")
    scaled = (x / temperature[b][:, None]).amax(dim=1)
    if not bool(torch.isfinite(scaled).all()):
        j = int((~torch.isfinite(scaled)).nonzero()[0])
        C.fail_value(OP, "temperature", "large enough that target_logits / temperature stays finite",
                     f"{float(temperature[b[j]])} at request {int(b[j])}")
