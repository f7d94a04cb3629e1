"""The Gemma 4 MTP drafter (Gemma4AssistantForCausalLM weights), run through the gemma4_mtp_kernels ops.

It has no K/V of its own: each layer computes Q only and attends the target's cache with
`q_only_paged_attention` (sliding layers read the target's last non-KV-shared sliding layer, the full
layer its last non-KV-shared full layer: `Gemma4Target.kv_cache`). Its input is
`fused_concat_down_proj(E_target[token] * sqrt(Hb), h)`, h being the target's final hidden state on
the first step and the drafter's `post_projection` output after.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

import gemma4_mtp_kernels as K
from gemma4_mtp_kernels._checks import values_checkable
from gemma4_mtp_kernels._dispatch import step_in_one_call
from gemma4_mtp_kernels.ops.centroid_logits import shape_params as centroid_shape
from gemma4_mtp_kernels.ops.dense_lm_head import shape_params as dense_head_shape
from gemma4_mtp_kernels.ops.rms_norm_gate_up import shape_params as gate_up_shape
from gemma4_mtp_kernels.ops.rms_norm_linear import shape_params as linear_shape
from gemma4_mtp_kernels.ops.rms_norm_q_rope import check_positions
from gemma4_mtp_kernels.ops.rms_norm_q_rope import shape_params as q_rope_shape

from .config import FULL, SLIDING, AttentionSpec, DrafterConfig, TextConfig
from .layers import DecoderLayer, RMSNorm, rope_inv_freq, to_dtype
from .transfer import tensor_to

QUERY_POSITIONS = ("last_cached", "next")
# the fused glue ops of a step, in the order step unpacks them (checked once per weights, see step), and
# the shape parameters each passes to resolve (from its positional arguments)
_GLUE_OPS = ("rms_norm_q_rope", "rms_norm_linear", "rms_norm_gate_up")
# every op a draft step runs, one by one or in one call, the LM head's included (step_top_tokens makes the
# head's launches in the step's call, and the step benchmark's rows time it; step_sample_tokens softmax_sample's
# too): benchmarks.make_verified counts a backend's whole-step evidence only where each of them passed the GPU
# suite with it. Both heads, whichever the drafter has: the verdicts are per op, not per drafter.
STEP_OPS = ("fused_concat_down_proj", *_GLUE_OPS, "q_only_paged_attention", "centroid_logits", "dense_lm_head",
            "softmax_sample")
# each from a glue call's arguments (its keywords too: rms_norm_gate_up's down_weight is a shape parameter)
_GLUE_SHAPES = {"rms_norm_q_rope": lambda x, w, q_norm, *_, **__: q_rope_shape(x, w, q_norm),
                "rms_norm_linear": lambda x, w, *_, **__: linear_shape(x, w),
                "rms_norm_gate_up": lambda x, w, _up, down_weight=None, **_: gate_up_shape(x, w, down_weight)}


class _Unchecked:
    """A glue op without its checks (`gemma4_mtp_kernels.implementation`), resolved once per call shape,
    so that backend="auto" follows verified.py's evidence per shape as the public op does."""

    def __init__(self, op: str, backend: str, device: torch.device, dtype: torch.dtype):
        self.op, self.backend, self.device, self.dtype = op, backend, device, dtype
        self.shape = _GLUE_SHAPES[op]
        self.impls: dict[tuple, object] = {}

    def __call__(self, x, weight, *args, **kwargs):
        # the shapes of the positional tensors and of a down_weight determine the shape parameters (built only
        # on a miss)
        down = kwargs.get("down_weight")
        key = (x.shape, weight.shape, args[0].shape if args else None, None if down is None else down.shape)
        impl = self.impls.get(key)
        if impl is None:
            impl = self.impls[key] = K.implementation(self.op, self.backend, self.device, self.dtype,
                                                      self.shape(x, weight, *args, **kwargs))
        return impl(x, weight, *args, **kwargs)


