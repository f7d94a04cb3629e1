"""Ahead-of-time compile of every Triton launch for sm_80 / sm_90 without a GPU, and its resource use.

`launches()` runs the public ops (backend="triton") over the real drafter shapes and the awkward
cases (greedy / sampling / draft_probs verifies, sampled draft tokens, None pointers, every dtype, split
and unsplit paths, the SM counts of A100, H100 and H200: GPUS) on meta tensors, with `record.recording` in
place of the kernel launch: what it collects is what the launchers really launch, as Triton's JIT would
specialise it on a GPU.
`compile_launch` builds one for a `GPUTarget` and reads registers, shared memory and local memory
(spills) from `cuobjdump -res-usage` of the cubin; `front_end` takes a launch through Triton's front end
only (the torch.compile check, INDUCTOR_FLOAT). Used by tests/test_triton_aot.py (under Triton 3.8
and the Triton 3.6 of `.ci/setup`'s second environment) and benchmarks/triton_resources.py.
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile
from typing import Callable, Iterator, NamedTuple
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gemma4_mtp_kernels as g
from ..drafter_shapes import DRAFTERS
from . import _common
from ._common import cdiv
from .record import RecordedLaunch, recording

# The GPUs the launches are recorded for: SM architecture -> the SM counts of its GPUs (the launchers size
# grids and splits by them). sm_80: A100 (108); sm_90: H100 PCIe (114), H100 SXM / H200 (132). Each architecture
# with its own GPUs' counts: the cross product of (108, 132) it replaced also compiled 58 launches per Triton
# version for an sm_80 GPU of 132 SMs, which does not exist (a quarter of the centroid head's compiles, the
# slowest; 2026-12-07).
GPUS = {80: (108,), 90: (114, 132)}
ARCHS = tuple(GPUS)


class Launch(NamedTuple):
    name: str               # the first scenario that made this launch
    launch: RecordedLaunch  # what the launcher launched, as Triton's JIT specialised it
    dtype: str              # element type of the scenario's big operands; fp32 (a test dtype) may spill
    archs: tuple            # the SM architectures whose GPUs make this launch (and that compile it)

    @property
    def kernel(self):
        return self.launch.kernel


class Resources(NamedTuple):
    registers: int
    shared_bytes: int
    local_bytes: int   # local memory per thread: register spills (none of the kernels uses local arrays)
    stack_bytes: int


def _on_cubin(tool: str, flag: str, cubin: bytes) -> str:
    """The output of one of Triton's CUDA binary tools (cuobjdump, nvdisasm) run on the cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, flag, f.name], check=True, capture_output=True, text=True).stdout


def sass(cubin: bytes) -> str:
    """The cubin's SASS (nvdisasm)."""
    return _on_cubin("nvdisasm", "-c", cubin)


def _after_election(code: str) -> str:
    """The SASS after the kernel's last ATOMG: what the program elected by a counter (the last of a group
    to finish) runs alone on the critical path."""
    return code[code.rfind("ATOMG"):]


def load_waves_after_election(code: str, ends: str) -> int:
    """The runs of global loads after the election that an instruction containing `ends` ends: each run
    waits for the one before it, a dependent L2 round trip. Split-K epilogues (`_common.sum_splits`): runs
    ended by an FADD, 1 when every partial tile of a group is loaded before the first add; the attention's
    in-kernel merge: runs ended by a bar.sync, 1 when the partials are loaded with their lse, before the
    reductions (whose barriers ptxas does not move loads across)."""
    waves, loading = 0, False
    for line in _after_election(code).splitlines():
        if "LDG" in line:
            waves += not loading
            loading = True
        elif ends in line:
            loading = False
    return waves


# One SASS instruction of nvdisasm's listing: its address comment, then the instruction up to its ';'.
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s*([^;]*);")


def instructions_after_election(code: str) -> int:
    """SASS instructions after the election, e.g. q_rope's q_norm + RoPE of a head."""
    return len(_INSTRUCTION.findall(_after_election(code)))


# q_rope's elected epilogue for one token (EPI_T = 1, a decode step at batch 1) on sm_90: ~200 (D 256) to
# ~280 (D 512) instructions; ~1100 when it computed 2048 / D tokens for the one it stores, ~700 for 2048 / D
# tokens now
Q_ROPE_ONE_TOKEN_TAIL = 400


