"""The whole drafter step in one host call (csrc/ops/drafter_step.cu, what backend="cuda" runs for
`Gemma4MTPDrafter.step` on a GPU) on the CPU: the composition, the host-side launchers of csrc/ops it
calls and the kernels they launch, compiled with g++ against tests/cuda_emulator under
AddressSanitizer, against the same step composed of the PyTorch reference ops (backend="torch").

A random drafter at small shapes (3 sliding layers and a full one of different head dims and KV
heads, a window shorter than the context, released blocks in the sliding tables, requests of
different lengths, tree levels of Q queries a request); tensors go through a directory
(tests/cuda_emulator/drafter_step_main.cpp), the workspace starts as NaN, every counter must be left
zero and every launch must use programmatic dependent launch on sm_90. fp32 (the CUDA-core kernels)
is held to the fp32 reference's accuracy; bf16 / fp16 (the tensor-core kernels) to twice the error of
the reference run in the same dtype, both against the fp32 reference.

With the LM head in the same call (`DrafterStepParams::head`, what `Gemma4MTPDrafter.step_top_tokens`
runs): the centroid head (argmax at k = 1, topk above) and the dense one (topk), each checked against
the fp64 oracle of its op's tests on the `last` the emulated step wrote (the head's input), ids and
scores poisoned before the launch. Sampled (`step_sample_tokens`): q against softmax(logits / temperature)
of the fp64 head on that `last` (-inf outside the centroid head's kept clusters), the tokens against q's
inverse CDF, q and the workspace poisoned."""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import emulated
from gemma4_mtp.drafter import random_drafter, synthetic_context
from gemma4_mtp.layers import to_dtype
import cases_centroid_logits
import cases_dense_lm_head
from helpers import SMALL_DRAFTER, assert_tolerance
from test_softmax_sample import assert_inverse_cdf

LENGTH = 70  # 5 blocks of 16: the sliding tables release the first two
LAYER_VECTORS = {"input_norm": 0, "post_attn_norm": 5, "pre_ff_norm": 6, "post_ff_norm": 10}
LAYER_MATRICES = {"q_proj": 1, "q_norm": 2, "inv_freq": 3, "o_proj": 4, "gate": 7, "up": 8, "down": 9,
                  "layer_scalar": 11}


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "drafter_step_main.cpp", "drafter_step")


CENTROID_DRAFTER = dict(SMALL_DRAFTER, centroids=8, top_k=2)  # 12 tokens a cluster, 24 candidates a token


def _inputs(dtype, B, Q, seed, shapes=SMALL_DRAFTER):
    drafter = random_drafter(shapes, dtype=torch.float32, backend="torch", seed=seed)
    ctx = synthetic_context(drafter, B, LENGTH, dtype=torch.float32, seed=seed)
    # requests of different lengths (the last one 3 positions shorter), their queries at the last one
    ctx.seq_lens = torch.tensor([LENGTH - 3 * (b % 2) for b in range(B)], dtype=torch.int32)
    ctx.positions = ctx.seq_lens.long() - 1
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, SMALL_DRAFTER["vocab"], (B, Q), generator=g)
    hidden = torch.randn(B, Q, SMALL_DRAFTER["Hb"], generator=g)
    return drafter, ctx, tokens, hidden


def _in_dtype(drafter, ctx, hidden, dtype):
    """The drafter, context and hidden states rounded to dtype (RoPE frequencies stay fp32)."""
    ctx = dataclasses.replace(ctx, k_cache={t: k.to(dtype) for t, k in ctx.k_cache.items()},
                              v_cache={t: v.to(dtype) for t, v in ctx.v_cache.items()},
                              embed_table=ctx.embed_table.to(dtype))
    return to_dtype(copy.deepcopy(drafter), dtype), ctx, hidden.to(dtype)