def real_shape_config(name: str | dict, *, num_layers: int = 4) -> DrafterConfig:
    """The config of a real Gemma 4 drafter (gemma4_mtp_kernels.drafter_shapes: "E2B", "E4B", "26B-A4B",
    "31B", or a dict of the same keys) with Hugging Face's default RoPE and the 3 sliding + 1 full
    layer pattern, for benchmarks and launch counts at real shapes with random (or meta) weights."""
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    d = DRAFTERS[name] if isinstance(name, str) else name
    types = tuple(SLIDING if (i + 1) % num_layers else FULL for i in range(num_layers))
    attention = {SLIDING: AttentionSpec(d["D_swa"], d["Hkv_swa"], "default", 10_000.0, 1.0, 1.0, d["window"]),
                 FULL: AttentionSpec(d["D_full"], d["Hkv_full"], "proportional", 1_000_000.0, 0.25, 1.0, None)}
    text = TextConfig(vocab_size=d["vocab"], hidden_size=d["Hd"], intermediate_size=d["inter"], num_layers=num_layers,
                      num_heads=d["Hq"], layer_types=types, attention=attention, rms_norm_eps=1e-6,
                      attention_k_eq_v=False, final_logit_softcapping=None, tie_word_embeddings=True,
                      eos_token_ids=(1,), pad_token_id=0)
    ordered = d["centroids"] is not None
    return DrafterConfig(text, d["Hb"], ordered, d["centroids"] or 2048, d["top_k"] or 32)


