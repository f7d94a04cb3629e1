"""Public-API validation (SPEC §3): each bad input raises the right error type, naming the argument."""
import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import BackendUnavailableError
from helpers import paged_kv

META = "meta"  # a second device on any machine


# ---- good inputs, one builder per op; each case changes one thing ---------------------------------

def fused(**change):
    a = dict(token_ids=torch.tensor([0, 9, 4]), embed_table=torch.randn(10, 8), hidden=torch.randn(3, 8),
             weight=torch.randn(4, 16), embed_scale=2.0)
    a.update(change)
    return lambda: g.fused_concat_down_proj(**a)


def attn(**change):
    k, v, table, lens = paged_kv([5, 9], 4, 2, 64)
    a = dict(q=torch.randn(2, 1, 4, 64), k_cache=k, v_cache=v, block_table=table, seq_lens=lens)
    a.update({key: (f(a) if callable(f) else f) for key, f in change.items()})
    return lambda: g.q_only_paged_attention(**a)


def centroid(**change):
    a = dict(hidden=torch.randn(3, 8), centroids=torch.randn(4, 8), token_ordering=torch.randperm(12),
             lm_head=torch.randn(12, 8), top_k=2)
    a.update(change)
    return lambda: g.centroid_logits(**a)


TREE_PARENTS = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, 1]], dtype=torch.int32)
CHAIN_PARENTS = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, -1]], dtype=torch.int32)


def tree(**change):
    a = dict(draft_tokens=torch.tensor([[1, 2, 3, 4], [0, 5, 10**6, 1]]), parents=TREE_PARENTS.clone(),
             target_logits=torch.randn(2, 4, 6))
    a.update(change)
    return lambda: g.tree_verify(**a)


def fused_in_place():
    hidden = torch.randn(3, 8)
    return fused(hidden=hidden, weight=torch.randn(8, 16), out=hidden)