def _emulate(binary, tmp_path, drafter, ctx, tokens, hidden, *, sms, major, schedule, offset, tok64, head=None,
             k=1, sample=None):
    """The emulated step: (last, proj, info), with a head (..., ids [T, k], scores [T, k]), sampled (sample:
    (temperature [T], uniforms [T], probs' row stride)) (..., tokens [T], probs [T, V])."""
    cfg = drafter.config.text
    kinds = list(dict.fromkeys(cfg.layer_types))  # attention types in order of first use: kv index
    B, Q = tokens.shape
    dtype = hidden.dtype
    tensors = {"token_ids": tokens.reshape(-1).to(torch.int64 if tok64 else torch.int32),
               "hidden": hidden.reshape(B * Q, -1), "embed_table": ctx.embed_table,
               "pre_projection": drafter.pre_projection.weight, "final_norm": drafter.norm.weight,
               "post_projection": drafter.post_projection.weight, "seq_lens": ctx.seq_lens,
               "positions": ctx.positions}
    s = SMALL_DRAFTER
    args = [f"dtype={emulated.DTYPE_NAMES[dtype]}", f"B={B}", f"Q={Q}", f"Hb={s['Hb']}", f"Hd={s['Hd']}",
            f"Hq={s['Hq']}", f"V={s['vocab']}", f"I={s['inter']}", f"layers={cfg.num_layers}",
            "kinds=" + ",".join(str(kinds.index(t)) for t in cfg.layer_types), f"eps={cfg.rms_norm_eps}",
            f"embed_scale={ctx.embed_scale!r}", f"sms={sms}", f"major={major}", f"schedule={schedule}",
            f"offset={int(offset)}", f"tok64={int(tok64)}", "pos64=1"]
    for j, t in enumerate(kinds):
        kc, table = ctx.k_cache[t], ctx.block_table[t]
        tensors.update({f"k{j}": kc, f"v{j}": ctx.v_cache[t], f"block_table{j}": table})
        args += [f"D{j}={kc.shape[3]}", f"Hkv{j}={kc.shape[2]}", f"nb{j}={kc.shape[0]}", f"bs{j}={kc.shape[1]}",
                 f"mb{j}={table.shape[1]}", f"window{j}={ctx.window[t] or 0}"]
    for i in range(cfg.num_layers):
        w = drafter._layer_weights(i)
        for name, idx in {**LAYER_VECTORS, **LAYER_MATRICES}.items():
            tensors[f"l{i}_{name}"] = w[idx]
    if head is not None:
        args += [f"head={head}", f"k={k}"]
        tensors["lm_head"] = drafter.lm_head_weight
        if head == "centroid":
            c = drafter.config
            args += [f"C={c.num_centroids}", f"top_k={c.centroid_top_k}", "ord64=0"]
            tensors.update(centroids=drafter.centroids.weight, token_ordering=drafter.token_ordering.int())
        if sample is not None:
            args += ["sample=1", f"qs={sample[2]}"]
            tensors.update(temperature=sample[0], uniforms=sample[1])
    for f in tmp_path.glob("*.bin"):
        f.unlink()
    for name, t in tensors.items():
        emulated.write(tmp_path / f"{name}.bin", t.detach())
    info = emulated.run(binary, f"dir={tmp_path} " + " ".join(args))
    last = emulated.read(tmp_path / "last.bin", dtype, (B, Q, SMALL_DRAFTER["Hd"]))
    proj = emulated.read(tmp_path / "proj.bin", dtype, (B, Q, SMALL_DRAFTER["Hb"]))
    if head is None:
        return last, proj, info
    ids = emulated.read(tmp_path / "ids.bin", torch.int64, (B * Q, k))
    if sample is not None:
        return last, proj, info, ids.view(-1), emulated.read(tmp_path / "probs.bin", torch.float32,
                                                             (B * Q, SMALL_DRAFTER["vocab"]))
    scores = emulated.read(tmp_path / "scores.bin", torch.float32, (B * Q, k))
    return last, proj, info, ids, scores


CASES = [  # dtype, B, Q, sms, major, schedule, offset, tok64
    pytest.param(torch.float32, 2, 1, 8, 9, "rr", False, True, id="fp32-B2"),
    pytest.param(torch.bfloat16, 1, 1, 8, 9, "rr", False, True, id="bf16-B1"),
    pytest.param(torch.bfloat16, 2, 2, 4, 8, "ahead", True, False, id="bf16-B2-Q2-sm80-offset"),
    pytest.param(torch.float16, 3, 1, 132, 9, "behind", False, False, id="fp16-B3-132sms"),
    pytest.param(torch.bfloat16, 3, 2, 8, 9, "rr", False, False, id="bf16-B3-Q2"),  # 6 tokens: the MLP in two
]


