"""The reference speculative decode loop: draft with the MTP drafter, verify with the target (SPEC §5).

Each round, for every unfinished request: the drafter drafts a chain or a tree from the pending token
(the last emitted token, not yet run through the target) and the target's hidden state at the last
accepted position; the target runs the whole tree in one forward; `tree_verify` keeps the longest
path the target agrees with (greedy) or that its own sampling picks (temperature > 0) and emits one
more token; the target commits the accepted K/V. Greedy output equals the target's own greedy
decoding token for token; sampled output has the target's distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

import gemma4_mtp_kernels as K

from .drafter import QUERY_POSITIONS
from .graphs import DraftGraphs, DraftSampling, TargetGraphs, draft_tree, level_sizes, tree_parents
from .transfer import tensor_to, to_device

SCHEDULES = ("constant", "heuristic")
_FROM_TARGET = object()


@dataclass
class SpeculativeStats:
    """rounds: batched verification forwards. Per request: accepted_per_round (accepted draft tokens
    of each round it took part in), draft_lengths (tree depth verified each round), accepted_paths
    (accepted node indices per round), target_forwards (prefill + rounds), new_tokens."""

    rounds: int = 0
    accepted_per_round: list = field(default_factory=list)
    draft_lengths: list = field(default_factory=list)
    accepted_paths: list = field(default_factory=list)
    target_forwards: list = field(default_factory=list)
    new_tokens: list = field(default_factory=list)
    # round shapes (draft rounds and target forwards) this call gave static buffers, each captured as a
    # CUDA graph on a GPU at its second use: a call that makes none replays every round (steady state)
    new_static_shapes: int = 0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per request-round."""
        flat = [a for per in self.accepted_per_round for a in per]
        return sum(flat) / len(flat) if flat else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per request-round: accepted drafts plus the target's own token."""
        return self.mean_accepted + 1.0 if any(self.accepted_per_round) else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Generated tokens per target forward a request took part in (1.0 without drafting)."""
        forwards = sum(self.target_forwards)
        return sum(self.new_tokens) / forwards if forwards else 0.0


class SpeculativeOutput(NamedTuple):
    ids: list  # per request, the generated token ids (int64, prompt excluded)
    stats: SpeculativeStats


def _prompts(prompt_ids) -> list[torch.Tensor]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            return [prompt_ids.long()]
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] > 0:
            return [row.long() for row in prompt_ids]
        raise ValueError(f"prompt_ids: expected a 1-D or a non-empty 2-D tensor, got shape {tuple(prompt_ids.shape)}")
    if isinstance(prompt_ids, Sequence) and prompt_ids and all(isinstance(x, int) for x in prompt_ids):
        return [torch.tensor(prompt_ids, dtype=torch.long)]
    if isinstance(prompt_ids, Sequence) and prompt_ids:
        return [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompt_ids]
    raise ValueError("prompt_ids: expected token ids (1-D), a batch of them (2-D tensor) or a list of 1-D prompts")


def _eos_set(target, eos_token_id) -> set:
    if eos_token_id is _FROM_TARGET:
        return set(target.config.eos_token_ids)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _check_args(max_new_tokens, num_draft_tokens, tree, temperature, query_position, draft_schedule):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if tree is not None:
        if (not isinstance(tree, Sequence) or not tree
                or not all(isinstance(b, int) and b >= 1 for b in tree)):
            raise ValueError(f"tree: expected per-depth branch counts such as (2, 2, 1), got {tree!r}")
        if num_draft_tokens is not None and num_draft_tokens != len(tree):
            raise ValueError(f"num_draft_tokens: {num_draft_tokens} != the tree depth {len(tree)} (pass None)")
        if draft_schedule != "constant":
            raise ValueError("draft_schedule: 'heuristic' adapts a chain length; trees need 'constant'")
    elif not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens: expected an int >= 0, got {num_draft_tokens!r}")
    elif num_draft_tokens == 0 and draft_schedule != "constant":
        raise ValueError("draft_schedule: target-only decoding (num_draft_tokens=0) needs 'constant'")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if query_position not in QUERY_POSITIONS:
        raise ValueError(f"query_position: expected one of {QUERY_POSITIONS}, got {query_position!r}")
    if draft_schedule not in SCHEDULES:
        raise ValueError(f"draft_schedule: expected one of {SCHEDULES}, got {draft_schedule!r}")


def _draft(drafter, target, reqs, pending, hidden, full, shapes, query_position, sampling=None, graphs=None):
    """Draft a tree per request. full = the round's per-depth branch counts (the longest request's
    chain, or the tree); shapes[b] = request b's, a prefix of full (cut to what its token budget can
    still take).

    The round drafts `full` on the device in one `draft_tree` round (replayed as a CUDA graph when
    `graphs` is given), even where every request's budget cuts it: a round of its own shape near the
    end of each request would be a graph of its own, captured in the middle of decoding (the timed
    main commands of the 2026-12-04 H200 run each captured one or two such shapes: the same decode on
    CPU makes them).
    Each request keeps the prefix of its own shape, whose nodes come first in breadth-first order.
    Children are the drafter's top-k tokens, or with `sampling` (a graphs.DraftSampling, chains only)
    tokens drawn from the drafter's distribution q, whose rows it receives. Returns (tokens [B, N]
    int64 on the device, N the node count of full, row b beginning with request b's nodes; per request
    its parents list[int]). Nothing is read back: the tokens stay on the device for the target's
    forward and the verification."""
    if not full:  # target-only decoding
        return pending.view(-1, 1), [[-1] for _ in reqs]
    # a replayed round takes its context from the host in one copy (graphs.DraftGraphs)
    ctx = drafter.context(target, reqs, query_position, device="cpu" if graphs is not None else None)
    widths = tuple(full)
    hidden = hidden.view(len(reqs), -1)
    if graphs is not None:
        tokens = graphs.draft(ctx, pending, hidden, widths, sampling)
    else:
        tokens = draft_tree(drafter, ctx, pending, hidden, widths, sampling=sampling)
    parents = tree_parents(widths)
    return tokens, [parents[:1 + sum(level_sizes(shape))] for shape in shapes]


class _Sampler:
    """Seeded per-request draws: one torch.Generator per request, so a request draws the same numbers
    in a batch as alone (each round, its draft uniforms first, one per token it drafts, then its
    verification's)."""

    def __init__(self, seed: int, batch: int, device):
        self.device = device
        self.gens = [torch.Generator().manual_seed(seed + b) for b in range(batch)]

    def padded_uniforms(self, bs: list[int], counts: list[int], N: int) -> torch.Tensor:
        """[len(bs), N, 2] fp32 for tree_verify: request bs[i] draws counts[i] nodes' pairs."""
        out = torch.zeros(len(bs), N, 2, dtype=torch.float32)
        for i, (b, n) in enumerate(zip(bs, counts)):
            out[i, :n] = torch.rand(n, 2, generator=self.gens[b])
        return to_device(out, self.device)

    def draft_uniforms(self, bs: list[int], counts: list[int], depth: int) -> torch.Tensor:
        """[len(bs), depth] fp64 for a sampled draft chain: request bs[i] draws counts[i] (its own chain
        length; the rest of its row, drafted past its budget and never verified, reads 0.5)."""
        out = torch.full((len(bs), depth), 0.5, dtype=torch.float64)
        for i, (b, n) in enumerate(zip(bs, counts)):
            out[i, :n] = torch.rand(n, dtype=torch.float64, generator=self.gens[b])
        return to_device(out, self.device)


def _pad(rows: list[list], width: int, fill) -> list[list]:
    return [list(r) + [fill] * (width - len(r)) for r in rows]


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids, *, max_new_tokens: int, num_draft_tokens: int | None,
                         tree: Sequence[int] | None = None, temperature: float = 0.0, seed: int | None = None,
                         query_position: str = "last_cached", draft_schedule: str = "constant",
                         eos_token_id=_FROM_TARGET, sample_drafts: bool | None = None,
                         verify_backend: str | None = None, cuda_graphs: bool | None = None,
                         on_tokens: Callable[[int, list[int]], None] | None = None) -> SpeculativeOutput:
    """Generate up to max_new_tokens tokens per prompt with speculative decoding.

    prompt_ids: a 1-D tensor / list of ids, a 2-D tensor, or a list of 1-D prompts of any lengths.
    num_draft_tokens: chain length (the starting length with draft_schedule="heuristic": +2 after a
        round that accepted every draft, -1 otherwise, at least 1, per request). 0 decodes with the
        target alone (drafter may then be None): the baseline speculative decoding is measured against.
    tree: per-depth branch counts, e.g. (2, 2, 1): the root gets the drafter's top-2 tokens, each of
        them its top-2, each of those its top-1 (8 draft nodes, depth 3). Replaces the chain.
    temperature: 0 for greedy; > 0 samples from softmax(target_logits / temperature), with the
        uniforms drawn from one torch.Generator per request seeded with seed + request index.
    query_position: "last_cached" puts the drafter query at P, the last position in the target cache
        (vLLM, SGLang); "next" at P + 1 with Hugging Face's sliding mask (see Gemma4MTPDrafter.context).
        Output exactness does not depend on it.
    eos_token_id: int, ids, or None; defaults to the target config's eos_token_id. A request stops
        after emitting one.
    sample_drafts: with temperature > 0 and a chain, draw each draft token from the drafter's
        softmax(logits / temperature) on the device (inside the captured round, with uniforms from the
        request's generator) instead of taking its argmax, and verify with those draft probabilities
        (rejection sampling). None (the default): True for a sampling chain, False otherwise; False
        drafts the argmax at any temperature (then a draft is accepted with the target's probability
        of it). Exact either way; acceptance differs (the embedded pair at temperature 0.8, 4 drafts:
        ~2.0 tokens per target forward sampled against ~1.4 argmax).
    verify_backend: backend of tree_verify (default: the drafter's backend).
    cuda_graphs: replay each draft round and each target forward as a CUDA graph (graphs.DraftGraphs
        and graphs.TargetGraphs, one graph per batch bucket and shape, captured at a shape's second use
        and kept on the models). None: the drafter's rounds on a CUDA drafter whose backend is not
        "torch" (the reference attention reads sequence lengths on the host), the target's forwards
        on a CUDA target without an MoE block (its expert dispatch reads the routing on the host).
        The prefill runs eagerly. Same tokens either way. A `target.graph_runner` set by the caller (a TargetGraphs,
        e.g. with capture=False on CPU) serves the target's forwards unless cuda_graphs is False, and
        a `drafter.graph_runner` (a DraftGraphs over this target) the draft rounds.
    on_tokens: called as on_tokens(request_index, tokens) with each request's newly emitted tokens,
        as soon as a round emits them (for streaming).
    """
    _check_args(max_new_tokens, num_draft_tokens, tree, temperature, query_position, draft_schedule)
    if drafter is None and (tree is not None or num_draft_tokens != 0):
        raise ValueError("drafter: None is only allowed for target-only decoding (num_draft_tokens=0)")
    if drafter is not None:
        drafter.check_target(target)
    prompts = _prompts(prompt_ids)
    B = len(prompts)
    V = target.config.vocab_size
    for p in prompts:
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= V):
            raise ValueError(f"prompt_ids: token ids must be in [0, {V}), got {p[(p < 0) | (p >= V)][0].item()}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2**63 <= seed <= 2**64 - B):
        # request b seeds a torch.Generator with seed + b, which takes a 64-bit value
        raise ValueError(f"seed: expected None or an int in [-2**63, 2**64 - {B}], got {seed!r}")
    backend = verify_backend or (drafter.backend if drafter is not None else "auto")
    eos = _eos_set(target, eos_token_id)
    dev = target.device
    sampling = temperature > 0
    temps = torch.full((B,), float(temperature), dtype=torch.float32, device=dev) if sampling else None
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    sampler = _Sampler(seed, B, dev) if sampling else None
    if sample_drafts and (not sampling or tree is not None):
        raise ValueError("sample_drafts: needs temperature > 0 and a chain (tree=None)")
    if sample_drafts is None:
        sample_drafts = sampling and tree is None and drafter is not None
    if tree is not None and max(tree) > drafter.max_branch:
        raise ValueError(f"tree: branch count {max(tree)} exceeds the drafter head's top-k: {drafter.max_branch} "
                         f"candidates (its candidate count, at most {K.DENSE_LM_HEAD_MAX_K})")
    graphs = None
    if drafter is not None:
        graphs = _graphs(drafter, target, cuda_graphs)
    forward, target_graphs = _target_forward(target, cuda_graphs)
    runners = [r for r in (graphs, target_graphs) if r is not None]
    kept_before = sum(len(r.kept) for r in runners)

    stats = SpeculativeStats(accepted_per_round=[[] for _ in prompts], draft_lengths=[[] for _ in prompts],
                             accepted_paths=[[] for _ in prompts], target_forwards=[1] * B, new_tokens=[0] * B)
    out_ids: list[list[int]] = [[] for _ in prompts]
    reqs = [target.new_request() for _ in prompts]
    try:
        pre = target.prefill(reqs, [to_device(p, dev) for p in prompts], last_only=True)
        first = K.tree_verify(to_device(torch.stack([p[-1:] for p in prompts]), dev),
                              torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                              pre.logits, temperature=temps,
                              uniforms=sampler.padded_uniforms(list(range(B)), [1] * B, 1) if sampling else None,
                              backend=backend)
        pending = first.output_tokens[:, 0].clone()
        hidden = pre.hidden[:, 0]
        first_tokens = _read_round(first)[2]
        done = [False] * B
        for b in range(B):
            done[b] = _emit(out_ids[b], [int(first_tokens[b, 0])], eos, max_new_tokens, b, on_tokens)
        chain_len = [num_draft_tokens] * B
        while not all(done):
            act = [b for b in range(B) if not done[b]]
            full, shapes = [], []
            for b in act:
                # like Hugging Face: never verify past what the token budget can still take (the round
                # drafts `full` all the same: one static shape per round, see _draft)
                room = max_new_tokens - len(out_ids[b]) - 1
                shape = list(tree) if tree is not None else [1] * chain_len[b]
                full = max(full, shape, key=len)
                shapes.append(shape[:max(0, room)])
            act_reqs = [reqs[b] for b in act]
            sel = tensor_to(act, torch.long, dev)
            # a round queues all its device work (draft, target forward, verification, the next
            # round's inputs) and reads the device once, at _read_round: every copy to the device
            # before it goes through gemma4_mtp.transfer, so the host never waits for the GPU sooner
            act_temps = None if temps is None else temps[:len(act)]  # every request's temperature is the same
            draft_sampling = None
            if sample_drafts and full:
                draft_sampling = DraftSampling(act_temps,
                                               sampler.draft_uniforms(act, [len(s) for s in shapes], len(full)))
            drafted, parents = _draft(drafter, target, act_reqs, pending[sel], hidden[sel], full, shapes,
                                      query_position, draft_sampling, graphs)
            out = forward(act_reqs, drafted, parents, nodes=drafted.shape[1])
            sizes = [len(p) for p in parents]
            N = out.logits.shape[1]  # the round's node count from a static forward, the requests' longest eagerly
            draft_probs = None if draft_sampling is None else draft_sampling.probs[:, :N]
            # a row's nodes past its own tree are padding (parent -1): verification ignores their tokens
            res = K.tree_verify(
                drafted[:, :N].contiguous(), tensor_to(_pad(parents, N, -1), torch.int32, dev),
                out.logits, temperature=act_temps,
                uniforms=sampler.padded_uniforms(act, sizes, N) if sampling else None,
                draft_probs=draft_probs, backend=backend)
            stats.rounds += 1
            # the next round's inputs stay on the device
            rows = torch.arange(len(act), device=dev)
            pending[sel] = res.output_tokens[rows, res.accept_len.long()]
            hidden[sel] = out.hidden[rows, res.last_node.long()]
            accept_len, nodes, tokens = _read_round(res)
            paths = [nodes[i, :int(accept_len[i])].tolist() for i in range(len(act))]
            target.commit_many([(reqs[b], path) for b, path in zip(act, paths)])
            for i, b in enumerate(act):
                n, path = len(paths[i]), paths[i]
                emitted = tokens[i, :n + 1].tolist()
                stats.accepted_per_round[b].append(n)
                stats.draft_lengths[b].append(len(shapes[i]))
                stats.accepted_paths[b].append(path)
                stats.target_forwards[b] += 1
                done[b] = _emit(out_ids[b], emitted, eos, max_new_tokens, b, on_tokens)
                if draft_schedule == "heuristic":
                    drafted_here = len(shapes[i])
                    chain_len[b] = chain_len[b] + 2 if n == drafted_here else max(1, chain_len[b] - 1)
    finally:
        for r in reqs:
            target.release(r)
    stats.new_tokens = [len(o) for o in out_ids]
    stats.new_static_shapes = sum(len(r.kept) for r in runners) - kept_before
    return SpeculativeOutput([torch.tensor(o, dtype=torch.long) for o in out_ids], stats)


def _read_round(res) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verification's result on the host, (accept_len [B], accepted_nodes [B, N], output_tokens
    [B, N]) as int64, in one device-to-host copy: the one point of a round where the host waits for
    the device (each read drains the stream)."""
    packed = torch.cat([res.accept_len[:, None].long(), res.accepted_nodes.long(), res.output_tokens.long()], 1)
    packed = packed.cpu()
    N = res.output_tokens.shape[1]
    return packed[:, 0], packed[:, 1:1 + N], packed[:, 1 + N:]


def _graphs(drafter, target, cuda_graphs: bool | None) -> DraftGraphs | None:
    """The drafter's captured rounds over `target` (kept on the drafter across calls), its graph
    runner when the caller set one, or None."""
    runner = getattr(drafter, "graph_runner", None)
    if runner is not None and cuda_graphs is not False:
        return runner
    on_cuda = drafter.pre_projection.weight.device.type == "cuda"
    if cuda_graphs is None:
        cuda_graphs = on_cuda and drafter.backend != "torch"
    if not cuda_graphs:
        return None
    if not on_cuda:
        raise ValueError("cuda_graphs: True needs a drafter on a CUDA device")
    cache = drafter.__dict__.setdefault("_draft_graphs", {})
    key = (id(target), target.num_blocks)
    if key not in cache:
        # a request's block table never holds more entries than the cache has blocks
        cache[key] = DraftGraphs(drafter, table_width=target.num_blocks)
    return cache[key]


def _target_forward(target, cuda_graphs: bool | None):
    """(forward, runner): the target's tree forward for the rounds, forward(reqs, tokens, parents,
    nodes=N), from its graph runner (N nodes per request, padded) or eager (as many as the longest
    request has, runner None)."""
    def eager(reqs, tokens, parents, nodes=None):
        return target.forward_tree(reqs, tokens, parents)

    if cuda_graphs is False:
        return eager, None
    runner = getattr(target, "graph_runner", None)
    if runner is None:
        on_cuda = target.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs: True needs a target on a CUDA device")
        if not on_cuda or target.config.enable_moe_block:
            return eager, None
        runner = target.graph_runner = TargetGraphs(target)
    return runner.forward, runner


def _emit(out: list[int], tokens: list[int], eos: set, max_new_tokens: int, b: int, on_tokens) -> bool:
    """Append tokens up to the budget and the first EOS; True when the request is finished."""
    start, finished = len(out), False
    for t in tokens:
        out.append(t)
        if t in eos or len(out) >= max_new_tokens:
            finished = True
            break
    if on_tokens is not None:
        on_tokens(b, out[start:])
    return finished
