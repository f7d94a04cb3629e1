"""A draft round and a target forward as one CUDA graph each (SPEC §5): the k drafter steps of a
chain or tree and its bookkeeping, captured per batch-size bucket and tree shape with static buffers,
as vLLM captures its drafter; the target's tree forward likewise (`TargetGraphs`), so that a
speculative round and target-only decoding are compared graph against graph.

`draft_tree` is the round itself: device work only (no host reads, shapes fixed by the batch size and
the tree shape), so the same code runs eagerly (CPU, or a drafter whose backend cannot be captured)
and under capture. `DraftGraphs` owns the static inputs of each captured round (pending tokens,
hidden states, sequence lengths, query positions, block tables widened to the target's block count)
and copies a round's inputs into them before replaying; rows past the batch in a bucket attend
nothing (sequence length 0) and their drafts are dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .drafter import DraftContext, Gemma4MTPDrafter
from .target import Gemma4Target, TargetOutput
from .transfer import copy_from_host, tensor_to, to_device

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


@dataclass
class DraftSampling:
    """Draft chains drawn from the drafter's distribution q = softmax(logits / temperature) instead of
    its argmax, all on the device (inside a captured round): temperature [B] fp32 (> 0), uniforms
    [B, depth] fp64 in [0, 1) (depth d's token is the inverse CDF of q at uniforms[:, d]). probs
    [B, N, V] fp32 receives q of each drafted depth (row d: the distribution node d + 1 was drawn
    from, what `tree_verify`'s draft_probs takes; the leaf row N - 1 is left as it was): given, it is
    written; None, the round sets it (zeros and the rows, or a view of a replayed round's static buffer,
    valid until that round's next replay)."""

    temperature: torch.Tensor
    uniforms: torch.Tensor
    probs: torch.Tensor | None = None


@torch.no_grad()
def draft_tree(drafter: Gemma4MTPDrafter, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor,
               widths, out: torch.Tensor | None = None, sampling: DraftSampling | None = None) -> torch.Tensor:
    """Draft a tree per request: the drafter's top-`widths[d]` tokens of every node of depth d (with
    `sampling`, a chain: widths all 1, each token drawn from q instead).

    pending [B] int64 (node 0), hidden [B, Hb] (the target's hidden state at the last accepted
    position). Returns tokens [B, N] int64 in the order of `tree_parents(widths)`. The Q nodes of a
    level share one drafter step (one attention call per request)."""
    B = pending.shape[0]
    N = 1 + sum(level_sizes(widths))
    if sampling is not None and any(w != 1 for w in widths):
        raise ValueError(f"sampling: drafts are drawn for chains only (widths all 1), got widths {tuple(widths)}")
    tokens = torch.empty(B, N, dtype=torch.long, device=pending.device) if out is None else out
    if sampling is not None and sampling.probs is None:
        V = drafter.config.text.vocab_size
        sampling.probs = torch.zeros(B, N, V, dtype=torch.float32, device=pending.device)
    tokens[:, 0] = pending
    level_tok, level_hid = pending.view(B, 1), hidden.view(B, 1, -1)
    at = 1
    for d, w in enumerate(widths):
        Q = level_tok.shape[1]
        if sampling is None:  # the step and its head (one call into C++ where the step is one)
            last, proj, level_tok = drafter.step_top_tokens(ctx, level_tok, level_hid, w)
            level_tok = level_tok.view(B, Q * w)
        else:  # the step, its head's logits and softmax_sample (one call where the step is one)
            last, proj, level_tok, _ = drafter.step_sample_tokens(ctx, level_tok, level_hid, sampling.temperature,
                                                                  sampling.uniforms[:, d], sampling.probs[:, d])
            level_tok = level_tok.view(B, 1)
        tokens[:, at:at + Q * w] = level_tok
        level_hid = proj[:, :, None, :].expand(B, Q, w, proj.shape[-1]).reshape(B, Q * w, -1)
        at += Q * w
    return tokens


class _Replays:
    """Graphs kept per static shape key, with the capture policy DraftGraphs and TargetGraphs share:
    a shape is kept (captured, or run from its static buffers with capture=False) from its
    keep_after-th use, at most max_kept of them; other calls run eagerly."""

    def __init__(self, device: torch.device, *, buckets, capture: bool | None, max_kept: int, keep_after: int,
                 owner: str):
        self.device, self.buckets = device, tuple(buckets)
        # a shape seen once (the decode loop no longer makes one at the end of a request, see
        # speculative._draft) would cost a capture (~3 eager calls) for nothing; a growing heuristic
        # chain makes new shapes without end
        self.max_kept, self.keep_after = max_kept, keep_after
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"{owner}: capture needs a model on a CUDA device, got {device}")
        self.uses: dict[tuple, int] = {}
        self.kept: dict[tuple, object] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0

    def bucket(self, B: int) -> int | None:
        return next((b for b in self.buckets if b >= B), None)

    def entry(self, key: tuple, make):
        """The kept entry of key (made and captured now if its time has come), or None: run eagerly."""
        self.uses[key] = self.uses.get(key, 0) + 1
        e = self.kept.get(key)
        if e is None and len(self.kept) < self.max_kept and self.uses[key] >= self.keep_after:
            e = self.kept[key] = make()
            if self.capture:
                self._capture(e)
        return e

    @staticmethod
    def replay(e) -> None:
        if e.graph is not None:
            e.graph.replay()
        else:
            e.run()

    def _capture(self, e) -> None:
        # warm up on a side stream (Triton's first launches compile; the allocator sees the sizes)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                e.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        e.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(e.graph, pool=self.pool):
            e.run()
        self.captures += 1


class _Packed:
    """Static device buffers that a round fills from the host, as views of one device buffer (name ->
    view in `views`), so that they go over in one copy: a copy from the host costs a staging in pinned
    memory and a launch, and a round made a dozen of them. Layout: (name, shape, dtype), each view at an
    8-byte aligned offset; every view starts zero, or at its value in `fills` (a block table: -1)."""

    def __init__(self, layout, device, fills: dict | None = None):
        self.layout, self.fills = list(layout), fills or {}
        size = sum(-(-math.prod(shape) * dtype.itemsize // 8) * 8 for _, shape, dtype in self.layout)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.views = self._views(self.buffer)

    def _views(self, buffer: torch.Tensor) -> dict:
        views, at = {}, 0
        for name, shape, dtype in self.layout:
            nbytes = math.prod(shape) * dtype.itemsize
            views[name] = buffer[at:at + nbytes].view(dtype).view(shape)
            at += -(-nbytes // 8) * 8
        for name, value in self.fills.items():
            views[name].fill_(value)
        return views

    def host(self) -> tuple[torch.Tensor, dict]:
        """A host twin of the buffer at its initial values and its views, to fill."""
        buffer = torch.zeros_like(self.buffer, device="cpu")
        return buffer, self._views(buffer)

    def send(self, host: torch.Tensor) -> None:
        """The host twin into the device buffer, without the host waiting (gemma4_mtp.transfer)."""
        copy_from_host(self.buffer, host)


class _Round:
    """The static buffers and the graph of one (bucket, tree shape, sampled or not)."""

    def __init__(self, runner: "DraftGraphs", ctx: DraftContext, bucket: int, widths: tuple, sampled: bool):
        dev, Hb = runner.device, runner.drafter.config.backbone_hidden_size
        self.drafter = runner.drafter
        self.pending = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(bucket, Hb, dtype=runner.dtype, device=dev)
        # what a round fills from a context built on the host (drafter.context(..., device="cpu")): one copy
        W = runner.table_width
        self.packed = _Packed([("positions", (bucket,), torch.long), ("seq_lens", (bucket,), torch.int32),
                               *((("table", t), (bucket, W), torch.int32) for t in ctx.block_table)], dev,
                              fills={("table", t): -1 for t in ctx.block_table})
        self.seq_lens, self.positions = self.packed.views["seq_lens"], self.packed.views["positions"]
        self.tables = {t: self.packed.views["table", t] for t in ctx.block_table}
        self.ctx = DraftContext(ctx.k_cache, ctx.v_cache, self.tables, ctx.window, self.seq_lens, self.positions,
                                ctx.embed_table, ctx.embed_scale)
        N = 1 + sum(level_sizes(widths))
        self.out = torch.zeros(bucket, N, dtype=torch.long, device=dev)
        self.sampling = None
        if sampled:  # rows past the batch draw from a valid distribution at a valid uniform
            V = runner.drafter.config.text.vocab_size
            self.sampling = DraftSampling(torch.ones(bucket, dtype=torch.float32, device=dev),
                                          torch.full((bucket, len(widths)), 0.5, dtype=torch.float64, device=dev),
                                          torch.zeros(bucket, N, V, dtype=torch.float32, device=dev))
        self.widths, self.graph = widths, None

    def load(self, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor,
             sampling: DraftSampling | None) -> None:
        """This round's inputs into the static buffers; rows past the batch attend nothing. A context
        built on the host goes over in one copy, a device one buffer by buffer."""
        B = pending.shape[0]
        self.pending[:B].copy_(pending)
        self.hidden[:B].copy_(hidden)
        if ctx.seq_lens.device.type == "cpu":
            packed, host = self.packed.host()  # zero lengths and no blocks past the batch
            host["seq_lens"][:B], host["positions"][:B] = ctx.seq_lens, ctx.positions
            for t, table in ctx.block_table.items():
                host["table", t][:B, :table.shape[1]] = table
            self.packed.send(packed)
        else:
            self.seq_lens[:B].copy_(ctx.seq_lens)
            self.positions[:B].copy_(ctx.positions)
            for t, table in ctx.block_table.items():
                self.tables[t][:B, :table.shape[1]].copy_(table)
                self.tables[t][:B, table.shape[1]:].fill_(-1)
            if B < self.pending.shape[0]:
                self.seq_lens[B:].zero_()
        if sampling is not None:
            self.sampling.temperature[:B].copy_(sampling.temperature)
            self.sampling.uniforms[:B].copy_(sampling.uniforms)

    def run(self):
        with self.drafter.graphed_steps():
            return draft_tree(self.drafter, self.ctx, self.pending, self.hidden, self.widths, out=self.out,
                              sampling=self.sampling)


class DraftGraphs(_Replays):
    """Draft rounds of `drafter` over one target's caches, from static buffers per (bucket, tree shape):
    captured as CUDA graphs and replayed (capture=True, the default on CUDA), or run eagerly from the
    same buffers (capture=False: what the CPU tests check, the graph's exact inputs and outputs)."""

    def __init__(self, drafter: Gemma4MTPDrafter, *, table_width: int, buckets=BUCKETS, capture: bool | None = None,
                 max_rounds: int = 32, keep_after: int = 2):
        super().__init__(drafter.pre_projection.weight.device, buckets=buckets, capture=capture, max_kept=max_rounds,
                         keep_after=keep_after, owner="DraftGraphs")
        self.drafter, self.table_width = drafter, table_width
        self.dtype = drafter.pre_projection.weight.dtype

    @property
    def rounds(self) -> dict:
        return self.kept

    def draft(self, ctx: DraftContext, pending: torch.Tensor, hidden: torch.Tensor, widths,
              sampling: DraftSampling | None = None) -> torch.Tensor:
        """`draft_tree` for this round (ctx's per-request tensors on the device, or on the host:
        `drafter.context(..., device="cpu")`, which goes into the static buffers in one copy) by
        replaying the captured graph of its bucket and shape (captured
        at its `keep_after`-th use; with `sampling`, the round's q rows are copied into sampling.probs,
        or handed out as sampling.probs when it is None); a batch beyond the largest bucket, a block
        table wider than the static one, a round's first uses or a new round once `max_rounds` are kept
        (a growing heuristic chain) run eagerly."""
        widths = tuple(widths)
        B = pending.shape[0]
        bucket = self.bucket(B)
        if bucket is None or any(t.shape[1] > self.table_width for t in ctx.block_table.values()):
            return draft_tree(self.drafter, _on_device(ctx, self.device), pending, hidden, widths, sampling=sampling)
        # a round reads the target's caches and embedding table where they were at capture, and bakes in
        # the sliding windows (query-position convention) and the embedding scale
        where = tuple((t, ctx.k_cache[t].data_ptr(), ctx.v_cache[t].data_ptr(), ctx.window[t])
                      for t in sorted(ctx.k_cache))
        sampled = sampling is not None
        key = (bucket, widths, sampled, where, ctx.embed_table.data_ptr(), ctx.embed_scale)
        rnd = self.entry(key, lambda: _Round(self, ctx, bucket, widths, sampled))
        if rnd is None:
            return draft_tree(self.drafter, _on_device(ctx, self.device), pending, hidden, widths, sampling=sampling)
        rnd.load(ctx, pending, hidden, sampling)
        self.replay(rnd)
        if sampled:
            if sampling.probs is None:
                sampling.probs = rnd.sampling.probs[:B]
            else:
                sampling.probs.copy_(rnd.sampling.probs[:B])
        return rnd.out[:B]


def _on_device(ctx: DraftContext, device: torch.device) -> DraftContext:
    """ctx with its per-request tensors (block tables, lengths, positions) on `device` (a context the
    host built for a round that runs eagerly after all)."""
    if ctx.seq_lens.device == device:
        return ctx
    return DraftContext(ctx.k_cache, ctx.v_cache, {t: to_device(bt, device) for t, bt in ctx.block_table.items()},
                        ctx.window, to_device(ctx.seq_lens, device), to_device(ctx.positions, device),
                        ctx.embed_table, ctx.embed_scale)


class _Forward:
    """The static buffers and the graph of one target forward shape (bucket, nodes, table width). The
    buffers a round fills from the host (depths, ancestor masks, node counts, lengths, block tables) are
    one `_Packed` buffer: a round's host inputs go over in one copy."""

    def __init__(self, target: Gemma4Target, bucket: int, N: int, W: int):
        dev = target.device
        self.target = target
        self.ids = torch.zeros(bucket, N, dtype=torch.long, device=dev)
        self.packed = _Packed([("depth", (bucket, N), torch.long), ("counts", (bucket,), torch.long),
                               ("lengths", (bucket,), torch.long),
                               *((("table", t), (bucket, W), torch.int32) for t in target.caches),
                               ("anc", (bucket, N, N), torch.bool)], dev,
                              fills={("table", t): -1 for t in target.caches})
        views = self.packed.views
        self.depth, self.counts, self.lengths, self.anc = (views[n] for n in ("depth", "counts", "lengths", "anc"))
        self.tables = {t: views["table", t] for t in target.caches}
        self.out, self.graph = None, None

    def load(self, reqs, ids, trees, counts) -> None:
        """These requests' inputs (`Gemma4Target.prepare_trees`' ids, trees and counts): the ids go
        into the padded ids buffer on the device (a draft round's tokens are never read back); the
        rest is padded on the host in the packed buffer's host twin and copied over in one copy that
        the host does not wait for (gemma4_mtp.transfer). Padding slots keep earlier ids: valid
        tokens whose nodes count 0."""
        target = self.target
        dev, N = self.ids.device, self.ids.shape[1]
        packed, host = self.packed.host()
        slots = []
        for b, (r, (depth, anc)) in enumerate(zip(reqs, trees)):
            n = counts[b]
            host["depth"][b, :n], host["anc"][b, :n, :n] = depth, anc
            host["counts"][b], host["lengths"][b] = n, target.lengths[r]
            slots.extend(range(b * N, b * N + n))
            for t, c in target.caches.items():
                host["table", t][b, :len(c.tables[r])] = torch.tensor(c.tables[r], dtype=torch.int32)
        self.ids.view(-1)[tensor_to(slots, torch.long, dev)] = to_device(ids, dev)
        self.packed.send(packed)

    def run(self):
        self.out = self.target.forward_static(self.ids, self.depth, self.anc, self.counts, self.lengths, self.tables)


class TargetGraphs(_Replays):
    """The target's tree forwards (`Gemma4Target.forward_tree`, without last_only) from static buffers
    per (batch bucket, node count, block-table width rounded up to a power of two): captured as CUDA
    graphs and replayed (capture=True, the default on CUDA), or run eagerly from the same buffers
    (capture=False). The outputs are views of the static buffers, valid until the next forward of
    the same shape. MoE targets are refused: their expert dispatch reads the routing on the host."""

    def __init__(self, target: Gemma4Target, *, buckets=BUCKETS, capture: bool | None = None,
                 max_shapes: int = 32, keep_after: int = 2):
        if target.config.enable_moe_block:
            raise ValueError("TargetGraphs: a target with enable_moe_block cannot be captured (the expert "
                             "dispatch reads the routing on the host)")
        super().__init__(target.device, buckets=buckets, capture=capture, max_kept=max_shapes,
                         keep_after=keep_after, owner="TargetGraphs")
        self.target = target

    def forward(self, reqs: list[int], tokens, parents: list[list[int]], nodes: int | None = None) -> TargetOutput:
        """`Gemma4Target.forward_tree(reqs, tokens, parents)` (tokens in either of its forms) from the
        static buffers of its shape, replayed; a shape's first uses and a batch beyond the largest
        bucket run forward_tree itself. nodes: the node count of the static shape (default, and at
        least, the longest request's): the decode loop passes its round's, so that a round cut short
        by the token budget replays the full round's graph (its outputs are then nodes wide, zeros past
        each request's nodes)."""
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
            raise ValueError(f"nodes: expected None or an int >= 1, got {nodes!r}")
        target = self.target
        bucket = self.bucket(len(reqs))
        if bucket is None:
            return target.forward_tree(reqs, tokens, parents)
        ids, trees, counts = target.prepare_trees(reqs, tokens, parents)  # checks, reserves the blocks
        N = max(counts + [nodes or 0])
        need = max(len(c.tables[r]) for c in target.caches.values() for r in reqs)
        W = 1 << max(2, (need - 1).bit_length())
        fwd = self.entry((bucket, N, W), lambda: _Forward(target, bucket, N, W))
        if fwd is None:
            return target.forward_tree(reqs, tokens, parents)
        fwd.load(reqs, ids, trees, counts)
        self.replay(fwd)
        B = len(reqs)
        return TargetOutput(fwd.out.logits[:B], fwd.out.hidden[:B])

