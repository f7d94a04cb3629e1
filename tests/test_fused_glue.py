"""The fused glue ops' reference (rms_norm_linear, rms_norm_gate_up, rms_norm_q_rope): against the fp64
oracle with Hugging Face's rounding points, bit for bit against the gemma4_mtp.layers composition the
drafter used before (itself tested against Hugging Face in test_drafter.py), and their validation."""
import pytest
import torch
import torch.nn.functional as F

import gemma4_mtp_kernels as g
from cases_fused_glue import DTYPES, EPS, PROLOGUES, check_glue, make_prologue, rope_inv_freq, weight
from gemma4_mtp.layers import apply_rope, rms_norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_rms_norm_linear_reference(kind, dtype):
    check_glue("rms_norm_linear", "torch", "cpu", 5, 96, 40, dtype, kind, gen=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_rms_norm_gate_up_reference(kind, dtype):
    check_glue("rms_norm_gate_up", "torch", "cpu", 5, 96, 72, dtype, kind, gen=torch.Generator().manual_seed(2))
    check_glue("rms_norm_gate_up", "torch", "cpu", 5, 96, 72, dtype, kind, gen=torch.Generator().manual_seed(2),
               down=40)  # the whole MLP


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
@pytest.mark.parametrize("D,proportional", [(64, False), (128, True)])
def test_rms_norm_q_rope_reference(kind, dtype, D, proportional):
    check_glue("rms_norm_q_rope", "torch", "cpu", 6, 96, 2 * D, dtype, kind, gen=torch.Generator().manual_seed(3), D=D,
               per_pos=2, proportional=proportional)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_the_layer_composition(dtype):
    """Bit for bit what a decoder layer computes with gemma4_mtp.layers: the previous layer's end
    (x + post_ff_norm(h)) * layer_scalar, the input norm, q_proj, q_norm, RoPE; the post-attention
    residual and pre-feedforward norm into gate/up (and down_proj); the final norm written out."""
    gen = torch.Generator().manual_seed(4)
    T, H, D = 4, 64, 64
    x, kw = make_prologue(T, H, dtype, "layer", gen)
    wq, qn = weight(2 * D, H, dtype, gen), (1 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    positions, inv = torch.tensor([3, 70_000]), rope_inv_freq(D)
    h = (kw["residual"] + rms_norm(x, kw["residual_norm_weight"], EPS)) * kw["layer_scalar"]
    n = rms_norm(h, kw["norm_weight"], EPS)
    q = apply_rope(rms_norm(F.linear(n, wq).view(T, 2, D), qn, EPS), positions.repeat_interleave(2), inv)
    h_out = torch.empty_like(x)
    got = g.rms_norm_q_rope(x, wq, qn, positions, inv, eps=EPS, residual_out=h_out, backend="torch", **kw)
    assert torch.equal(got, q) and torch.equal(h_out, h)
    wg, wu = weight(96, H, dtype, gen), weight(96, H, dtype, gen)
    m = F.gelu(F.linear(n, wg), approximate="tanh") * F.linear(n, wu)
    assert torch.equal(g.rms_norm_gate_up(x, wg, wu, eps=EPS, backend="torch", **kw), m)
    wd = weight(H, 96, dtype, gen)
    assert torch.equal(g.rms_norm_gate_up(x, wg, wu, down_weight=wd, eps=EPS, backend="torch", **kw), F.linear(m, wd))
    wp = weight(80, H, dtype, gen)
    n_out = torch.empty_like(x)
    assert torch.equal(g.rms_norm_linear(x, wp, eps=EPS, normed_out=n_out, backend="torch", **kw), F.linear(n, wp))
    assert torch.equal(n_out, n)


# ---- validation: every bad argument is named -------------------------------------------------------

def _linear(**change):
    a = dict(x=torch.randn(3, 8), weight=torch.randn(5, 8), norm_weight=torch.ones(8), residual=torch.randn(3, 8),
             residual_norm_weight=torch.ones(8), layer_scalar=torch.ones(1))
    a.update(change)
    return lambda: g.rms_norm_linear(**a)


def _gate_up(**change):
    a = dict(x=torch.randn(3, 8), gate_weight=torch.randn(6, 8), up_weight=torch.randn(6, 8), norm_weight=torch.ones(8))
    a.update(change)
    return lambda: g.rms_norm_gate_up(**a)


def _q(**change):
    a = dict(x=torch.randn(4, 8), weight=torch.randn(128, 8), q_norm_weight=torch.ones(64),
             positions=torch.tensor([1, 2]), inv_freq=torch.ones(32))
    a.update(change)
    return lambda: g.rms_norm_q_rope(**a)


@pytest.mark.parametrize("call,error,match", [
    (_linear(x=torch.randn(3, 8, dtype=torch.float64)), TypeError, "rms_norm_linear: x must be of dtype"),
    (_linear(x=torch.randn(3)), ValueError, "x must be a 2-d tensor"),
    (_linear(weight=torch.randn(5, 9)), ValueError, "weight must be of size 8 in dim 1"),
    (_linear(weight=torch.randn(5, 8, dtype=torch.bfloat16)), TypeError, "weight must be of the same dtype as x"),
    (_linear(norm_weight=torch.ones(9)), ValueError, "norm_weight must be of size 8"),
    (_linear(residual=torch.randn(2, 8)), ValueError, "residual must be of shape"),
    (_linear(residual_norm_weight=None), ValueError, "residual_norm_weight must be a tensor"),
    (_linear(residual=None), ValueError, "residual_norm_weight must be None unless residual"),
    (_linear(layer_scalar=torch.ones(2)), ValueError, "layer_scalar must be of size 1"),
    (_linear(eps=-1.0), ValueError, "eps must be >= 0"),
    (_linear(eps=float("nan")), ValueError, "eps must be finite"),
    (_linear(out=torch.empty(3, 4)), ValueError, "out must be of shape"),
    (_linear(normed_out=torch.empty(3, 8), norm_weight=None), ValueError, "normed_out must be None unless"),
    (_linear(residual_out=torch.empty(3, 8, dtype=torch.bfloat16)), TypeError, "residual_out must be of dtype"),
    (_linear(x=torch.randn(8, 3).T), ValueError, "x must be stride 1"),
    (_linear(weight=torch.randn(8, 5).T), ValueError, "weight must be stride 1"),
    (_linear(residual=torch.randn(3, 8, device="meta")), ValueError, "residual must be on the same device"),
    (_gate_up(up_weight=torch.randn(7, 8)), ValueError, "up_weight must be of size 6 in dim 0"),
    (_gate_up(gate_weight=torch.randn(6, 9)), ValueError, "gate_weight must be of size 8 in dim 1"),
    (_gate_up(down_weight=torch.randn(8, 7)), ValueError, "down_weight must be of size 6 in dim 1"),
    (_gate_up(down_weight=torch.randn(8)), ValueError, "down_weight must be a 2-d tensor"),
    (_gate_up(down_weight=torch.randn(8, 6, dtype=torch.bfloat16)), TypeError, "down_weight must be of the same dtype"),
    (_gate_up(down_weight=torch.randn(6, 8).T), ValueError, "down_weight must be stride 1"),
    (_gate_up(down_weight=torch.randn(8, 6), out=torch.empty(3, 6)), ValueError, "out must be of shape"),
    (_q(q_norm_weight=torch.ones(48)), ValueError, "q_norm_weight must be of a head dim"),
    (_q(weight=torch.randn(100, 8)), ValueError, "weight must be a positive multiple of the head dim 64"),
    (_q(positions=torch.tensor([1, 2, 3])), ValueError, "positions must be of a length dividing T = 4"),
    (_q(positions=torch.tensor([1.0, 2.0])), TypeError, "positions must be of dtype"),
    (_q(inv_freq=torch.ones(32, dtype=torch.float64)), TypeError, "inv_freq must be of dtype"),
    (_q(inv_freq=torch.ones(31)), ValueError, "inv_freq must be of size 32"),
    (_q(out=torch.empty(4, 128)), ValueError, "out must be of shape"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_outputs_may_not_alias_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="residual_out must be a buffer that does not overlap x"):
        _linear(x=x, residual_out=x)()
    with pytest.raises(ValueError, match="out must be a buffer that does not overlap x"):
        _gate_up(x=x, out=x.view(-1)[:18].view(3, 6))()


def test_unavailable_backend_raises():
    with pytest.raises(g.BackendUnavailableError, match="rms_norm_q_rope"):
        _q(backend="cuda")()


@pytest.mark.parametrize("op", ["rms_norm_linear", "rms_norm_gate_up", "rms_norm_q_rope", "dense_lm_head"])
def test_fullgraph_through_the_dispatcher_on_cpu(op):
    """torch.compile(fullgraph=True) traces validation, dispatch and the reference (backend torch)."""
    gen = torch.Generator().manual_seed(5)
    x, kw = make_prologue(3, 64, torch.float32, "layer", gen)
    if op == "rms_norm_linear":
        args = (x, weight(40, 64, torch.float32, gen))
    elif op == "rms_norm_gate_up":
        args = (x, weight(40, 64, torch.float32, gen), weight(40, 64, torch.float32, gen))
    elif op == "rms_norm_q_rope":
        args = (x, weight(128, 64, torch.float32, gen), torch.ones(64), torch.tensor([4, 5, 6]), rope_inv_freq(64))
    else:
        args, kw = (x, weight(100, 64, torch.float32, gen)), dict(k=3)
    fn = getattr(g, op)
    want = fn(*args, backend="torch", **kw)
    torch._dynamo.reset()
    got = torch.compile(lambda *a: fn(*a, backend="torch", **kw), fullgraph=True, backend="eager")(*args)
    for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        assert torch.equal(a, b)