def resource_usage(cubin: bytes) -> Resources:
    text = _on_cubin("cuobjdump", "-res-usage", cubin)
    fields = dict(re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", text))
    return Resources(int(fields["REG"]), int(fields["SHARED"]), int(fields["LOCAL"]), int(fields["STACK"]))


def compile_launch(launch: Launch, arch: int):
    """The compiled kernel for one target and its resource use (shared memory includes Triton's
    dynamic allocation, which cuobjdump's static count does not see)."""
    rec = launch.launch
    src = ASTSource(rec.kernel, rec.signature, rec.constexprs, rec.attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(rec.options))
    res = resource_usage(compiled.asm["cubin"])
    return compiled, res._replace(shared_bytes=res.shared_bytes + compiled.metadata.shared)


# The dispatch-time parameters the launchers meet for the real drafters (on GPUS' SM counts): tokens per
# draft step, requests per batch, queries per request (a chain step, tree levels of up to 8 branches),
# attended lengths, draft tree sizes, and the awkward options (None pointers, an unaligned `out`, sampling
# kinds). Each scenario is a public op call with backend="triton" on meta tensors.
TOKENS = (1, 8, 64, 256)  # 256: a large batch of one-token steps
BATCHES = (1, 8, 64)      # 64: enough programs that attention needs no key split
QUERIES = (1, 2, 4, 8)
CONTEXTS = (512, 8192, 131072)
TREE_NODES = (1, 5, 8, 64)
VOCAB = 262144
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Scenario(NamedTuple):
    name: str
    dtype: str
    call: Callable[[], object]


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _attention_scenarios() -> Iterator[Scenario]:
    def call(dtype, B, Q, Hq, Hkv, D, ctx, block_size=16, window=None, **kw):
        blocks = cdiv(ctx, block_size)
        k = _meta((B * blocks, block_size, Hkv, D), dtype)
        return lambda: g.q_only_paged_attention(_meta((B, Q, Hq, D), dtype), k, torch.empty_like(k),
                                                _meta((B, blocks), torch.int32), _meta((B,), torch.int32),
                                                scale=D ** -0.5, window=window, backend="triton", **kw)

    for (dname, dtype), (name, d), layer in itertools.product(DTYPES.items(), DRAFTERS.items(), ("swa", "full")):
        D, Hkv = d[f"D_{layer}"], d[f"Hkv_{layer}"]
        # the decode loop attends window + 1 entries for HF's bidirectional sliding mask
        windows = (d["window"], d["window"] + 1) if layer == "swa" else (None,)
        for Q, B, ctx, window in itertools.product(QUERIES, BATCHES, CONTEXTS, windows):
            what = f"attention {dname} {name} {layer} D={D} Q={Q} B={B} ctx={ctx} window={window}"
            shape = dict(B=B, Q=Q, Hq=d["Hq"], Hkv=Hkv, D=D, ctx=ctx, window=window)
            yield Scenario(what, dname, call(dtype, **shape))
            if dname == "bf16" and Q in (1, 4) and ctx == 8192:
                yield Scenario(what + ", softcap", dname, call(dtype, softcap=30.0, **shape))
                yield Scenario(what + ", lse", dname, call(dtype, return_lse=True, **shape))
                yield Scenario(what + ", block size 37", dname, call(dtype, block_size=37, **shape))
                out = _meta((B * Q * d["Hq"] * D + 1,), dtype)[1:].view(B, Q, d["Hq"], D)
                yield Scenario(what + ", out at an unaligned offset", dname, call(dtype, out=out, **shape))


def _down_proj_scenarios() -> Iterator[Scenario]:
    def call(dtype, T, Hb, Hd, ids=torch.int64, out=False):
        o = _meta((T, Hd), dtype) if out else None
        return lambda: g.fused_concat_down_proj(_meta((T,), ids), _meta((VOCAB, Hb), dtype), _meta((T, Hb), dtype),
                                                _meta((Hd, 2 * Hb), dtype), embed_scale=Hb ** 0.5, out=o,
                                                backend="triton")

    for (dname, dtype), (name, d), T in itertools.product(DTYPES.items(), DRAFTERS.items(), TOKENS):
        what = f"down_proj {dname} {name} T={T}"
        yield Scenario(what, dname, call(dtype, T, d["Hb"], d["Hd"]))
        if dname == "bf16":
            yield Scenario(what + ", int32 ids, out given", dname, call(dtype, T, d["Hb"], d["Hd"], torch.int32, True))


def _centroid_scenarios() -> Iterator[Scenario]:
    def call(dtype, T, d, output, order=torch.int64, k=1):
        C, V, Hd = d["centroids"], d["vocab"], d["Hd"]
        fill = -1e30 if output == "dense" else None
        return lambda: g.centroid_logits(_meta((T, Hd), dtype), _meta((C, Hd), dtype), _meta((V,), order),
                                         _meta((V, Hd), dtype), top_k=d["top_k"], output=output, fill_value=fill,
                                         k=k, backend="triton")

    # topk: a tree level's branching (2) and the most a call may ask (16; one token, token-major, and 64,
    # cluster-major), in the drafters' dtype (its selection is integer code: the other dtypes change only what
    # the argmax launches compile too)
    outputs = (("argmax", 1), ("sparse", 1), ("dense", 1), ("topk", 2), ("topk", 16))
    for (dname, dtype), (name, d), T, (output, k) in itertools.product(DTYPES.items(), DRAFTERS.items(), TOKENS[:3],
                                                                       outputs):
        if d["centroids"] is None or (output == "topk" and (dname != "bf16" or (k == 16 and T == 8))):
            continue
        what = f"centroid {dname} {name} T={T} {output}" + (f" k={k}" if output == "topk" else "")
        yield Scenario(what, dname, call(dtype, T, d, output, k=k))
        if dname == "bf16":
            yield Scenario(what + ", int32 ordering", dname, call(dtype, T, d, output, torch.int32))


def _tree_verify_scenarios() -> Iterator[Scenario]:
    def call(dtype, B, N, kind):
        logits = _meta((B, N, VOCAB), dtype)
        kw = {}
        if kind == "temperature 0":  # all greedy, said with a float: the public op makes it a greedy call
            kw = dict(temperature=0.0)
        elif kind == "sampling":
            kw = dict(temperature=0.8, uniforms=_meta((B, N, 2), torch.float32))
        elif kind == "mixed rows":
            kw = dict(temperature=_meta((B,), torch.float32), uniforms=_meta((B, N, 2), torch.float32))
        elif kind.startswith("draft_probs"):
            q = torch.float32 if kind.endswith("fp32") else dtype
            kw = dict(temperature=1.0, uniforms=_meta((B, N, 2), torch.float32), draft_probs=_meta((B, N, VOCAB), q))
        return lambda: g.tree_verify(_meta((B, N), torch.int64), _meta((B, N), torch.int32), logits,
                                     backend="triton", **kw)

    kinds = ("greedy", "temperature 0", "sampling", "mixed rows", "draft_probs", "draft_probs fp32")
    for (dname, dtype), B, N, kind in itertools.product(DTYPES.items(), BATCHES, TREE_NODES, kinds):
        yield Scenario(f"tree_verify {dname} B={B} N={N} {kind}", dname, call(dtype, B, N, kind))


def _softmax_sample_scenarios() -> Iterator[Scenario]:
    """Logits of every dtype (the drafter heads give fp32), a small vocabulary (one chunk) and the real
    one, q into a fresh tensor and into one depth of a [B, N, V] buffer (rows strided)."""
    def call(dtype, B, V, into_depth):
        def run():
            probs = _meta((B, 5, V), torch.float32)[:, 1] if into_depth else None
            return g.softmax_sample(_meta((B, V), dtype), _meta((B,), torch.float32),
                                    _meta((B, 4), torch.float64)[:, 2], probs_out=probs, backend="triton")
        return run

    for (dname, dtype), B, V, into_depth in itertools.product(DTYPES.items(), BATCHES, (1000, VOCAB), (False, True)):
        yield Scenario(f"softmax_sample {dname} B={B} V={V}{' into a depth' if into_depth else ''}", dname,
                       call(dtype, B, V, into_depth))


def _adapter_scenarios() -> Iterator[Scenario]:
    """The layouts the engine adapters hand the ops: vLLM's layer caches (the 0.33 page layout and the
    earlier [blocks, 2, bs, Hkv, D] one) through adapters.vllm.attention, and Hugging Face's [B, H, S, D]
    shared K/V seen as pages of one entry plus its split `inputs_embeds` (gemma4_mtp.hf)."""
    import types

    from ..adapters import vllm

    try:  # the decode-loop package ships beside the kernels; an install of the kernels alone lacks it
        from gemma4_mtp import hf
        from gemma4_mtp.config import FULL, SLIDING
    except ImportError:
        hf = None

    def vllm_call(dtype, kv, B, Q, Hq, D, window, blocks):
        return lambda: vllm.attention(_meta((B * Q, Hq * D), dtype), kv, _meta((B, blocks), torch.int32),
                                      _meta((B,), torch.int32), num_heads=Hq, head_size=D, sliding_window=window,
                                      queries_per_request=Q, backend="triton")

    def hf_call(dtype, B, Hq, Hkv, D, S, layer, window):
        def call():
            paged = hf._paged_kv({layer: (_meta((B, Hkv, S, D), dtype), _meta((B, Hkv, S, D), dtype))}, layer, B,
                                 None, types.SimpleNamespace(sliding_window=window), torch.device("meta"))
            return g.q_only_paged_attention(_meta((B, 1, Hq, D), dtype), paged.k_cache, paged.v_cache,
                                            paged.block_table, paged.seq_lens, window=None, backend="triton")
        return call

    for (dname, dtype), (name, d), layer in itertools.product(DTYPES.items(), DRAFTERS.items(), ("swa", "full")):
        D, Hkv, Hq, bs = d[f"D_{layer}"], d[f"Hkv_{layer}"], d["Hq"], 16
        window = d["window"] if layer == "swa" else None
        for B, Q in itertools.product(BATCHES, (1, 4)):
            blocks = 8192 // bs
            for layout, kv in (("0.33", _meta((B * blocks, Hkv, bs, 2 * D), dtype)),
                               ("blocks-2", _meta((B * blocks, 2, bs, Hkv, D), dtype))):
                yield Scenario(f"vllm attention {dname} {name} {layer} B={B} Q={Q} layout {layout}", dname,
                               vllm_call(dtype, kv, B, Q, Hq, D, window, blocks))
        if hf is not None:
            hf_layer = SLIDING if layer == "swa" else FULL
            for S in (37, 2048):
                yield Scenario(f"hf attention {dname} {name} {layer} S={S}", dname,
                               hf_call(dtype, 1, Hq, Hkv, D, S, hf_layer, d["window"]))
    for (dname, dtype), (name, d), T in itertools.product(DTYPES.items(), DRAFTERS.items(), (1, 7)):
        flat = _meta((T, 2 * d["Hb"]), dtype)  # HF's concatenated inputs_embeds, split into row views
        yield Scenario(f"hf pre-projection {dname} {name} T={T}", dname,
                       lambda flat=flat, d=d, dtype=dtype, T=T: g.fused_concat_down_proj(
                           torch.arange(T, device="meta"), flat[:, :d["Hb"]], flat[:, d["Hb"]:],
                           _meta((d["Hd"], 2 * d["Hb"]), dtype), embed_scale=1.0, backend="triton"))


def _prologue(dtype, T, H, kind):
    """Prologue keyword arguments of the fused glue ops: "none", "norm" (the first layer's input
    norm), "layer" (post-norm + residual add + pre-norm, h written out), "scaled" (and the layer
    scalar: a layer boundary)."""
    if kind == "none":
        return {}
    kw = dict(norm_weight=_meta((H,), dtype), eps=1e-6)
    if kind in ("layer", "scaled"):
        kw.update(residual=_meta((T, H), dtype), residual_norm_weight=_meta((H,), dtype),
                  residual_out=_meta((T, H), dtype))
    if kind == "scaled":
        kw["layer_scalar"] = _meta((1,), dtype)
    return kw


def _glue_scenarios() -> Iterator[Scenario]:
    """The fused glue ops at every projection of the real drafters: q (sliding and full head dims,
    first layer and layer boundary, tree levels sharing a position), o_proj and down_proj (split-K),
    gate/up, the whole MLP (gate/up with down_proj), post_projection (final norm written out), and the
    dense LM head (top-k and dense)."""
    for (dname, dtype), (name, d), T in itertools.product(DTYPES.items(), DRAFTERS.items(), (1, 8, 64)):
        Hd, Hq = d["Hd"], d["Hq"]
        kinds = ("norm", "scaled") if dname == "bf16" else ("scaled",)
        for D, kind in itertools.product((d["D_swa"], d["D_full"]), kinds):
            def q(D=D, kind=kind, Q=1, pos=torch.int64):
                return lambda: g.rms_norm_q_rope(_meta((T, Hd), dtype), _meta((Hq * D, Hd), dtype), _meta((D,), dtype),
                                                 _meta((T // Q,), pos), _meta((D // 2,), torch.float32),
                                                 backend="triton", **_prologue(dtype, T, Hd, kind))
            yield Scenario(f"q_rope {dname} {name} T={T} D={D} {kind}", dname, q())
            if dname == "bf16" and T == 8:
                yield Scenario(f"q_rope {dname} {name} T={T} D={D} {kind}, 4 queries per position, int32",
                               dname, q(Q=4, pos=torch.int32))
            K = Hq * D
            yield Scenario(f"linear (o_proj) {dname} {name} T={T} K={K}", dname,
                           lambda K=K: g.rms_norm_linear(_meta((T, K), dtype), _meta((Hd, K), dtype), backend="triton"))
        yield Scenario(f"linear (down_proj) {dname} {name} T={T}", dname,
                       lambda: g.rms_norm_linear(_meta((T, d["inter"]), dtype), _meta((Hd, d["inter"]), dtype),
                                                 backend="triton"))
        for kind in kinds:
            yield Scenario(f"gate_up {dname} {name} T={T} {kind}", dname,
                           lambda kind=kind: g.rms_norm_gate_up(_meta((T, Hd), dtype), _meta((d["inter"], Hd), dtype),
                                                                _meta((d["inter"], Hd), dtype), backend="triton",
                                                                **_prologue(dtype, T, Hd, kind)))
            yield Scenario(f"mlp {dname} {name} T={T} {kind}", dname,  # one launch at T = 1, two above 4
                           lambda kind=kind: g.rms_norm_gate_up(_meta((T, Hd), dtype), _meta((d["inter"], Hd), dtype),
                                                                _meta((d["inter"], Hd), dtype),
                                                                down_weight=_meta((Hd, d["inter"]), dtype),
                                                                backend="triton", **_prologue(dtype, T, Hd, kind)))
        post = _prologue(dtype, T, Hd, "scaled")
        post.update(residual_out=None, normed_out=_meta((T, Hd), dtype))
        yield Scenario(f"linear (post_projection) {dname} {name} T={T}", dname,
                       lambda post=post: g.rms_norm_linear(_meta((T, Hd), dtype), _meta((d["Hb"], Hd), dtype),
                                                           backend="triton", **post))
        if d["centroids"] is None:
            for output, k in (("topk", 1), ("topk", 2), ("topk", 8), ("dense", 1)):
                yield Scenario(f"lm_head {dname} {name} T={T} {output} k={k}", dname,
                               lambda output=output, k=k: g.dense_lm_head(_meta((T, Hd), dtype),
                                                                          _meta((d["vocab"], Hd), dtype),
                                                                          output=output, k=k, backend="triton"))
    # the one-launch MLP with more down_proj rows than one tile (no real drafter's: E2B / E4B have 256)
    yield Scenario("mlp bf16 T=3 I=1024 N=1024, down_proj in four tiles", "bf16",
                   lambda: g.rms_norm_gate_up(_meta((3, 256), torch.bfloat16), _meta((1024, 256), torch.bfloat16),
                                              _meta((1024, 256), torch.bfloat16),
                                              down_weight=_meta((1024, 1024), torch.bfloat16), backend="triton",
                                              **_prologue(torch.bfloat16, 3, 256, "scaled")))
    yield Scenario("lm_head bf16 31B T=1 topk k=16", "bf16",
                   lambda: g.dense_lm_head(_meta((1, 1024), torch.bfloat16), _meta((VOCAB, 1024), torch.bfloat16),
                                           k=16, backend="triton"))


def _step_scenarios() -> Iterator[Scenario]:
    """The product path: a whole greedy draft step (`Gemma4MTPDrafter.step_top_tokens`: `step` + `top_tokens`)
    or sampled one (`step_sample_tokens`: `step` + `sample_tokens`) of each real drafter (every weight, cache
    and activation a meta tensor) for chain steps and tree levels, as `graphs.draft_tree` calls them, so that
    what is compiled is what the decode loop launches. Needs the gemma4_mtp package (python_api/) importable."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context

    def inputs(name, B, Q):
        """(drafter, its meta context, token ids, hidden states) of one step."""
        drafter = random_drafter(name, device="meta", backend="triton")
        Hb = drafter.config.backbone_hidden_size
        return (drafter, synthetic_context(drafter, B, 8192, device="meta"), _meta((B, Q), torch.int64),
                _meta((B, Q, Hb), torch.bfloat16))

    def top(name, B, Q, k):
        drafter, *args = inputs(name, B, Q)
        return drafter.step_top_tokens(*args, k)

    def sample(name, B):
        """A sampled token per request (graphs.DraftSampling), q into one depth of a [B, 5, V] buffer."""
        drafter, *args = inputs(name, B, 1)
        V = drafter.config.text.vocab_size
        return drafter.step_sample_tokens(*args, _meta((B,), torch.float32), _meta((B, 4), torch.float64)[:, 0],
                                          _meta((B, 5, V), torch.float32)[:, 0])

    for name, B, Q, k in itertools.product(DRAFTERS, (1, 8, 32), (1, 2), (1, 2)):
        yield Scenario(f"drafter step bf16 {name} B={B} Q={Q} top {k}", "bf16",
                       lambda name=name, B=B, Q=Q, k=k: top(name, B, Q, k))
    for name, B in itertools.product(DRAFTERS, (1, 8, 32)):  # a sampled chain step
        yield Scenario(f"drafter step bf16 {name} B={B} Q=1 sampled", "bf16", lambda name=name, B=B: sample(name, B))
    for name in DRAFTERS:  # bench_drafter_step's triton_pdl_at_exit: the B = 1 step, next kernels triggered at exit
        def late(name=name):  # (and a sampled token: any step kernel can run with the flag off)
            with mock.patch.object(_common, "PDL_EARLY_TRIGGER", False):
                sample(name, 1)
                return top(name, 1, 1, 1)
        yield Scenario(f"drafter step bf16 {name} B=1 Q=1 top 1, PDL trigger at exit", "bf16", late)


# What a decode's batch size and context sweep over: an engine's batch moves one request at a time, the
# attended length (the block table's width) grows with the context.
SWEEP_BATCHES = tuple(range(1, 17))
SWEEP_CONTEXTS = (1000, 3000, 8192, 20000, 70000)


def step_compiles(name: str, batches=SWEEP_BATCHES, contexts=SWEEP_CONTEXTS, sms: int = 132, arch: int = 90
                  ) -> dict[str, int]:
    """Distinct compiles per kernel that greedy chain steps (`step_top_tokens(..., 1)`) of drafter `name`
    make over every (batch size, context length) pair: what a GPU process JIT-compiles (a second or
    two each, on the decode's critical path) as its batch and context move. Needs gemma4_mtp."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context

    drafter = random_drafter(name, device="meta", backend="triton")
    Hb = drafter.config.backbone_hidden_size
    keys: dict[str, set] = {}
    for B, length in itertools.product(batches, contexts):
        ctx = synthetic_context(drafter, B, length, device="meta")
        with recording(sms, arch) as recorded:
            drafter.step_top_tokens(ctx, _meta((B, 1), torch.int64), _meta((B, 1, Hb), torch.bfloat16), 1)
        for rec in recorded:
            keys.setdefault(rec.kernel.__name__, set()).add(rec.key)
    return {k: len(v) for k, v in sorted(keys.items())}


def scenarios() -> Iterator[Scenario]:
    yield from _down_proj_scenarios()
    yield from _attention_scenarios()
    yield from _centroid_scenarios()
    yield from _tree_verify_scenarios()
    yield from _softmax_sample_scenarios()
    yield from _adapter_scenarios()
    yield from _glue_scenarios()
    yield from _step_scenarios()


def defined_kernels() -> set[str]:
    """Every Triton kernel of the package: a module-level @triton.jit function that its module launches
    (`name[grid](...)`); jit functions only called from kernels are device helpers."""
    import importlib
    import inspect
    import pkgutil

    from triton.runtime.jit import JITFunction

    from .. import triton as package

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        source = inspect.getsource(module)
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction) and obj.__module__ == module.__name__ \
                    and re.search(rf"\b{re.escape(name)}\[", source):
                names.add(name)
    return names


def launches(gpus=GPUS) -> list[Launch]:
    """Every distinct launch (one per compile) the scenarios make on the GPUs `gpus` names (architecture ->
    SM counts); a launch is compiled for the architectures that make it (e.g. the programmatic dependent
    launches (`_common.pdl_args`) only for sm_90)."""
    seen: dict[tuple, Launch] = {}
    for arch, sms in ((arch, sms) for arch, counts in gpus.items() for sms in counts):
        for sc in scenarios():
            with recording(sms, arch) as recorded:
                sc.call()
            if not recorded:
                raise AssertionError(f"scenario {sc.name!r} launched no Triton kernel")
            for rec in recorded:
                first = seen.setdefault(rec.key, Launch(f"{sc.name} ({sms} SMs)", rec, sc.dtype, ()))
                if arch not in first.archs:
                    seen[rec.key] = first._replace(archs=first.archs + (arch,))
    return list(seen.values())


# A stack frame of one 8-byte slot and no local memory is allowed: ptxas saving a predicate around a
# convergence point, one store and one load per thread. Seen only with Triton 3.6 on sm_80, attention
# at D 256 with an `out` at an unaligned offset (168 registers); removing it takes a register cap of 176,
# which drops that launch from 3 to 2 CTAs per SM on an A100. Anything more is a spill.
STACK_SLOT_BYTES = 8
# Largest shared memory one block may use (opt-in), per architecture.
SHARED_LIMIT = {80: 166912, 90: 232448}


# A PTX instruction that touches global (or generic) memory: loads, stores, atomics, reductions, async
# copies and prefetches whose state space is not param / shared / local / const. An L2 prefetch of global
# memory (prefetch.global.L2, `_common.prefetch_weight_rows`) may come first: it moves nothing into the
# SM, and the loads after the wait read L2, where the previous kernel's writes are.
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:ld|st|atom|red|cp\.async|prefetch)\."
                            r"(?!param|shared|local|const|global\.L2\s)", re.MULTILINE)


def pdl_problem(ptx: str) -> str | None:
    """What is wrong with a kernel launched with programmatic dependent launch: it runs while the
    kernel before it still writes, so nothing may touch global memory before griddepcontrol.wait."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return "launched with launch_pdl but never waits (griddepcontrol.wait)"
    early = _GLOBAL_ACCESS.search(ptx, 0, wait)
    if early:
        return f"touches global memory before griddepcontrol.wait: {early.group(0).strip()}"
    return None


def _row(launch: Launch, arch: int) -> dict:
    """What a report row says of the launch before anything is compiled."""
    rec = launch.launch
    names = [p.name for p in rec.kernel.params]
    constexprs = {names[path[0]]: v if isinstance(v, (bool, int, float, str)) else str(v)
                  for path, v in rec.constexprs.items() if v is not None}
    return dict(name=launch.name, kernel=launch.kernel.__name__, arch=f"sm_{arch}", dtype=launch.dtype,
                num_warps=rec.options.get("num_warps", 4), num_stages=rec.options.get("num_stages", 3),
                signature={k: v for k, v in rec.signature.items() if v != "constexpr"}, constexprs=constexprs,
                none_args=[names[path[0]] for path, v in rec.constexprs.items() if v is None],
                pdl=bool(rec.options.get("launch_pdl")), problems=[])


def _does_not_compile(row: dict, error: Exception) -> dict:
    """The row with the compiler's error (on one line, cut) as its problem."""
    detail = " ".join(str(error).split())
    row["problems"].append(f"does not compile ({type(error).__name__}): {detail[:600]}")
    return row


def _compile_row(launch: Launch, arch: int) -> dict:
    rec = launch.launch
    row = dict(_row(launch, arch), stage="cubin", registers=0, shared_bytes=0, local_bytes=0, stack_bytes=0)
    constexprs = row["constexprs"]
    try:
        compiled, res = compile_launch(launch, arch)
    except Exception as e:  # a launch that does not compile fails on the first GPU: report, keep going
        return _does_not_compile(row, e)
    row.update(res._asdict())
    if (res.local_bytes or res.stack_bytes > STACK_SLOT_BYTES) and launch.dtype != "fp32":
        row["problems"].append(f"spills: {res.local_bytes} B local, {res.stack_bytes} B stack per thread")
    if res.shared_bytes > SHARED_LIMIT[arch]:
        row["problems"].append(f"shared memory {res.shared_bytes} B > {SHARED_LIMIT[arch]} B")
    if row["pdl"] and (problem := pdl_problem(compiled.asm["ptx"])):
        row["problems"].append(problem)
    ptx = compiled.asm["ptx"]
    row["pdl_early_trigger"] = "griddepcontrol.launch_dependents" in ptx
    # L2 prefetches of the weight rows before the wait (`_common.prefetch_weight_rows`)
    row["prefetches_before_wait"] = ptx[:max(0, ptx.find("griddepcontrol.wait"))].count("prefetch.global.L2")
    # the decode steps' split-K, and the one-launch MLP's last level (the group sums)
    if arch == 90 and (constexprs.get("SPLIT") or row["kernel"] == "_mlp_kernel") and rec.options.get("maxnreg"):
        row["split_load_waves"] = load_waves_after_election(sass(compiled.asm["cubin"]), "FADD")
        if row["split_load_waves"] != 1:
            row["problems"].append(f"the split-K epilogue loads its partials in {row['split_load_waves']} dependent "
                                   "waves (one L2 round trip each) where sum_splits issues a group at once")
    if arch == 90 and row["kernel"] == "_attn_kernel" and constexprs.get("MERGE"):
        row["merge_load_waves"] = load_waves_after_election(sass(compiled.asm["cubin"]), "BAR.SYNC")
        if row["merge_load_waves"] != 1:
            row["problems"].append(f"the in-kernel merge loads its lse and partials in {row['merge_load_waves']} "
                                   "dependent waves where one suffices")
    if arch == 90 and row["kernel"] == "_q_rope_kernel":
        row["elected_instructions"] = instructions_after_election(sass(compiled.asm["cubin"]))
        if constexprs.get("EPI_T") == 1 and row["elected_instructions"] > Q_ROPE_ONE_TOKEN_TAIL:
            row["problems"].append(f"the one-token q_norm + RoPE epilogue runs {row['elected_instructions']} "
                                   f"instructions after the election (> {Q_ROPE_ONE_TOKEN_TAIL})")
    return row


# torch.compile (inductor, torch 2.11) launches a user Triton kernel with its Python float arguments typed
# fp64, where Triton's own launcher types them fp32: on the H200 (2026-12-04) a compiled step's fp64
# softmax scale made the attention's probabilities fp64, which tl.dot refused. The kernels cast their float
# scalars to fp32 before any use, so each specialisation of a kernel with float scalars is checked that way
# (on sm_90, the type rules are the same on sm_80) in Triton's front end only: it must lower to TTIR, and
# there each fp64 parameter may only be truncated to fp32. What follows the casts is then the fp32
# launch's own IR, which `_compile_row` compiles to a cubin (a full compile of each fp64 twin as well cost
# a quarter of the CI's compile time and could find nothing more).
INDUCTOR_FLOAT = "fp64"


def inductor_launches(recorded: list[Launch]) -> list[Launch]:
    """One launch per (kernel, constexprs, options) with float scalars, its fp32 scalars typed fp64."""
    seen: dict[tuple, Launch] = {}
    for launch in recorded:
        rec = launch.launch
        if "fp32" not in rec.signature.values() or 90 not in launch.archs:
            continue
        key = (rec.kernel.__module__, rec.kernel.__name__, rec.key[3], rec.key[5])
        sig = {k: INDUCTOR_FLOAT if v == "fp32" else v for k, v in rec.signature.items()}
        seen.setdefault(key, launch._replace(name=f"{launch.name} [float scalars {INDUCTOR_FLOAT}, as torch.compile]",
                                             launch=rec._replace(signature=sig), archs=(90,)))
    return list(seen.values())


def front_end(launch: Launch, arch: int) -> str:
    """The launch's Triton IR after Triton's TTIR passes (the AST lowered for `arch`; no GPU stage runs)."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    rec = launch.launch
    src = ASTSource(rec.kernel, rec.signature, rec.constexprs, rec.attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options(dict(rec.options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages = {}
    backend.add_stages(stages, options, src.language)
    return str(stages["ttir"](module, {}))


_F64_PARAM = re.compile(r"%(\w+): f64\b")


def uncast_float_scalars(ttir: str) -> list[str]:
    """The kernel's fp64 scalar parameters that its TTIR uses other than in `arith.truncf %p : f64 to f32`."""
    signature, _, body = ttir.partition("tt.func public @")[2].partition("\n")
    bad = []
    for name in _F64_PARAM.findall(signature):
        uses = [line for line in body.splitlines() if re.search(rf"%{name}(?![\w])", line)]
        if any(not re.search(rf"= arith\.truncf %{name} : f64 to f32\b", line) for line in uses):
            bad.append(name)
    return bad


def _front_end_row(launch: Launch, arch: int) -> dict:
    row = dict(_row(launch, arch), stage="ttir")
    try:
        ttir = front_end(launch, arch)
    except Exception as e:  # what torch.compile's launch would fail on
        return _does_not_compile(row, e)
    if uncast := uncast_float_scalars(ttir):
        row["problems"].append(f"uses its {INDUCTOR_FLOAT} scalars {uncast} other than to cast them to fp32: "
                               "torch.compile's launch computes in fp64")
    return row


def step_sass(name: str, B: int = 1, ctx: int = 8192, arch: int = 90, sms: int = 132) -> list[dict]:
    """The launches of one chain step + `top_tokens(last, 1)` of drafter `name`, in launch order, with what
    their SASS for `arch` says of each as a latency chain: instructions, barriers (bar.sync), global
    loads, and the instructions the elected program runs alone after the last atomic (0: no election).
    Needs gemma4_mtp; no GPU."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context

    drafter = random_drafter(name, device="meta", backend="triton")
    context = synthetic_context(drafter, B, ctx, device="meta")
    Hb = drafter.config.backbone_hidden_size
    with recording(sms, arch) as recorded:
        last, _ = drafter.step(context, _meta((B, 1), torch.int64), _meta((B, 1, Hb), torch.bfloat16))
        drafter.top_tokens(last, 1)
    rows, seen = [], {}
    for rec in recorded:
        if rec.key not in seen:
            compiled, res = compile_launch(Launch(name, rec, "bf16", (arch,)), arch)
            code = sass(compiled.asm["cubin"])
            instructions = _INSTRUCTION.findall(code)
            seen[rec.key] = dict(registers=res.registers, instructions=len(instructions),
                                 barriers=sum("BAR.SYNC" in x for x in instructions),
                                 global_loads=sum("LDG" in x for x in instructions),
                                 after_election=instructions_after_election(code) if "ATOMG" in code else 0)
        rows.append(dict(kernel=rec.kernel.__name__, grid=tuple(rec.grid), **seen[rec.key]))
    return rows


def _jit_function(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def _run_job(job: tuple) -> dict:
    row, launch, arch = job
    return row(launch, arch)


def report(archs=ARCHS, jobs: int = 1) -> list[dict]:
    """Every recorded launch compiled for each of `archs` that makes it (rows of stage "cubin"), and on sm_90
    each specialisation with float scalars once more as torch.compile types them (stage "ttir": the front
    end only, see INDUCTOR_FLOAT): resources, and what is wrong (does not compile, spills in bf16/fp16, more
    shared memory than a block may have, a programmatic dependent launch that touches global memory before
    it waits for the kernel before it, fp64 arithmetic under torch.compile). The launches are recorded
    once; `jobs` processes compile them."""
    recorded = launches()
    work = [(_compile_row, launch, arch) for launch in recorded for arch in archs if arch in launch.archs]
    if 90 in archs:
        work += [(_front_end_row, launch, 90) for launch in inductor_launches(recorded)]
    if jobs <= 1:
        return [_run_job(job) for job in work]
    import copyreg
    import multiprocessing

    from triton.runtime.jit import JITFunction

    # a launch travels to a worker with its kernel named (module, function), not pickled whole
    copyreg.pickle(JITFunction, lambda f: (_jit_function, (f.__module__, f.__name__)))
    # spawn, not fork: the workers compile in fresh processes, not in a copy of one that ran torch
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(_run_job, work, chunksize=1)


if __name__ == "__main__":
    import argparse
    import json
    import sys

    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the AOT compile needs the real @triton.jit kernels")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=ARCHS,
                        help="compile for this SM architecture only (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    parser.add_argument("--kernels", action="store_true", help="list the package's Triton kernels instead")
    parser.add_argument("--step-compiles", action="store_true",
                        help="instead, the distinct compiles per kernel of each drafter's chain steps over "
                             "batch sizes 1-16 and five context lengths (no compile)")
    args = parser.parse_args()
    if args.kernels:
        result = sorted(defined_kernels())
    elif args.step_compiles:
        result = {name: step_compiles(name) for name in DRAFTERS}
    else:
        result = report(tuple(args.arch or ARCHS), args.jobs)
    json.dump(result, sys.stdout, indent=1)