@pytest.mark.parametrize("dtype,B,Q,sms,major,schedule,offset,tok64", CASES)
def test_one_call_step_matches_the_reference_step(binary, tmp_path, dtype, B, Q, sms, major, schedule, offset,
                                                  tok64):
    drafter, ctx, tokens, hidden = _inputs(dtype, B, Q, seed=B * 10 + Q)
    exact_last, exact_proj = drafter.step(ctx, tokens, hidden)
    d, c, h = (drafter, ctx, hidden) if dtype == torch.float32 else _in_dtype(drafter, ctx, hidden, dtype)
    last, proj, info = _emulate(binary, tmp_path, d, c, tokens, h, sms=sms, major=major, schedule=schedule,
                                offset=offset, tok64=tok64)
    # a layer: q_rope, attention (and a merge of its splits where it does not merge them itself), o_proj,
    # the MLP (one launch up to 4 tokens: glue_logic.h glue_mlp_one_launch, the small drafter's weights),
    # then + 2 (the pre- and post-projections)
    layers = drafter.config.text.num_layers
    per_layer = 4 if B * Q <= 4 else 5
    assert per_layer * layers + 2 <= int(info["launches"]) <= (per_layer + 1) * layers + 2, info
    if dtype == torch.float32:
        torch.testing.assert_close(last, exact_last, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(proj, exact_proj, atol=2e-5, rtol=2e-5)
        return
    ref_last, ref_proj = d.step(c, tokens, h)
    assert_tolerance(last, exact_last, ref_last, atol=1e-2, what="last")
    assert_tolerance(proj, exact_proj, ref_proj, atol=1e-2, what="proj")


HEAD_CASES = [  # head, dtype, B, Q, k, major
    pytest.param("centroid", torch.float32, 2, 1, 1, 9, id="centroid-argmax-fp32-B2"),
    pytest.param("centroid", torch.bfloat16, 2, 2, 3, 9, id="centroid-top3-bf16-B2-Q2"),
    pytest.param("dense", torch.bfloat16, 1, 1, 1, 9, id="dense-top1-bf16-B1"),
    pytest.param("dense", torch.float16, 3, 2, 4, 8, id="dense-top4-fp16-B3-Q2-sm80"),
]


def _head_after_step(binary, tmp_path, head, dtype, B, Q, seed, major, **kw):
    """The emulated step with its head (kw: _emulate's k, or sample), whose step outputs must be the step's
    alone (the head launches after them): (the drafter in dtype, last as [T, Hd], the head's launches, the
    head's outputs)."""
    shapes = CENTROID_DRAFTER if head == "centroid" else SMALL_DRAFTER
    drafter, ctx, tokens, hidden = _inputs(dtype, B, Q, seed=seed, shapes=shapes)
    d, c, h = (drafter, ctx, hidden) if dtype == torch.float32 else _in_dtype(drafter, ctx, hidden, dtype)
    run = functools.partial(_emulate, binary, tmp_path, d, c, tokens, h, sms=8, major=major, schedule="rr",
                            offset=False, tok64=True)
    last, proj, info, *out = run(head=head, **kw)
    last_alone, proj_alone, info_alone = run()
    assert torch.equal(last, last_alone) and torch.equal(proj, proj_alone)
    return d, last.reshape(B * Q, -1), int(info["launches"]) - int(info_alone["launches"]), out


@pytest.mark.parametrize("head,dtype,B,Q,k,major", HEAD_CASES)
def test_one_call_step_with_its_head(binary, tmp_path, head, dtype, B, Q, k, major):
    d, x, launches, (ids, scores) = _head_after_step(binary, tmp_path, head, dtype, B, Q, B * 10 + Q + k, major, k=k)
    # the centroid head: one cooperative launch; the dense one: its GEMV and the merge of its partials
    assert launches == (1 if head == "centroid" else 2), launches
    lm_head = d.lm_head_weight.detach()
    if head == "dense":
        cases_dense_lm_head.check_topk(x, lm_head, k, None, what="step head", call=lambda *_: (ids, scores))
        return
    centroids = d.centroids.weight.detach()
    _, order = cases_centroid_logits.exact_clusters(x, centroids, d.config.centroid_top_k)
    cases_centroid_logits.check_topk((ids, scores), (x, centroids, d.token_ordering, lm_head), order,
                                     cases_centroid_logits.tol(x, lm_head), "step head")


SAMPLED_CASES = [  # head, dtype, B, Q, major, probs' row stride past V
    pytest.param("centroid", torch.float32, 2, 1, 9, 0, id="centroid-fp32-B2"),
    pytest.param("centroid", torch.bfloat16, 2, 2, 8, 5, id="centroid-bf16-B2-Q2-sm80-strided"),
    pytest.param("dense", torch.bfloat16, 1, 1, 9, 0, id="dense-bf16-B1"),
    pytest.param("dense", torch.float16, 3, 1, 9, 3, id="dense-fp16-B3-strided"),
]


@pytest.mark.parametrize("head,dtype,B,Q,major,pad", SAMPLED_CASES)
def test_one_call_step_with_a_sampled_token(binary, tmp_path, head, dtype, B, Q, major, pad):
    """step_sample_tokens' one call: the head's dense logits into the workspace (the centroid head's launch
    filling them with -inf first), then softmax_sample; q against softmax(logits / temperature) of the fp64
    head on the `last` the step wrote, the tokens against q's inverse CDF at the uniforms."""
    T, V = B * Q, SMALL_DRAFTER["vocab"]
    g = torch.Generator().manual_seed(T)
    temperature = 0.5 + torch.rand(T, generator=g)
    uniforms = torch.rand(T, generator=g, dtype=torch.float64)
    d, x, launches, (drawn, probs) = _head_after_step(binary, tmp_path, head, dtype, B, Q, B * 10 + Q + 7, major,
                                                      sample=(temperature, uniforms, V + pad))
    # the head's dense logits in one launch (the centroid head's fill in it), softmax_sample's two
    assert launches == 3, launches
    x, lm_head = x.double(), d.lm_head_weight.detach().double()
    logits = x @ lm_head.T
    if head == "centroid":  # -inf outside the kept clusters' tokens
        C = d.config.num_centroids
        _, order = cases_centroid_logits.exact_clusters(x, d.centroids.weight.detach(), d.config.centroid_top_k)
        members = d.token_ordering.view(C, V // C)
        keep = torch.zeros(T, V, dtype=torch.bool)
        for t in range(T):
            keep[t, members[order[t]].reshape(-1)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    want = torch.softmax(logits / temperature.double()[:, None], dim=1)
    torch.testing.assert_close(probs.double(), want, rtol=1e-4, atol=1e-7)
    assert_inverse_cdf(drawn, probs, uniforms)
