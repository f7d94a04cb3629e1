"""Reference `softmax_sample`: a token per row drawn from q = softmax(logits / temperature) at a given
uniform, by the inverse CDF of q (fp64 cumulative sums of the fp32 probabilities)."""
from __future__ import annotations

import torch

from .tree_verify import inverse_cdf


def softmax_sample(logits, temperature, uniforms, *, probs_out=None):
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if probs_out is not None:
        probs_out.copy_(probs)
        probs = probs_out
    return inverse_cdf(probs, uniforms), probs