class DrafterAttention(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        D = config.spec(layer).head_dim
        self.head_dim, self.num_heads = D, config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * D, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.o_proj = nn.Linear(config.num_heads * D, config.hidden_size, bias=False)


@dataclass
class DraftContext:
    """What a draft round reads from the target, per request (rows of B).

    k_cache / v_cache / block_table / window: per attention type; seq_lens [B] int32 cache entries;
    positions [B] int64 RoPE position of every draft query of the round; embed_table [V, Hb] the
    target's input embedding with its scale sqrt(Hb)."""

    k_cache: dict
    v_cache: dict
    block_table: dict
    window: dict
    seq_lens: torch.Tensor
    positions: torch.Tensor
    embed_table: torch.Tensor
    embed_scale: float

    def select(self, rows: list[int]) -> "DraftContext":
        idx = tensor_to(rows, torch.long, self.seq_lens.device)
        return DraftContext(self.k_cache, self.v_cache, {t: bt[idx] for t, bt in self.block_table.items()},
                            self.window, self.seq_lens[idx], self.positions[idx], self.embed_table,
                            self.embed_scale)


class _LayerWeights(NamedTuple):
    """The tensors a drafter step reads from one decoder layer, in the order the step uses them."""
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    q_norm: torch.Tensor
    inv_freq: torch.Tensor
    o_proj: torch.Tensor
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    post_ff_norm: torch.Tensor
    scalar: torch.Tensor


def _weight(module: nn.Module) -> torch.Tensor:
    w = module._parameters.get("weight")
    return module.weight if w is None else w  # a parametrized weight is not in _parameters


class Gemma4MTPDrafter(nn.Module):
    """Draft steps over a borrowed target cache. `backend` goes to every gemma4_mtp_kernels op, the
    fused glue and the dense LM head included (backend="cuda": no Triton launch in a step)."""

    # backend="cuda" (and "auto" where the evidence says so): a step is one call into C++ (see step); False
    # makes it the ops one by one (the benchmarks' per-op baseline, `cuda_eager_ops`)
    one_call_step = True
    # inside graphed_steps(): the steps of a draft round that DraftGraphs captures (or runs from its static
    # buffers), for which backend="auto" follows the graph-replayed steps' evidence
    _graphed = False

    def __init__(self, config: DrafterConfig, *, backend: str = "auto"):
        super().__init__()
        t = config.text
        self.config, self.backend = config, backend
        Hb, Hd, V = config.backbone_hidden_size, t.hidden_size, t.vocab_size
        self.pre_projection = nn.Linear(2 * Hb, Hd, bias=False)
        self.post_projection = nn.Linear(Hd, Hb, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(t, DrafterAttention(t, i)) for i in range(t.num_layers))
        self.norm = RMSNorm(Hd, t.rms_norm_eps)
        self.embed_tokens = nn.Embedding(V, Hd)  # the LM head when tied; inputs come from the target's table
        self.lm_head = None if t.tie_word_embeddings else nn.Linear(Hd, V, bias=False)
        if config.use_ordered_embeddings:
            self.centroids = nn.Linear(Hd, config.num_centroids, bias=False)
            self.register_buffer("token_ordering", torch.arange(V))
        for lt, spec in t.attention.items():
            self.register_buffer(f"{lt}_inv_freq", rope_inv_freq(spec), persistent=False)
        # what the last step with checked glue calls ran on (see step), and the unchecked glue ops
        self._checked_glue, self._glue_impls = None, None
        self._checked_head = (None, {})  # (weights key, {(T, k): unchecked head}), see top_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ---- binding to a target -----------------------------------------------------------------

    def check_target(self, target) -> None:
        """Raise ValueError when this drafter cannot read `target`'s cache and embeddings."""
        dc, tc = self.config.text, target.config
        if self.config.backbone_hidden_size != tc.hidden_size:
            raise ValueError(f"drafter backbone_hidden_size {self.config.backbone_hidden_size} != target hidden_size "
                             f"{tc.hidden_size}")
        if dc.vocab_size != tc.vocab_size:
            raise ValueError(f"drafter vocab_size {dc.vocab_size} != target vocab_size {tc.vocab_size}")
        for lt in set(dc.layer_types):
            # what target.kv_cache(lt) returns: the last non-KV-shared layer of the type
            if tc.kv_layer_of(lt) is None:
                raise ValueError(f"the drafter has {lt} layers but the target has none to read")
            d, s = dc.attention[lt], tc.attention[lt]
            if d.head_dim != s.head_dim or dc.num_heads % s.num_kv_heads:
                raise ValueError(f"{lt}: drafter head_dim {d.head_dim} with {dc.num_heads} heads cannot read the "
                                 f"target's head_dim {s.head_dim} with {s.num_kv_heads} KV heads")
            if d.window is not None and d.window > s.window:
                # the target keeps sliding_window + 1 entries (see Gemma4Target.commit)
                raise ValueError(f"{lt}: drafter sliding_window {d.window} exceeds the target's {s.window}, whose "
                                 "cache no longer holds the older entries")
        if self.pre_projection.weight.dtype != target.dtype:
            raise ValueError(f"drafter dtype {self.pre_projection.weight.dtype} != target dtype {target.dtype}")

    def context(self, target, reqs: list[int], query_position: str = "last_cached", device=None) -> DraftContext:
        """The drafter's view of `reqs` in `target`, whose caches hold positions [0, P] (P + 1 = length).
        The per-request tensors (block tables, lengths, positions) on `device` (default the target's;
        "cpu": built on the host, what graphs.DraftGraphs copies into a round's buffers in one copy).

        "last_cached" (vLLM, SGLang): queries at P; a sliding layer attends the last `sliding_window`
        entries, as the target's own query at P would. "next" (Hugging Face): queries at P + 1, and a
        sliding layer attends the last `sliding_window + 1` entries, because HF's assistant masks the
        shared K/V with a bidirectional window whose distance bound is inclusive."""
        windows, extra = self._query_view(query_position)
        types = set(self.config.text.layer_types)
        kv = {t: target.kv_cache(t) for t in types}
        tables = target.block_tables(reqs, device)
        lengths = target.seq_lens(reqs, device)
        return DraftContext({t: kv[t][0] for t in types}, {t: kv[t][1] for t in types},
                            {t: tables[t] for t in types}, windows, lengths,
                            lengths.long() - 1 + extra, target.embed_tokens.weight, target.config.embed_scale)

    def _query_view(self, query_position: str) -> tuple[dict, int]:
        """(each attention type's window, the query's offset past the last cached position) for
        query_position, as `context` describes them; a bad name refused."""
        if query_position not in QUERY_POSITIONS:
            raise ValueError(f"query_position: expected one of {QUERY_POSITIONS}, got {query_position!r}")
        extra = 1 if query_position == "next" else 0
        return {t: None if s.window is None else s.window + extra
                for t, s in self.config.text.attention.items()}, extra

    # ---- one draft step ----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [B, Q], hidden [B, Q, Hb] -> (final normed hidden [B, Q, Hd], post_projection [B, Q, Hb]).

        The Q queries of a request (tree branches of one level) share one attention call. Per layer:
        q (input norm, q_proj, q_norm, RoPE; the previous layer's post-feedforward norm, residual add
        and layer scalar in its prologue), attention, o_proj, the MLP (post-attention norm, residual
        add, pre-feedforward norm in its prologue; gate/up and down_proj): 4 ops, 6 launches (attention's
        split-KV merge included; 5 where the attention kernel merges its own splits: the sliding layers;
        one fewer where the MLP is one launch: Triton, E2B / E4B at T <= 4), rounded where Hugging Face
        rounds (see gemma4_mtp_kernels.rms_norm_linear).

        What comes from outside (token ids, hidden states, the target's embedding and cache, the
        positions) is checked on every step. The 13 fused glue calls take only the drafter's weights
        and the activations the step allocates: they go through the public, checked ops on the first
        step with these weights on this device and dtype, and through
        `gemma4_mtp_kernels.implementation` (no checks: ~30 µs less host time a call on a 2-core VM)
        after it, until a weight is replaced (its address or shape changes) or the backend, device or
        dtype does.

        backend="cuda" on a device: the same composition in one call into C++
        (`torch.ops.gemma4_mtp.drafter_step`, csrc/ops/drafter_step.cu), which checks every argument
        (the errors the ops raise) and makes every launch there; not under torch.compile, which traces
        the ops instead, nor with value checks on (`gemma4_mtp_kernels.set_value_checks`: the ops read
        the token ids, lengths and block tables back to check them). backend="auto" on a CUDA device: the
        same one call where gemma4_mtp_kernels' evidence (verified.py) names the cuda step for this
        drafter, dtype and batch (`_dispatch.step_in_one_call`: eager steps by the eager steps a GPU run
        timed, the steps of DraftGraphs' rounds by the graph-replayed ones), else the ops one by one, each
        following its own evidence."""
        if self._in_one_call(token_ids):
            return self._one_call_step(ctx, token_ids, hidden)
        B, Q = token_ids.shape
        T = B * Q
        t = self.config.text
        Hb = self.config.backbone_hidden_size
        be, eps = self.backend, t.rms_norm_eps
        x = K.fused_concat_down_proj(token_ids.reshape(-1), ctx.embed_table, hidden.reshape(T, Hb),
                                     self.pre_projection.weight, embed_scale=ctx.embed_scale, backend=be)
        weights = [self._layer_weights(i) for i in range(t.num_layers)]
        post_projection, final_norm = self.post_projection.weight, self.norm.weight
        # Traced by torch.compile, the step takes the checked ops every time (the checks run at trace time,
        # not per call) and keeps no cache: dynamo (torch 2.11) cannot compare data pointers.
        key = None if torch.compiler.is_compiling() else (
            be, x.device, x.dtype, post_projection.data_ptr(), post_projection.shape, final_norm.data_ptr(),
            final_norm.shape, *((w.data_ptr(), w.shape) for lw in weights for w in lw))
        if key is not None and key == self._checked_glue:
            q_rope, linear, gate_up = self._glue_impls
            check_positions(ctx.positions, T, x.device)
        else:
            q_rope, linear, gate_up = (functools.partial(getattr(K, op), backend=self.backend)
                                       for op in _GLUE_OPS)
        residual, delta, prev = x, None, None  # residual stream, block output still to add, its layer
        for i, w in enumerate(weights):
            lt = t.layer_types[i]
            if prev is None:  # the first layer reads the pre-projection's output as it is
                q_in, glue, stream = x, {}, x
            else:  # the previous layer's end (post-feedforward norm, residual add, layer scalar) in front
                glue = self._glue(prev, residual, keep=True)
                q_in, stream = delta, glue["residual_out"]
            q = q_rope(q_in, w.q_proj, w.q_norm, ctx.positions, w.inv_freq, norm_weight=w.input_norm, eps=eps,
                       **glue)
            o = K.q_only_paged_attention(q.view(B, Q, -1, w.q_norm.shape[0]), ctx.k_cache[lt], ctx.v_cache[lt],
                                         ctx.block_table[lt], ctx.seq_lens, scale=1.0, window=ctx.window[lt],
                                         backend=be)
            a = linear(o.view(T, -1), w.o_proj)
            residual = x.new_empty(x.shape)
            delta = gate_up(a, w.gate, w.up, down_weight=w.down, norm_weight=w.pre_ff_norm, eps=eps, residual=stream,
                            residual_norm_weight=w.post_attn_norm, residual_out=residual)
            prev = w
        last = x.new_empty(x.shape)
        proj = linear(delta, post_projection, norm_weight=final_norm, eps=eps, normed_out=last,
                      **self._glue(prev, residual, keep=False))
        if key is not None and key != self._checked_glue:  # every glue call of this step passed the checks
            self._glue_impls = tuple(_Unchecked(op, self.backend, x.device, x.dtype) for op in _GLUE_OPS)
            self._checked_glue = key
        return last.view(B, Q, -1), proj.view(B, Q, Hb)

    def _in_one_call(self, token_ids: torch.Tensor) -> bool:
        """Whether a step on token_ids is one call into C++ (see step): never on the CPU, under torch.compile
        (which traces the ops) or with value checks on (the ops read the values back to check them)."""
        if (token_ids.device.type == "cpu" or torch.compiler.is_compiling() or not self.one_call_step
                or self.backend not in ("cuda", "auto")):
            return False
        if self.backend == "auto":
            B, Q = token_ids.shape
            shape = {"Hb": self.config.backbone_hidden_size, "Hd": self.config.text.hidden_size, "Q": Q, "B": B}
            # not through nn.Module.__getattr__ (see _layer_weights)
            dtype = _weight(self._modules["pre_projection"]).dtype
            if not step_in_one_call(token_ids.device, dtype, shape, graphed=self._graphed):
                return False
        return not values_checkable(token_ids)

    @contextlib.contextmanager
    def graphed_steps(self):
        """Within the block, steps are those of a draft round that DraftGraphs captures or runs from its
        static buffers: backend="auto" decides between one call and the ops by the graph-replayed steps'
        evidence, for the round's warm-up as for its capture."""
        before, self._graphed = self._graphed, True
        try:
            yield
        finally:
            self._graphed = before

    def step_top_tokens(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """step, then top_tokens(last, k): (last [B, Q, Hd], proj [B, Q, Hb], the k best tokens [B, Q, k]),
        what a greedy draft step computes. Where the step is one call into C++ (see step), the head is in
        that call too (its launches made there: one crossing from Python a draft step instead of two);
        elsewhere it is step and top_tokens."""
        # checked before an output of k columns is allocated (an integer of any kind: a width from numpy)
        if isinstance(k, bool) or not hasattr(k, "__index__") or operator.index(k) < 1:
            raise ValueError(f"step_top_tokens: k must be a positive int, got {k!r}")
        k = operator.index(k)
        if self._in_one_call(token_ids):
            return self._one_call_step(ctx, token_ids, hidden, k)
        last, proj = self.step(ctx, token_ids, hidden)
        return last, proj, self.top_tokens(last, k)

    def step_sample_tokens(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor,
                           temperature: torch.Tensor, uniforms: torch.Tensor, probs_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """step, then sample_tokens over its T = B * Q rows of last: (last [B, Q, Hd], proj [B, Q, Hb], a token
        per row [T] drawn from q = softmax(logits / temperature [T]) at uniforms [T] fp64, q [T, V] fp32 (into
        probs_out when given)), what a sampled draft step computes. Where the step is one call into C++ (see
        step), the head's dense logits and softmax_sample are in that call too (one crossing from Python a
        sampled draft step instead of three); elsewhere it is step and sample_tokens."""
        if self._in_one_call(token_ids):
            return self._one_call_step(ctx, token_ids, hidden, sample=(temperature, uniforms, probs_out))
        return self._step_then_sample_tokens(ctx, token_ids, hidden, temperature, uniforms, probs_out)

    def _step_then_sample_tokens(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor,
                                 temperature: torch.Tensor, uniforms: torch.Tensor,
                                 probs_out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """step_sample_tokens as separate calls: step, then sample_tokens over its B * Q rows of last (the
        head's logits, softmax_sample). What it is where the step is not one call; the benchmarks' head-apart
        baseline where it is."""
        last, proj = self.step(ctx, token_ids, hidden)
        return last, proj, *self.sample_tokens(last.reshape(-1, last.shape[-1]), temperature, uniforms, probs_out)

    def _one_call_step(self, ctx: DraftContext, token_ids: torch.Tensor, hidden: torch.Tensor, k: int | None = None,
                       sample: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """The step in one call into C++; with k, the head's top-k too: (last, proj, ids); with sample
        (temperature, uniforms, probs_out), a drawn token per row: (last, proj, tokens, probs)."""
        from gemma4_mtp_kernels import cuda

        t = self.config.text
        kinds = tuple(dict.fromkeys(t.layer_types))  # attention types in order of first use
        weights = [w for i in range(t.num_layers) for w in self._layer_weights(i)]
        head = {}
        if k is not None or sample is not None:  # as top_tokens / logits call the head op
            head_weights = self._head_weights()
            head = dict(lm_head=head_weights[-1], k=k or 1)
            if sample is not None:
                head.update(zip(("temperature", "uniforms", "probs_out"), sample))
            if self.config.use_ordered_embeddings:
                head.update(centroids=head_weights[0], token_ordering=head_weights[1],
                            centroid_top_k=self.config.centroid_top_k)
        out = cuda.drafter_step(
            token_ids, hidden, ctx.embed_table, _weight(self._modules["pre_projection"]), weights,
            [kinds.index(lt) for lt in t.layer_types], [ctx.k_cache[kind] for kind in kinds],
            [ctx.v_cache[kind] for kind in kinds], [ctx.block_table[kind] for kind in kinds],
            [ctx.window[kind] or 0 for kind in kinds], ctx.seq_lens, ctx.positions, _weight(self._modules["norm"]),
            _weight(self._modules["post_projection"]), embed_scale=ctx.embed_scale, eps=t.rms_norm_eps, **head)
        return out if sample is not None else out[:3]

    def _layer_weights(self, i: int) -> "_LayerWeights":
        # Read every step, to notice a replaced weight: through the modules' own dicts, because
        # nn.Module.__getattr__ costs ~1 µs an attribute on a 2-core VM (~70 µs a step for 4 layers).
        layer = self._modules["layers"]._modules[str(i)]
        attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        norm = layer._modules
        return _LayerWeights(_weight(norm["input_layernorm"]), _weight(attn["q_proj"]), _weight(attn["q_norm"]),
                             self._buffers[f"{self.config.text.layer_types[i]}_inv_freq"], _weight(attn["o_proj"]),
                             _weight(norm["post_attention_layernorm"]), _weight(norm["pre_feedforward_layernorm"]),
                             _weight(mlp["gate_proj"]), _weight(mlp["up_proj"]), _weight(mlp["down_proj"]),
                             _weight(norm["post_feedforward_layernorm"]), layer._buffers["layer_scalar"])

    @staticmethod
    def _glue(w: "_LayerWeights", residual: torch.Tensor, *, keep: bool) -> dict:
        """The end of a layer (weights `w`) as a prologue: residual + post_feedforward_layernorm(delta),
        times its layer_scalar; with keep, into a new residual_out buffer (the next layer's residual stream)."""
        glue = dict(residual=residual, residual_norm_weight=w.post_ff_norm, layer_scalar=w.scalar)
        if keep:
            glue["residual_out"] = residual.new_empty(residual.shape)
        return glue

    # ---- LM head -----------------------------------------------------------------------------

    def _head_weights(self) -> tuple[torch.Tensor, ...]:
        """The LM head's weights as its op takes them: (centroids, token_ordering, lm_head) for the centroid
        head (centroid_logits), (lm_head,) for the dense one (dense_lm_head)."""
        if self.config.use_ordered_embeddings:
            return self.centroids.weight, self.token_ordering, self.lm_head_weight
        return (self.lm_head_weight,)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """Dense fp32 logits [..., V]; with the centroid head, tokens outside the selected clusters get -inf."""
        flat = last.reshape(-1, last.shape[-1])
        if self.config.use_ordered_embeddings:
            out = K.centroid_logits(flat, *self._head_weights(), top_k=self.config.centroid_top_k, output="dense",
                                    backend=self.backend)
        else:
            out = K.dense_lm_head(flat, *self._head_weights(), output="dense", backend=self.backend)
        return out.view(*last.shape[:-1], -1)

    def sample_tokens(self, last: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                      probs_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A token per row of last [B, Hd] drawn from q = softmax(logits / temperature [B]) by the inverse
        CDF at uniforms [B] fp64, and q [B, V] fp32 (written into probs_out when given): the head's dense
        logits, then `gemma4_mtp_kernels.softmax_sample` (two launches on the GPU)."""
        return K.softmax_sample(self.logits(last), temperature, uniforms, probs_out=probs_out, backend=self.backend)

    def top_tokens(self, last: torch.Tensor, k: int) -> torch.Tensor:
        """The k highest-scoring tokens [..., k] (int64), best first, ties to the lower id.

        Like the step's glue, the head goes through its public, checked op the first time for these
        weights, backend, device, dtype and call shape, and through its implementation after that
        (~15 µs less host time a step on a 2-core VM), `last` checked here: anything else than the
        weights' dtype and device in rows of Hd with unit stride takes the checked op again, which says
        what is wrong."""
        flat, weights = last.reshape(-1, last.shape[-1]), self._head_weights()
        if self.config.use_ordered_embeddings:
            op, shape = "centroid_logits", centroid_shape
            kw = dict(top_k=self.config.centroid_top_k, output="argmax" if k == 1 else "topk", k=k)
        else:
            op, kw, shape = "dense_lm_head", dict(output="topk", k=k), dense_head_shape
        head = weights[-1]
        key = None if torch.compiler.is_compiling() else (
            self.backend, head.device, head.dtype, *((w.data_ptr(), w.shape) for w in weights))
        call = (flat.shape[0], k)
        if key is not None and self._checked_head[0] == key and call in self._checked_head[1] \
                and flat.device == head.device and flat.dtype == head.dtype and flat.shape[1] == head.shape[1] \
                and (flat.shape[1] <= 1 or flat.stride(1) == 1):
            ids, _ = self._checked_head[1][call](flat, *weights, **kw)
        else:
            ids, _ = getattr(K, op)(flat, *weights, **kw, backend=self.backend)
            if key is not None:  # this call passed the checks: its implementation serves the next ones
                if self._checked_head[0] != key:
                    self._checked_head = (key, {})
                self._checked_head[1][call] = K.implementation(op, self.backend, head.device, head.dtype,
                                                               shape(flat, *weights, **kw))
        return ids.view(*last.shape[:-1], k)

    @property
    def max_branch(self) -> int:
        """The most children a tree node can get from `top_tokens`: the head's candidates, at most 16 (its top-k)."""
        c = self.config
        if c.use_ordered_embeddings:
            return min(c.centroid_top_k * (c.text.vocab_size // c.num_centroids), K.DENSE_LM_HEAD_MAX_K)
        return min(c.text.vocab_size, K.DENSE_LM_HEAD_MAX_K)


# ---- real shapes, random weights (benchmarks, launch counts, compile coverage) --------------------


def random_drafter(name: str | dict, *, device="cpu", dtype=torch.bfloat16, backend: str = "auto", seed: int = 0
                   ) -> Gemma4MTPDrafter:
    """A drafter at the shapes of `name` (see real_shape_config) with random O(1)-activation weights
    (on the meta device: no storage, no values)."""
    with torch.device(device):
        drafter = Gemma4MTPDrafter(real_shape_config(name), backend=backend)
    if torch.device(device).type != "meta":
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for n, p in drafter.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
                else:  # norm weights away from 1
                    p.normal_(1.0, 0.2, generator=g)
            if drafter.config.use_ordered_embeddings:
                drafter.token_ordering.copy_(torch.randperm(drafter.config.text.vocab_size, generator=g,
                                                            device=device))
    return to_dtype(drafter, dtype).eval()


def synthetic_context(drafter: Gemma4MTPDrafter, B: int, length: int, *, device="cpu", dtype=torch.bfloat16,
                      block_size: int = 16, seed: int = 0, query_position: str = "last_cached") -> DraftContext:
    """A DraftContext as a target holding `length` positions per request would give it (`context`'s
    query_position: "next" queries at `length` over a sliding window one entry wider, as Hugging Face's
    assistant reads it): random K/V in paged caches with the blocks of all requests shuffled; sliding
    layers keep the blocks of their last window + 1 positions (older table entries are -1, released, as
    the target leaves them)."""
    windows, extra = drafter._query_view(query_position)
    cfg = drafter.config
    meta = torch.device(device).type == "meta"
    g = None if meta else torch.Generator(device=device).manual_seed(seed)
    blocks = -(-length // block_size)
    k, v, tables = {}, {}, {}
    for lt, spec in cfg.text.attention.items():
        first = 0 if spec.window is None else max(0, length - spec.window - 1) // block_size
        live = blocks - first
        shape = (max(1, B * live), block_size, spec.num_kv_heads, spec.head_dim)
        k[lt] = torch.empty(shape, dtype=dtype, device=device)
        v[lt] = torch.empty(shape, dtype=dtype, device=device)
        table = torch.full((B, blocks), -1, dtype=torch.int32, device=device)
        if not meta:
            k[lt].normal_(generator=g)
            v[lt].normal_(generator=g)
            perm = torch.randperm(B * live, generator=g, device=device).to(torch.int32)
            table[:, first:] = perm.view(B, live)
        tables[lt] = table
    Hb, V = cfg.backbone_hidden_size, cfg.text.vocab_size
    embed = torch.empty(V, Hb, dtype=dtype, device=device)
    if not meta:
        embed.normal_(generator=g)
    seq_lens = torch.full((B,), length, dtype=torch.int32, device=device)
    return DraftContext(k, v, tables, windows, seq_lens, seq_lens.long() - 1 + extra, embed, float(Hb) ** 0.5)
