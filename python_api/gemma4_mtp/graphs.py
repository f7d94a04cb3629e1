"""A draft round as one CUDA graph (SPEC §5): the k drafter steps of a chain or tree and its
bookkeeping, captured per batch-size bucket and tree shape with static buffers, as vLLM captures its
drafter.

`draft_tree` is the round itself: device work only (no host reads, shapes fixed by the batch size and
the tree shape), so the same code runs eagerly (CPU, or a drafter whose backend cannot be captured)
and under capture. `DraftGraphs` owns the static inputs of each captured round (pending tokens,
hidden states, sequence lengths, query positions, block tables widened to the target's block count)
and copies a round's inputs into them before replaying; rows past the batch in a bucket attend
nothing (sequence length 0) and their drafts are dropped.
"""
from __future__ import annotations

import torch

from .drafter import DraftContext, Gemma4MTPDrafter

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def level_sizes(widths) -> list[int]:
    """Nodes per depth of a tree with these per-depth branch counts ((2, 2, 1) -> [2, 4, 4])."""
    sizes, n = [], 1
    for w in widths:
        n *= w
        sizes.append(n)
    return sizes


def tree_parents(widths) -> list[int]:
    """Parent of each node in breadth-first order, node 0 (the pending token) first with parent -1:
    the children of a level's nodes follow in node order, each node's `w` children together."""
    parents, level = [-1], [0]
    for w in widths:
        nxt = []
        for p in level:
            for _ in range(w):
                nxt.append(len(parents))
                parents.append(p)
        level = nxt
    return parents


def draft_tree(drafter: Gemma4MTPDrafter, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor,
               widths, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draft a tree per request: the drafter's top-`widths[d]` tokens of every node of depth d.

    pending [B] int64 (node 0), hidden [B, Hb] (the target's hidden state at the last accepted
    position). Returns tokens [B, N] int64 in the order of `tree_parents(widths)`. The Q nodes of a
    level share one drafter step (one attention call per request)."""
    B = pending.shape[0]
    N = 1 + sum(level_sizes(widths))
    tokens = torch.empty(B, N, dtype=torch.long, device=pending.device) if out is None else out
    tokens[:, 0] = pending
    level_tok, level_hid = pending.view(B, 1), hidden.view(B, 1, -1)
    at = 1
    for w in widths:
        last, proj = drafter.step(ctx, level_tok, level_hid)
        Q = level_tok.shape[1]
        level_tok = drafter.top_tokens(last, w).view(B, Q * w)
        tokens[:, at:at + Q * w] = level_tok
        level_hid = proj[:, :, None, :].expand(B, Q, w, proj.shape[-1]).reshape(B, Q * w, -1)
        at += Q * w
    return tokens


class _Round:
    """The static buffers and the graph of one (bucket, tree shape)."""

    def __init__(self, runner: "DraftGraphs", ctx: DraftContext, bucket: int, widths: tuple):
        dev, Hb = runner.device, runner.drafter.config.backbone_hidden_size
        self.pending = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(bucket, Hb, dtype=runner.dtype, device=dev)
        self.seq_lens = torch.zeros(bucket, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.tables = {t: torch.full((bucket, runner.table_width), -1, dtype=torch.int32, device=dev)
                       for t in ctx.block_table}
        self.ctx = DraftContext(ctx.k_cache, ctx.v_cache, self.tables, ctx.window, self.seq_lens, self.positions,
                                ctx.embed_table, ctx.embed_scale)
        self.out = torch.zeros(bucket, 1 + sum(level_sizes(widths)), dtype=torch.long, device=dev)
        self.widths, self.graph = widths, None

    def load(self, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor) -> None:
        """This round's inputs into the static buffers; rows past the batch attend nothing."""
        B = pending.shape[0]
        self.pending[:B].copy_(pending)
        self.hidden[:B].copy_(hidden)
        self.seq_lens[:B].copy_(ctx.seq_lens)
        self.positions[:B].copy_(ctx.positions)
        for t, table in ctx.block_table.items():
            self.tables[t][:B, :table.shape[1]].copy_(table)
            self.tables[t][:B, table.shape[1]:].fill_(-1)
        if B < self.pending.shape[0]:
            self.seq_lens[B:].zero_()

    def run(self, drafter):
        return draft_tree(drafter, self.ctx, self.pending, self.hidden, self.widths, out=self.out)


class DraftGraphs:
    """Draft rounds of `drafter` over one target's caches, from static buffers per (bucket, tree shape):
    captured as CUDA graphs and replayed (capture=True, the default on CUDA), or run eagerly from the
    same buffers (capture=False: what the CPU tests check, the graph's exact inputs and outputs)."""

    def __init__(self, drafter: Gemma4MTPDrafter, *, table_width: int, buckets=BUCKETS, capture: bool | None = None,
                 max_rounds: int = 32, keep_after: int = 2):
        self.drafter, self.table_width, self.buckets = drafter, table_width, tuple(buckets)
        self.max_rounds = max_rounds  # distinct (bucket, shape, ...) rounds kept; beyond, rounds run eagerly
        # a round is kept (captured) from its keep_after-th use: the shapes cut short by the token
        # budget at the end of a request come once and would cost a capture each (~3 eager rounds)
        self.keep_after = keep_after
        self.uses: dict[tuple, int] = {}
        self.device = drafter.pre_projection.weight.device
        self.dtype = drafter.pre_projection.weight.dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"DraftGraphs: capture needs a drafter on a CUDA device, got {self.device}")
        self.rounds: dict[tuple, _Round] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0

    def bucket(self, B: int) -> int | None:
        return next((b for b in self.buckets if b >= B), None)

    def draft(self, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor, widths) -> torch.Tensor:
        """`draft_tree` for this round by replaying the captured graph of its bucket and shape (captured
        at its `keep_after`-th use); a batch beyond the largest bucket, a block table wider than the
        static one, a round's first uses or a new round once `max_rounds` are kept (a growing heuristic
        chain) run eagerly."""
        widths = tuple(widths)
        B = pending.shape[0]
        bucket = self.bucket(B)
        if bucket is None or any(t.shape[1] > self.table_width for t in ctx.block_table.values()):
            return draft_tree(self.drafter, ctx, pending, hidden, widths)
        # a round reads the target's caches and embedding table where they were at capture, and bakes in
        # the sliding windows (query-position convention) and the embedding scale
        where = tuple((t, ctx.k_cache[t].data_ptr(), ctx.v_cache[t].data_ptr(), ctx.window[t])
                      for t in sorted(ctx.k_cache))
        key = (bucket, widths, where, ctx.embed_table.data_ptr(), ctx.embed_scale)
        rnd = self.rounds.get(key)
        self.uses[key] = self.uses.get(key, 0) + 1
        if rnd is None and (len(self.rounds) >= self.max_rounds or self.uses[key] < self.keep_after):
            return draft_tree(self.drafter, ctx, pending, hidden, widths)
        if rnd is None:
            rnd = _Round(self, ctx, bucket, widths)
            if self.capture:
                self._capture(rnd)
            self.rounds[key] = rnd
        rnd.load(ctx, pending, hidden)
        if rnd.graph is not None:
            rnd.graph.replay()
        else:
            rnd.run(self.drafter)
        return rnd.out[:B]

    def _capture(self, rnd: _Round) -> None:
        # warm up on a side stream (Triton's first launches compile; the allocator sees the sizes)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                rnd.run(self.drafter)
        torch.cuda.current_stream(self.device).wait_stream(side)
        rnd.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(rnd.graph, pool=self.pool):
            rnd.run(self.drafter)
        self.captures += 1
