"""Reference `tree_verify` (SPEC §4.4): walk each request's tree node by node."""
import torch

from .._types import VerifyResult


def inverse_cdf(probs: torch.Tensor, u) -> torch.Tensor:
    """Per row of probs [..., V], the first id whose cumulative probability (fp64) exceeds u [...] (or a
    float); the last id with nonzero probability where rounding leaves the total at or below u. Device
    ops only (no host read): the reference softmax_sample draws with it inside a captured round."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    if isinstance(u, torch.Tensor):
        u = u.to(torch.float64).expand(cdf.shape[:-1])
    else:
        u = torch.full(cdf.shape[:-1], u, dtype=torch.float64, device=probs.device)
    hit = torch.searchsorted(cdf, u.unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, -1).amax(dim=-1)
    return torch.where(hit < probs.shape[-1], hit, last)


def _distribution(logits: torch.Tensor, temp: float, b: int, u: int) -> torch.Tensor:
    """softmax(logits / temp); a row with no finite maximum (all -inf, +inf, overflow) has no
    distribution to sample, which the public op rejects up front where it can read the values."""
    scaled = logits / temp
    if not bool(torch.isfinite(scaled.max())):
        raise ValueError(f"tree_verify: target_logits / temperature must have a finite maximum in every visited "
                         f"node of a sampling request, got {float(scaled.max())} at request {b}, node {u}")
    return torch.softmax(scaled, dim=0)


def _children(parents_row):
    kids = [[] for _ in parents_row]
    for i in range(1, len(parents_row)):
        if parents_row[i] >= 0:
            kids[parents_row[i]].append(i)  # ascending node index
    return kids


def tree_verify(draft_tokens, parents, target_logits, *, temperature=None, uniforms=None, draft_probs=None):
    B, N, V = target_logits.shape
    dev = target_logits.device
    accept_len = torch.zeros(B, dtype=torch.int32)
    accepted = torch.full((B, N), -1, dtype=torch.int32)
    tokens = torch.full((B, N), -1, dtype=torch.int64)
    last = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        kids = _children(parents[b].tolist())
        drafts = draft_tokens[b].tolist()
        temp = 0.0 if temperature is None else float(temperature[b])
        path, bonus, u = [], None, 0
        while bonus is None:
            logits = target_logits[b, u].float()
            by_token = {}
            for c in kids[u]:
                by_token.setdefault(drafts[c], c)  # duplicates: the lowest-index child wins
            if temp == 0.0:
                t = int(torch.argmax(logits))  # first maximum = lowest id
                child = by_token.get(t)
            elif draft_probs is None:
                t = int(inverse_cdf(_distribution(logits, temp, b, u), float(uniforms[b, u, 0])))
                child = by_token.get(t)
            else:
                p = _distribution(logits, temp, b, u)
                child, t = None, None
                if kids[u]:
                    c = kids[u][0]  # chains only: one child
                    q = draft_probs[b, u].float()
                    x = drafts[c]
                    if q[x] > 0 and float(uniforms[b, u, 0]) < float(p[x] / q[x]):
                        child, t = c, x
                    else:
                        residual = (p - q).clamp(min=0)
                        total = residual.sum()
                        # p == q leaves no residual; rejection is then impossible in exact arithmetic
                        t = int(inverse_cdf(residual / total if total > 0 else p, float(uniforms[b, u, 1])))
                else:
                    t = int(inverse_cdf(p, float(uniforms[b, u, 1])))
            if child is None:
                bonus = t
            else:
                path.append(child)
                u = child
        n = len(path)
        accept_len[b] = n
        accepted[b, :n] = torch.tensor(path, dtype=torch.int32)
        tokens[b, :n] = torch.tensor([drafts[c] for c in path], dtype=torch.int64)
        tokens[b, n] = bonus
        last[b] = path[-1] if path else 0
    return VerifyResult(accept_len.to(dev), accepted.to(dev), tokens.to(dev), last.to(dev))
