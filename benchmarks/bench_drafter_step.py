"""What an engine pays for: one drafter step, a k = 4 chain round and a (2, 2, 1) tree round, for the
four real drafters (random weights at the real shapes, bf16), B = 1 / 8 / 32, context 8K / 32K; and a
sampling request's k = 4 chain round (drafts drawn from q at temperature 0.8, `graphs.DraftSampling`,
verified with their probabilities), B = 1 / 8, 8K.

A step is `Gemma4MTPDrafter.step_top_tokens(..., 1)` (`step` + `top_tokens(last, 1)`: one call into
C++ where the step is one); a round is `gemma4_mtp.graphs.draft_tree`
(the k steps and the tree bookkeeping) + the `tree_verify` of its nodes over random target logits
(the target forward in between is not the drafter's). Baselines:
- `hf_assistant` (steps only): Hugging Face's Gemma4AssistantForCausalLM forward + argmax at the same
  shapes (its shared K/V as HF holds it, [B, Hkv, n, D]), eager: the anchor, where transformers runs;
- `triton`, `cuda`: our drafter with that backend (every op of the step, the fused glue and the LM
  head included, on that backend), the call captured and replayed as one CUDA graph by the timer;
- `triton_no_pdl` (steps, and rounds at B = 1): `triton` with programmatic dependent launch off (`_common.PDL`, as
  GEMMA4_MTP_PDL=0 sets it), graph-replayed: what PDL saves between the ~27 dependent launches of a
  step (prediction in benchmarks/README.md, "Programmatic dependent launch");
- `triton_merge_kernel` (steps at B = 1): `triton` with every attention's splits merged by the merge
  kernel (`q_only_attention.IN_KERNEL_MERGE` off), graph-replayed: what the in-kernel merge of the
  sliding layers saves (prediction in benchmarks/README.md, "The attention merges its own splits");
- `triton_pdl_at_exit` (steps at B = 1): `triton` with each kernel letting the next be scheduled when it
  exits, not as soon as it has waited for its inputs (`_common.PDL_EARLY_TRIGGER` off), graph-replayed:
  whether the waiting programs of the next kernel slow the wide 31B kernels (benchmarks/README.md, "Kernel
  by kernel");
- `triton_no_prefetch` (steps at B = 1): `triton` without the GEMV kernels' L2 prefetch of their first
  weight lines before their wait (`_common.PREFETCH_WEIGHTS` off), graph-replayed: what that prefetch saves
  (benchmarks/README.md, "Weights asked of L2 before the wait");
- `triton_long_splits` (steps at B = 1): `triton` with every split-K glue program streaming at least 8 K
  blocks (`rms_norm_linear.MIN_KB_PER_SPLIT` = 8, the launcher's rule before 2026-12-05: 16-32 programs for
  E2B's o_proj and down_proj instead of 64-128), graph-replayed: whether a shorter weight chain per
  program pays for more partials (benchmarks/README.md, "E2B's split-K GEMVs in two-block programs");
- `triton_two_launch_mlp` (E2B / E4B steps at B = 1): `triton` with each layer's MLP as two launches, gate_up then
  down_proj (`rms_norm_gate_up.MLP_MAX_T` = 0, the step before 2026-12-06), graph-replayed: what the
  one-launch MLP saves (benchmarks/README.md, "The MLP in one launch");
- `triton_tuned` (steps and chain rounds at B = 1, when GEMMA4_MTP_BENCH_TUNED_CONFIGS names a
  tuned-configuration file with entries): `triton` with that file's launch configurations in force
  (`gemma4_mtp_kernels.triton.tuned`), graph-replayed: gpu_check.sh writes the file from its
  launch-configuration sweep just before, so one run says what the sweep's winners are worth to a step and
  a round (benchmarks/README.md, "The sweep's winners in the same run");
- `triton_eager`, `cuda_eager`: the same calls eagerly, timed with events around them: on a GPU this
  is the host time per call (Python, validation, launches), the GPU waiting on it (`cuda_eager`: a
  step and its head are one call into C++, csrc/ops/drafter_step.cu). The step rows of these two and of `triton` /
  `cuda` are also what `backend="auto"` steps follow (benchmarks/make_verified.py, STEP_EVIDENCE);
- `cuda_eager_ops` (steps): `cuda_eager` with the step made of the ops one by one
  (`Gemma4MTPDrafter.one_call_step` False), what the one-call step saves (benchmarks/README.md, "A
  drafter step in one host call");
- `cuda_eager_head_apart` (steps and sampled chain rounds at B = 1): `cuda_eager` with the head as calls of
  its own after the one-call step (`step`, then `top_tokens`; sampled, then `sample_tokens`: the head's
  logits and softmax_sample), what the head in the step's call saves (benchmarks/README.md, "A draft step
  and its head in one host call", "A sampled draft step in one host call");
- `torch_eager`: the reference backend (the unfused composition, host reads in its attention).
Floors: roofline.drafter_step, roofline.draft_round (chain), and the tree round's three steps with 1,
2 and 4 queries per request plus the verify of its 11 nodes (roofline.draft_round counts 1 + 7).
The check is a sanity check (random weights, bf16, different summation orders): at least 3/4 of the
drafted tokens equal the reference backend's.
"""
from __future__ import annotations

