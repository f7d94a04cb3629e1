"""Reference `centroid_logits` (SPEC §4.3): score centroids, keep top_k clusters, score their tokens."""
import torch


def candidates(hidden, centroids, token_ordering, top_k):
    """Candidate token ids [T, K] in cluster order (descending score, ties to the lower cluster)."""
    scores = hidden.float() @ centroids.float().T
    # a stable descending sort keeps equal scores in ascending cluster order
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    clusters = token_ordering.long().view(centroids.shape[0], -1)
    return clusters[top].reshape(hidden.shape[0], top_k * clusters.shape[1])


def best_of_candidates(ids, logits, k):
    """The k best candidates of (ids, logits) [T, K], best first, ties to the lower id (stable sorts: by id,
    then by descending logit; NaN first, as torch sorts)."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    ids, logits = ids.gather(1, by_id), logits.gather(1, by_id)
    best = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k]
    return ids.gather(1, best), logits.gather(1, best)


def centroid_logits(hidden, centroids, token_ordering, lm_head, *, top_k=32, output="argmax", fill_value=None, k=1):
    T = hidden.shape[0]
    V = lm_head.shape[0]
    ids = candidates(hidden, centroids, token_ordering, top_k)  # [T, K]
    logits = torch.einsum("td,tkd->tk", hidden.float(), lm_head[ids].float())
    if output == "sparse":
        return ids, logits
    if output == "dense":
        dense = torch.full((T, V), fill_value, dtype=torch.float32, device=hidden.device)
        return dense.scatter_(1, ids, logits)
    if output == "topk":
        return best_of_candidates(ids, logits, k)
    # argmax, ties to the lowest vocabulary id
    best = logits.max(dim=1, keepdim=True).values
    big = torch.iinfo(torch.int64).max
    token = torch.where(logits == best, ids, torch.full_like(ids, big)).min(dim=1).values
    return token, best.squeeze(1)
