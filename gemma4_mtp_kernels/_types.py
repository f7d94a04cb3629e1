"""Result types shared by every backend."""
from typing import NamedTuple

import torch


class VerifyResult(NamedTuple):
    """Outcome of `tree_verify` for a batch of draft trees (SPEC §4.4).

    accept_len      [B] int32   accepted draft tokens per request
    accepted_nodes  [B, N] int32 node indices of the accepted path (root excluded), then -1
    output_tokens   [B, N] int64 accepted tokens followed by the bonus token, then -1
    last_node       [B] int32   deepest accepted node (0 when nothing was accepted)
    """

    accept_len: torch.Tensor
    accepted_nodes: torch.Tensor
    output_tokens: torch.Tensor
    last_node: torch.Tensor