import copy
import importlib
import os
from unittest import mock

import torch

import gemma4_mtp_kernels as gk
from gemma4_mtp_kernels.triton import _common, q_only_attention, tuned

from . import roofline
from .common import Case, external

# the module (the package's attribute of that name is the op function it re-exports)
rms_norm_linear = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_linear")
rms_norm_gate_up = importlib.import_module("gemma4_mtp_kernels.triton.rms_norm_gate_up")

# Our own drafter with a switch off, timed eagerly, or on the reference backend: what our choices are
# worth, never an anchor to beat (benchmarks.readme_tables).
OUR_VARIANTS = frozenset({"triton_no_pdl", "triton_merge_kernel", "triton_pdl_at_exit", "triton_no_prefetch",
                          "triton_long_splits", "triton_two_launch_mlp", "triton_tuned", "triton_eager",
                          "cuda_eager", "cuda_eager_ops", "torch_eager"})
# A tuned-configuration file (tune_launch_configs --tuned-out): the `triton_tuned` baseline's
TUNED_ENV = "GEMMA4_MTP_BENCH_TUNED_CONFIGS"


def tuned_configs() -> str | None:
    """The file TUNED_ENV names when it has entries to apply (one without any would time `triton` again); a
    file tuned.load refuses is returned too: its baseline then fails with that message."""
    path = os.environ.get(TUNED_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        return path if tuned.load(path)[1] else None
    except ValueError:
        return path

# "sampled": the chain round of a sampling request (graphs.DraftSampling, temperature 0.8), its verify with
# the drafts' probabilities
SHAPES = {"step": None, "chain": (1, 1, 1, 1), "tree": (2, 2, 1), "sampled": (1, 1, 1, 1)}
TEMPERATURE = 0.8
# the dry run's drafter: the real layer pattern at toy sizes (head dims the attention supports)
TINY = dict(Hb=64, Hd=32, inter=64, Hq=4, Hkv_swa=2, Hkv_full=1, D_swa=64, D_full=128, window=8, centroids=None,
            top_k=None, vocab=256)
TINY_CENTROIDS = dict(TINY, centroids=16, top_k=4)


def round_cost(name: str, B: int, ctx: int, kind: str) -> roofline.Cost:
    if kind == "step":
        return roofline.drafter_step(name, B, ctx)
    if kind == "chain":
        return roofline.draft_round(name, B, ctx, 4)
    if kind == "sampled":  # + each draft's q, written once (fp32) and read by the verify
        V = roofline.DRAFTERS[name]["vocab"]
        return roofline.draft_round(name, B, ctx, 4) + roofline.Cost(
            "sampled drafts", {"sampled drafts: q written and read (fp32)": 2 * B * 4 * V * 4}, flops=B * 4 * V * 5.0)
    cost = roofline.Cost(f"{name} tree round (2, 2, 1)")
    for queries in (1, 2, 4):
        cost = cost + roofline.drafter_step(name, B, ctx, Q=queries)
    return cost + roofline.tree_verify(B, 11, roofline.DRAFTERS[name]["vocab"])


_BUILT: dict = {}


def _drafter(shape, device, dtype, seed):
    """One random drafter per (shape, device, dtype, seed), kept while cases of that shape run (the
    31B one holds 1.4 GB of weights)."""
    from gemma4_mtp.drafter import random_drafter

    key = (str(shape), str(device), dtype, seed)
    if key not in _BUILT:
        if any(k[0] != key[0] for k in _BUILT):
            _BUILT.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        _BUILT[key] = random_drafter(shape, device=device, dtype=dtype, backend="torch", seed=seed)
    return _BUILT[key]


def _inputs(shape, B, ctx, kind):
    def make(device, dtype, seed):
        from gemma4_mtp.drafter import synthetic_context
        from gemma4_mtp.graphs import tree_parents

        drafter = _drafter(shape, device, dtype, seed)
        g = torch.Generator(device=device).manual_seed(seed)
        V, Hb = drafter.config.text.vocab_size, drafter.config.backbone_hidden_size
        inp = {"drafter": drafter, "ctx": synthetic_context(drafter, B, ctx, device=device, dtype=dtype, seed=seed),
               "pending": torch.randint(0, V, (B,), generator=g, device=device),
               "hidden": torch.randn(B, Hb, generator=g, device=device).to(dtype)}
        if kind != "step":
            parents = tree_parents(SHAPES[kind])
            inp["parents"] = torch.tensor([parents] * B, dtype=torch.int32, device=device)
            inp["logits"] = (4 * torch.randn(B, len(parents), V, generator=g, device=device)).to(dtype)
        if kind == "sampled":
            inp["temperature"] = torch.full((B,), TEMPERATURE, device=device)
            inp["draft_uniforms"] = torch.rand(B, len(SHAPES[kind]), generator=g, device=device, dtype=torch.float64)
            inp["verify_uniforms"] = torch.rand(B, len(parents), 2, generator=g, device=device)
        return inp
    return make


def _with_backend(drafter, backend, one_call=True):
    """The same weights under another backend (a shallow copy shares the parameters); one_call False:
    a cuda step made of the ops one by one (Gemma4MTPDrafter.one_call_step)."""
    d = copy.copy(drafter)
    d.backend, d.one_call_step = backend, one_call
    return d


def run_ours(inp, backend, kind, one_call=True, head_apart=False):
    from gemma4_mtp.graphs import DraftSampling, draft_tree

    drafter = _with_backend(inp["drafter"], backend, one_call)
    if kind == "step":
        tokens, hidden = inp["pending"].view(-1, 1), inp["hidden"].unsqueeze(1)
        if head_apart:  # the step's call, then the head's
            return drafter.top_tokens(drafter.step(inp["ctx"], tokens, hidden)[0], 1).view(-1)
        return drafter.step_top_tokens(inp["ctx"], tokens, hidden, 1)[2].view(-1)
    if kind == "sampled":
        s = DraftSampling(inp["temperature"], inp["draft_uniforms"])
        if head_apart:  # draft_tree's levels as the step's call, then the head's two
            drafter.step_sample_tokens = drafter._step_then_sample_tokens
        tokens = draft_tree(drafter, inp["ctx"], inp["pending"], inp["hidden"], SHAPES[kind], sampling=s)
        verify = gk.tree_verify(tokens, inp["parents"], inp["logits"], temperature=inp["temperature"],
                                uniforms=inp["verify_uniforms"], draft_probs=s.probs, backend=drafter.backend)
    else:
        tokens = draft_tree(drafter, inp["ctx"], inp["pending"], inp["hidden"], SHAPES[kind])
        verify = gk.tree_verify(tokens, inp["parents"], inp["logits"], backend=drafter.backend)
    return torch.cat([tokens.view(-1), verify.output_tokens.view(-1)])


def ours(backend, kind, one_call=True, head_apart=False):
    def factory(inp):
        return lambda: run_ours(inp, backend, kind, one_call, head_apart)
    return factory


def ours_with(kind, module, switch: str, value):
    """`ours("triton")` with `module.switch` set to `value` for every launch (warm-up and capture
    included): `_common.PDL` False launches without programmatic dependent launch,
    `q_only_attention.IN_KERNEL_MERGE` False merges every split attention with its merge kernel."""
    def factory(inp):
        def call():
            with mock.patch.object(module, switch, value):
                return run_ours(inp, "triton", kind)
        return call
    return factory


def hf_assistant(shape, B, ctx):
    """Hugging Face's assistant forward (+ argmax of its logits) at the same shapes, random weights."""
    def factory(inp):
        transformers = external("transformers")
        dev, dtype = inp["hidden"].device, inp["hidden"].dtype
        key = (str(shape), "hf", str(dev), dtype)  # kept with the drafters of this shape
        if key not in _BUILT:
            _BUILT[key] = _build_hf(transformers, shape, dev, dtype)
        model = _BUILT[key]
        d = shape
        n_swa = min(ctx, d["window"] + 1)  # what the target's sliding layer still holds
        g = torch.Generator(device=dev).manual_seed(0)

        def kv(Hkv, n, D):
            return (torch.randn(B, Hkv, n, D, generator=g, device=dev).to(dtype),
                    torch.randn(B, Hkv, n, D, generator=g, device=dev).to(dtype))
        shared = {"sliding_attention": kv(d["Hkv_swa"], n_swa, d["D_swa"]),
                  "full_attention": kv(d["Hkv_full"], ctx, d["D_full"])}
        embeds = torch.randn(B, 1, 2 * d["Hb"], generator=g, device=dev).to(dtype)
        positions = torch.full((B, 1), ctx, dtype=torch.long, device=dev)

        def call():
            out = model(inputs_embeds=embeds, position_ids=positions, shared_kv_states=dict(shared))
            return out.logits[:, -1].argmax(-1)
        return call
    return factory


def _build_hf(transformers, d, dev, dtype):
    types = ["sliding_attention"] * 3 + ["full_attention"]
    text = transformers.Gemma4TextConfig(
        vocab_size=d["vocab"], hidden_size=d["Hd"], intermediate_size=d["inter"], num_hidden_layers=4,
        num_attention_heads=d["Hq"], num_key_value_heads=d["Hkv_swa"], head_dim=d["D_swa"], global_head_dim=d["D_full"],
        attention_k_eq_v=d["Hkv_full"] != d["Hkv_swa"], num_global_key_value_heads=d["Hkv_full"],
        sliding_window=d["window"], layer_types=types, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        tie_word_embeddings=True)
    extra = dict(num_centroids=d["centroids"], centroid_intermediate_top_k=d["top_k"]) if d["centroids"] else {}
    cfg = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=d["Hb"],
                                             use_ordered_embeddings=d["centroids"] is not None, **extra)
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = transformers.Gemma4AssistantForCausalLM(cfg)
    return model.to(dtype).eval()