def with_value(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def strided_last(t):
    """Same shape as t, stride 2 in the last dimension."""
    return torch.cat([t.unsqueeze(-1), t.unsqueeze(-1)], dim=-1)[..., 0]


def sampling(**change):
    return tree(**{"temperature": 1.0, "uniforms": torch.rand(2, 4, 2), **change})


def chain_probs(**change):
    a = dict(parents=CHAIN_PARENTS.clone(), temperature=1.0, uniforms=torch.rand(2, 4, 2),
             draft_probs=torch.softmax(torch.randn(2, 4, 6), -1))
    a.update(change)
    return tree(**a)


V, E, T = ValueError, TypeError, BackendUnavailableError

CASES = {
    # fused_concat_down_proj
    "fused-token_ids-rank": (fused(token_ids=torch.zeros(3, 1, dtype=torch.int64)), V, "token_ids"),
    "fused-token_ids-float": (fused(token_ids=torch.zeros(3)), E, "token_ids"),
    "fused-token_ids-count": (fused(token_ids=torch.zeros(4, dtype=torch.int64)), V, "token_ids"),
    "fused-token_ids-too-big": (fused(token_ids=torch.tensor([0, 10, 1])), V, "token_ids"),
    "fused-token_ids-negative": (fused(token_ids=torch.tensor([0, -1, 1])), V, "token_ids"),
    "fused-embed_table-width": (fused(embed_table=torch.randn(10, 7)), V, "embed_table"),
    "fused-embed_table-int": (fused(embed_table=torch.zeros(10, 8, dtype=torch.int32)), E, "embed_table"),
    "fused-weight-width": (fused(weight=torch.randn(4, 15)), V, "weight"),
    "fused-weight-dtype-mix": (fused(weight=torch.randn(4, 16, dtype=torch.float16)), E, "weight"),
    "fused-weight-device-mix": (fused(weight=torch.empty(4, 16, device=META)), V, "weight"),
    "fused-hidden-not-tensor": (fused(hidden=[[0.0] * 8] * 3), E, "hidden"),
    "fused-hidden-strided": (fused(hidden=strided_last(torch.randn(3, 8))), V, "hidden"),
    "fused-embed_scale-nan": (fused(embed_scale=float("nan")), V, "embed_scale"),
    "fused-embed_scale-str": (fused(embed_scale="39.25"), E, "embed_scale"),
    "fused-out-shape": (fused(out=torch.empty(3, 5)), V, "out"),
    "fused-out-dtype": (fused(out=torch.empty(3, 4, dtype=torch.bfloat16)), E, "out"),
    "fused-out-noncontiguous": (fused(out=torch.empty(4, 3).T), V, "out"),
    # the Triton kernel reads token_ids[t] at offset t
    "fused-token_ids-strided": (fused(token_ids=torch.tensor([0, 1, 9, 1, 4, 1])[::2]), V, "token_ids"),
    "fused-out-is-hidden": (fused_in_place(), V, "out"),
    "fused-backend-name": (fused(backend="cudnn"), V, "backend"),
    "fused-backend-cuda-on-cpu": (fused(backend="cuda"), T, "cuda"),
    # q_only_paged_attention
    "attn-q-rank": (attn(q=torch.randn(2, 4, 64)), V, "q"),
    "attn-q-no-heads": (attn(q=torch.randn(2, 1, 0, 64)), V, "q"),
    "attn-q-head-dim": (attn(q=torch.randn(2, 1, 4, 96)), V, "q"),
    "attn-k_cache-head-dim": (attn(q=torch.randn(2, 1, 4, 128)), V, "k_cache"),
    "attn-gqa-ratio": (attn(q=torch.randn(2, 1, 3, 64)), V, "k_cache"),
    "attn-v_cache-shape": (attn(v_cache=lambda a: a["v_cache"][:, :, :1]), V, "v_cache"),
    "attn-k_cache-dtype-mix": (attn(k_cache=lambda a: a["k_cache"].half()), E, "k_cache"),
    "attn-k_cache-device-mix": (attn(k_cache=lambda a: torch.empty_like(a["k_cache"], device=META)), V, "k_cache"),
    "attn-k_cache-block-size-zero": (attn(k_cache=lambda a: a["k_cache"][:, :0], v_cache=lambda a: a["v_cache"][:, :0],
                                          seq_lens=torch.zeros(2, dtype=torch.int32)), V, "k_cache"),
    "attn-k_cache-strided-D": (attn(k_cache=lambda a: strided_last(a["k_cache"])), V, "k_cache"),
    "attn-block_table-int64": (attn(block_table=lambda a: a["block_table"].long()), E, "block_table"),
    "attn-block_table-batch": (attn(block_table=lambda a: a["block_table"][:1]), V, "block_table"),
    "attn-block_table-id-too-big": (attn(block_table=lambda a: with_value(a["block_table"], (1, 1), 10**4)), V, "block_table"),
    "attn-block_table-id-negative": (attn(block_table=lambda a: with_value(a["block_table"], (0, 0), -1)), V, "block_table"),
    "attn-block_table-id-in-window": (attn(window=2, block_table=lambda a: with_value(a["block_table"], (1, 2), -3)), V, "block_table"),
    "attn-seq_lens-int64": (attn(seq_lens=lambda a: a["seq_lens"].long()), E, "seq_lens"),
    "attn-seq_lens-batch": (attn(seq_lens=torch.tensor([5], dtype=torch.int32)), V, "seq_lens"),
    "attn-seq_lens-negative": (attn(seq_lens=torch.tensor([5, -1], dtype=torch.int32)), V, "seq_lens"),
    "attn-seq_lens-too-long": (attn(seq_lens=lambda a: with_value(a["seq_lens"], 0, a["block_table"].shape[1] * 4 + 1)), V, "seq_lens"),
    "attn-seq_lens-strided": (attn(seq_lens=lambda a: torch.stack([a["seq_lens"]] * 2, 1)[:, 0]), V, "seq_lens"),
    "attn-out-is-q": (attn(out=lambda a: a["q"]), V, "out"),
    "attn-out-overlaps-k_cache": (attn(out=lambda a: a["k_cache"].reshape(-1)[:2 * 4 * 64].view(2, 1, 4, 64)), V, "out"),
    "attn-window-zero": (attn(window=0), V, "window"),
    "attn-window-float": (attn(window=2.5), E, "window"),
    "attn-softcap-zero": (attn(softcap=0.0), V, "softcap"),
    "attn-scale-inf": (attn(scale=float("inf")), V, "scale"),
    "attn-return_lse-int": (attn(return_lse=1), E, "return_lse"),
    "attn-out-shape": (attn(out=torch.empty(2, 1, 4, 32)), V, "out"),
    "attn-out-dtype": (attn(out=torch.empty(2, 1, 4, 64, dtype=torch.float16)), E, "out"),
    "attn-backend-cuda-on-cpu": (attn(backend="cuda"), T, "cuda"),
    # centroid_logits
    "centroid-hidden-rank": (centroid(hidden=torch.randn(3, 1, 8)), V, "hidden"),
    "centroid-centroids-width": (centroid(centroids=torch.randn(4, 7)), V, "centroids"),
    "centroid-centroids-device-mix": (centroid(centroids=torch.empty(4, 8, device=META)), V, "centroids"),
    "centroid-lm_head-rows": (centroid(lm_head=torch.randn(11, 8)), V, "lm_head"),
    "centroid-lm_head-dtype-mix": (centroid(lm_head=torch.randn(12, 8).bfloat16()), E, "lm_head"),
    "centroid-ordering-float": (centroid(token_ordering=torch.randperm(12).float()), E, "token_ordering"),
    "centroid-ordering-not-multiple": (centroid(token_ordering=torch.randperm(13), lm_head=torch.randn(13, 8)), V, "token_ordering"),
    "centroid-ordering-repeated": (centroid(token_ordering=with_value(torch.arange(12), 5, 4)), V, "token_ordering"),
    "centroid-ordering-out-of-range": (centroid(token_ordering=with_value(torch.arange(12), 5, 12)), V, "token_ordering"),
    "centroid-top_k-too-big": (centroid(top_k=5), V, "top_k"),
    "centroid-top_k-zero": (centroid(top_k=0), V, "top_k"),
    "centroid-output-name": (centroid(output="top_k"), V, "output"),
    # K = top_k * V / C = 2 * 3 = 6 candidates: k <= 6
    "centroid-k-above-candidates": (centroid(top_k=2, output="topk", k=7), V, "k"),
    "centroid-k-zero": (centroid(output="topk", k=0), V, "k"),
    "centroid-k-above-16": (centroid(token_ordering=torch.randperm(40), lm_head=torch.randn(40, 8), output="topk",
                                     k=17), V, "k"),
    "centroid-k-float": (centroid(output="topk", k=2.0), E, "k"),
    "centroid-k-not-topk": (centroid(k=2), V, "k"),
    "centroid-fill_value-not-dense": (centroid(fill_value=-1.0), V, "fill_value"),
    "centroid-fill_value-str": (centroid(output="dense", fill_value="-inf"), E, "fill_value"),
    "centroid-backend-cuda-on-cpu": (centroid(backend="cuda"), T, "cuda"),
    # tree_verify
    "tree-parents-root": (tree(parents=with_value(TREE_PARENTS, (1, 0), 0)), V, "parents"),
    "tree-parents-not-topological": (tree(parents=with_value(TREE_PARENTS, (0, 2), 3)), V, "parents"),
    "tree-parents-self": (tree(parents=with_value(TREE_PARENTS, (0, 1), 1)), V, "parents"),
    "tree-parents-below-minus-one": (tree(parents=with_value(TREE_PARENTS, (0, 3), -2)), V, "parents"),
    "tree-parents-child-of-padding": (tree(parents=with_value(TREE_PARENTS, (1, 3), 2)), V, "parents"),
    "tree-parents-int64": (tree(parents=TREE_PARENTS.long()), E, "parents"),
    "tree-parents-shape": (tree(parents=TREE_PARENTS[:, :3].contiguous()), V, "parents"),
    "tree-draft_tokens-shape": (tree(draft_tokens=torch.zeros(2, 5, dtype=torch.int64)), V, "draft_tokens"),
    "tree-draft_tokens-out-of-range": (tree(draft_tokens=torch.tensor([[1, 2, 6, 4], [0, 5, 0, 1]])), V, "draft_tokens"),
    "tree-draft_tokens-device-mix": (tree(draft_tokens=torch.empty(2, 4, dtype=torch.int64, device=META)), V, "draft_tokens"),
    "tree-target_logits-rank": (tree(target_logits=torch.randn(2, 4)), V, "target_logits"),
    "tree-target_logits-no-nodes": (tree(target_logits=torch.randn(2, 0, 6)), V, "target_logits"),
    "tree-uniforms-missing": (tree(temperature=0.5), V, "uniforms"),
    "tree-uniforms-missing-one-row": (tree(temperature=torch.tensor([0.0, 1.0])), V, "uniforms"),
    "tree-uniforms-shape": (sampling(uniforms=torch.rand(2, 4, 1)), V, "uniforms"),
    "tree-uniforms-one": (sampling(uniforms=with_value(torch.rand(2, 4, 2), (1, 2, 0), 1.0)), V, "uniforms"),
    "tree-uniforms-fp64": (sampling(uniforms=torch.rand(2, 4, 2, dtype=torch.float64)), E, "uniforms"),
    "tree-temperature-negative": (tree(temperature=-1.0), V, "temperature"),
    "tree-temperature-row-negative": (sampling(temperature=torch.tensor([1.0, -0.5])), V, "temperature"),
    "tree-temperature-length": (sampling(temperature=torch.ones(3)), V, "temperature"),
    "tree-temperature-row-inf": (sampling(temperature=torch.tensor([1.0, float("inf")])), V, "temperature"),
    "tree-temperature-overflows-logits": (sampling(temperature=1e-45), V, "temperature"),
    "tree-target_logits-nan-greedy": (tree(target_logits=with_value(torch.randn(2, 4, 6), (1, 3, 2), float("nan"))),
                                      V, "target_logits"),
    "tree-target_logits-row-all-minus-inf": (sampling(target_logits=with_value(torch.randn(2, 4, 6), (0, 2),
                                                                                float("-inf"))), V, "target_logits"),
    "tree-target_logits-plus-inf-sampling": (sampling(target_logits=with_value(torch.randn(2, 4, 6), (1, 0, 3),
                                                                                float("inf"))), V, "target_logits"),
    "tree-temperature-device-mix": (sampling(temperature=torch.ones(2, device=META)), V, "temperature"),
    "tree-uniforms-device-mix": (sampling(uniforms=torch.rand(2, 4, 2, device=META)), V, "uniforms"),
    "tree-temperature-fp64": (sampling(temperature=torch.ones(2, dtype=torch.float64)), E, "temperature"),
    "tree-draft_probs-on-tree": (chain_probs(parents=TREE_PARENTS.clone()), V, "draft_probs"),
    "tree-draft_probs-greedy": (chain_probs(temperature=None, uniforms=None), V, "draft_probs"),
    "tree-draft_probs-shape": (chain_probs(draft_probs=torch.rand(2, 4, 5)), V, "draft_probs"),
    "tree-backend-name": (tree(backend=None), V, "backend"),
    "tree-backend-cuda-on-cpu": (tree(backend="cuda"), T, "cuda"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case):
    call, error, name = CASES[case]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    if error is BackendUnavailableError:
        assert f"backend {name!r}" in message, message
    else:
        # "<op>: <argument> must be <expected>, got <given>"
        assert f": {name} must" in message, f"the message must name {name!r}: {message}"
        assert "got" in message, f"the message must say what was given: {message}"


def test_enough_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("call", [fused(embed_scale="39.25"), attn(window="8"), centroid(top_k="2"),
                                  centroid(output="dense", fill_value="-inf"), tree(temperature="1.0")])
def test_wrong_python_type_is_described(call):
    """A string where a number belongs is reported as a string, not printed as if it were a number."""
    with pytest.raises(TypeError, match="got str '"):
        call()


def test_cuda_on_cpu_says_what_is_missing():
    with pytest.raises(BackendUnavailableError) as info:
        fused(backend="cuda")()
    message = str(info.value)
    assert "extension" in message or "CUDA tensors" in message, message


# ---- inputs that look odd but are legal ----------------------------------------------------------

def test_garbage_outside_the_read_range_is_accepted():
    """Block-table entries past each request's last block and wholly before the window are never read."""
    k, v, table, lens = paged_kv([9, 13, 0], 4, 2, 64, window=6)
    q = torch.randn(3, 2, 4, 64)
    clean = table.clone()
    bad = table.clone()
    bad[0, 3:] = 10**6  # past the end of request 0 (3 blocks)
    bad[1, 0] = -(10**6)  # before the window of request 1 (keys 7..12: blocks 1..3)
    bad[2, :] = 77  # seq_len 0 reads nothing
    # paged_kv already leaves garbage there; make sure clean has valid ids where bad has garbage
    clean[clean < 0] = 0
    clean[clean >= k.shape[0]] = 0
    a = g.q_only_paged_attention(q, k, v, bad, lens, window=6, backend="torch")
    b = g.q_only_paged_attention(q, k, v, clean, lens, window=6, backend="torch")
    assert torch.equal(a, b)


def test_legal_tree_oddities_are_accepted():
    # garbage tokens in padding slots and at the root, greedy without uniforms, temperature 0 without uniforms
    tokens = torch.tensor([[-5, 2, 10**9, 3]])
    parents = torch.tensor([[-1, 0, -1, 1]], dtype=torch.int32)
    logits = torch.randn(1, 4, 6)
    for kw in ({}, {"temperature": 0.0}, {"temperature": torch.zeros(1)}):
        res = g.tree_verify(tokens, parents, logits, backend="torch", **kw)
        assert int(res.accept_len[0]) in (0, 1, 2)


def test_fill_value_zero_and_int_are_accepted():
    for fill in (0, 0.0, -3):
        dense = centroid(output="dense", fill_value=fill)()
        assert (dense == fill).any()


def test_out_beside_its_inputs_in_one_buffer_is_accepted():
    """Only real overlap is refused: out and hidden may be disjoint slices of one allocation."""
    buf = torch.randn(6, 8)
    hidden, out = buf[:3], buf[3:]
    args = (torch.tensor([0, 9, 4]), torch.randn(10, 8), hidden, torch.randn(8, 16))
    want = g.fused_concat_down_proj(*args, embed_scale=2.0)
    g.fused_concat_down_proj(*args, embed_scale=2.0, out=out)
    assert torch.equal(out, want)


def test_nan_and_inf_only_matter_in_used_rows():
    """Padding slots (never visited) may hold anything; a greedy row of all -inf is a tie (token 0)."""
    parents = torch.tensor([[-1, 0, -1]], dtype=torch.int32)
    logits = torch.randn(1, 3, 5)
    logits[0, 2] = float("nan")
    res = g.tree_verify(torch.tensor([[0, 1, 2]]), parents, logits, temperature=1.0, uniforms=torch.rand(1, 3, 2))
    assert int(res.output_tokens[0, 0]) >= 0
    res = g.tree_verify(torch.tensor([[0, 1, 2]]), parents, torch.full((1, 3, 5), float("-inf")))
    assert res.output_tokens[0].tolist() == [0, -1, -1]


def test_scalar_greedy_temperature_needs_no_uniforms_without_value_checks(monkeypatch):
    """temperature=0.0 is known greedy on the host: no uniforms are needed even where the values of
    tensors cannot be read (CUDA without value checks, graph capture, torch.compile)."""
    from gemma4_mtp_kernels import _checks

    logits = torch.randn(2, 4, 6)
    want = tree(target_logits=logits)()
    monkeypatch.setattr(_checks, "values_checkable", lambda t: False)
    res = tree(target_logits=logits, temperature=0.0)()
    assert torch.equal(res.output_tokens, want.output_tokens)
    with pytest.raises(ValueError, match="uniforms"):
        tree(temperature=torch.zeros(2))()  # a tensor's rows are unknown there


def test_reference_refuses_a_sampling_row_without_a_distribution():
    """Reached unchecked (CUDA without value checks), the reference says what is wrong instead of
    failing inside its inverse CDF."""
    from gemma4_mtp_kernels import reference

    logits = torch.randn(1, 3, 5)
    logits[0, 0] = float("-inf")
    with pytest.raises(ValueError, match="target_logits"):
        reference.tree_verify(torch.tensor([[0, 1, 2]]), torch.tensor([[-1, 0, 1]], dtype=torch.int32), logits,
                              temperature=torch.ones(1), uniforms=torch.rand(1, 3, 2))


def test_implementation_is_the_op_minus_its_checks():
    """`implementation` names a public op and returns the backend function the op itself calls."""
    import gemma4_mtp_kernels.reference as reference
    with pytest.raises(ValueError, match="implementation: op"):
        g.implementation("rms_norm", "torch", "cpu", torch.float32)
    with pytest.raises(ValueError, match="backend"):
        g.implementation("rms_norm_linear", "fast", "cpu", torch.float32)
    assert g.implementation("rms_norm_linear", "torch", "cpu", torch.float32) is reference.rms_norm_linear
    assert g.implementation("rms_norm_linear", "auto", torch.device("cpu"), torch.float32) is reference.rms_norm_linear
