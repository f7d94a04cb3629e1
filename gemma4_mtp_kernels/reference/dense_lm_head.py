"""Reference `dense_lm_head`: fp32 logits of the bf16/fp16 head (exact products, fp32 sums), their top k."""
import torch


def dense_lm_head(hidden, lm_head, *, output="topk", k=1):
    scores = hidden.float() @ lm_head.float().T
    if output == "dense":
        return scores
    # a stable descending sort puts ties in ascending id order (and NaN first, as torch sorts it)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k].contiguous()
    return order, scores.gather(1, order)