def agree(out, ref) -> dict:
    same = (out.cpu() == ref.cpu()).double().mean().item()
    return {"ok": same >= 0.75, "agree": same}


def cases(dry: bool) -> list[Case]:
    if dry:
        grid = [(f"tiny{'-centroids' if s['centroids'] else ''}", s, B, 64, kind)
                for s, B, kind in ((TINY, 2, "step"), (TINY_CENTROIDS, 1, "step"), (TINY, 2, "chain"),
                                   (TINY_CENTROIDS, 2, "tree"), (TINY_CENTROIDS, 2, "sampled"))]
    else:
        grid = [(n, roofline.DRAFTERS[n], B, ctx, kind) for n in roofline.DRAFTERS for B in (1, 8, 32)
                for ctx in (8192, 32768) for kind in SHAPES if kind != "sampled" or (ctx == 8192 and B <= 8)]
        # the targets first (E2B and 31B, B = 1, 8K; steps, then rounds): later cases may not fit the budget
        grid.sort(key=lambda c: (c[2] != 1 or c[3] != 8192, c[0] not in ("E2B", "31B"), c[2], c[3],
                                 list(SHAPES).index(c[4]), c[0]))
    tuned_path = tuned_configs()
    out = []
    for name, shape, B, ctx, kind in grid:
        with mock.patch.dict(roofline.DRAFTERS, {name: shape}):  # the dry run's toy shapes, for this cost only
            cost = round_cost(name, B, ctx, kind)
        baselines = {}
        if kind == "step":
            baselines["hf_assistant"] = hf_assistant(shape, B, ctx)
        baselines.update({"triton": ours("triton", kind), "cuda": ours("cuda", kind)})
        if B == 1 or kind == "step":  # on a CPU (the interpreter) the same code as "triton"; run for its wiring
            baselines["triton_no_pdl"] = ours_with(kind, _common, "PDL", False)
        if B == 1 and kind == "step":
            baselines["triton_merge_kernel"] = ours_with(kind, q_only_attention, "IN_KERNEL_MERGE", False)
            baselines["triton_pdl_at_exit"] = ours_with(kind, _common, "PDL_EARLY_TRIGGER", False)
            baselines["triton_no_prefetch"] = ours_with(kind, _common, "PREFETCH_WEIGHTS", False)
            baselines["triton_long_splits"] = ours_with(kind, rms_norm_linear, "MIN_KB_PER_SPLIT", 8)
            if rms_norm_gate_up.one_launch(B, shape["Hd"], shape["inter"], shape["Hd"], 2):
                baselines["triton_two_launch_mlp"] = ours_with(kind, rms_norm_gate_up, "MLP_MAX_T", 0)
        if B == 1 and kind in ("step", "chain") and tuned_path:
            baselines["triton_tuned"] = ours_with(kind, tuned, "PATH", tuned_path)
        if not dry:  # the same calls as "triton" / "cuda", timed eagerly: nothing more to exercise on a CPU
            baselines["triton_eager"] = ours("triton", kind)
            baselines["cuda_eager"] = ours("cuda", kind)
            if kind == "step":
                baselines["cuda_eager_ops"] = ours("cuda", kind, one_call=False)
            if kind in ("step", "sampled") and B == 1:
                baselines["cuda_eager_head_apart"] = ours("cuda", kind, head_apart=True)
        baselines["torch_eager"] = ours("torch", kind)
        what = {"step": "step", "chain": "chain round k=4", "tree": "tree round (2,2,1)",
                "sampled": f"sampled chain round k=4 T={TEMPERATURE}"}[kind]
        out.append(Case(
            op="drafter_step" if kind == "step" else "draft_round", label=f"{name} {what} B={B} ctx={ctx}",
            params=dict(drafter=name, B=B, ctx=ctx, kind=kind, shape=list(SHAPES[kind] or ())), cost=cost,
            make_inputs=_inputs(shape, B, ctx, kind), reference=lambda i, kind=kind: run_ours(i, "torch", kind),
            baselines=baselines, default_compare=agree,
            compare={"hf_assistant": lambda o, r: {"ok": None, "detail": "Hugging Face's weights: a different model"}},
            eager=frozenset({"hf_assistant", "triton_eager", "cuda_eager", "cuda_eager_ops", "cuda_eager_head_apart",
                             "torch_eager"})))
    return out

