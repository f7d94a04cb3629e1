"""softmax_sample (the decode loop's sampled draft tokens) against a numpy oracle, for the torch
reference and the Triton kernels under the interpreter (on a GPU, at the real vocabulary:
test_softmax_sample_triton.py and _cuda.py; the CUDA kernels' source runs on CPU in
test_softmax_sample_emulated.py).

The oracle is independent of both: q from fp64 exponentials of the fp32 x = logits / temperature, and
the token checked as the inverse CDF of the q the backend returned (fp64 cumulative sums; the kernel
adds them chunk by chunk, so a token is accepted only within 1e-12 of a CDF step, never a neighbour).
Outputs are poisoned with NaN before the call."""
import numpy as np
import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels.triton import softmax_sample as triton_softmax_sample
from gemma4_mtp_kernels.triton.softmax_sample import CHUNK

BACKENDS = ("torch", "triton")


def oracle_probs(logits, temperature):
    x = (logits.float() / temperature[:, None]).double().numpy()
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def assert_inverse_cdf(tokens, probs, uniforms, eps=1e-12):
    """tokens[b] is the first id whose fp64 cumulative probability exceeds uniforms[b] (within eps of
    a step), or, when the total stays at or below it, the last id with probability > 0."""
    q = probs.double().cpu().numpy()
    for b, (t, u) in enumerate(zip(tokens.tolist(), uniforms.tolist())):
        cdf = np.cumsum(q[b])
        if cdf[-1] <= u:
            assert t == int(np.flatnonzero(q[b] > 0).max()), (b, t)
            continue
        assert 0 <= t < q.shape[1] and q[b, t] > 0, (b, t)
        assert cdf[t] > u - eps and (t == 0 or cdf[t - 1] <= u + eps), (b, t, u, cdf[t - 1:t + 1])


def case(B, V, dtype, seed, *, scale=3.0, support=None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=gen) * scale
    if support is not None:  # a centroid head's dense output: -inf outside its candidates
        keep = torch.zeros(B, V, dtype=torch.bool)
        for b in range(B):
            keep[b, torch.randperm(V, generator=gen)[:support]] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    temperature = 0.5 + torch.rand(B, generator=gen)
    uniforms = torch.rand(B, generator=gen, dtype=torch.float64)
    return logits.to(dtype), temperature, uniforms


def run(backend, logits, temperature, uniforms, device="cpu", **kw):
    args = [t.to(device) for t in (logits, temperature, uniforms)]
    probs = torch.full(logits.shape, float("nan"), dtype=torch.float32, device=device)
    tokens, out = g.softmax_sample(*args, probs_out=probs, backend=backend, **kw)
    assert out.data_ptr() == probs.data_ptr()
    return tokens.cpu(), probs.cpu()


def check_real_vocabulary_on_gpu(backend, B):
    """V = 262144 as the E2B centroid head gives it (4096 finite candidates) and as a dense head does
    (test_softmax_sample_triton.py and _cuda.py run it)."""
    for support in (4096, None):
        logits, temperature, uniforms = case(B, 262144, torch.float32, seed=B, support=support)
        tokens, probs = run(backend, logits, temperature, uniforms, device="cuda")
        np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
        assert_inverse_cdf(tokens, probs, uniforms)


def check_graph_replay_on_gpu(backend):
    """Captured once, replayed with new inputs: the counters reset themselves, the outputs follow."""
    logits, temperature, uniforms = case(4, 262144, torch.float32, seed=1, support=4096)
    dev = [t.cuda() for t in (logits, temperature, uniforms)]
    probs = torch.empty(4, 262144, device="cuda")
    run(backend, logits, temperature, uniforms, device="cuda")  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = g.softmax_sample(*dev, probs_out=probs, backend=backend)
    for seed in (2, 3):
        new = case(4, 262144, torch.float32, seed=seed, support=4096)
        for d, n in zip(dev, new):
            d.copy_(n)
        probs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(probs.cpu().numpy(), oracle_probs(new[0], new[1]), rtol=2e-5, atol=1e-9)
        assert_inverse_cdf(out.cpu(), probs.cpu(), new[2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,V,support", [(1, 100, None), (3, 2 * CHUNK + 904, None), (4, 3 * CHUNK, 700)],
                         ids=["one chunk", "ragged last chunk", "centroid support"])
def test_against_the_oracle(backend, dtype, B, V, support):
    logits, temperature, uniforms = case(B, V, dtype, seed=V + B, support=support)
    tokens, probs = run(backend, logits, temperature, uniforms)
    np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
    assert_inverse_cdf(tokens, probs, uniforms)
    if support is not None:
        assert bool((probs[torch.isinf(logits)] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_draws_follow_q(backend):
    """500 uniforms on one row of a few likely tokens: the draws land on each token as q says."""
    logits = torch.full((1, CHUNK + 50), float("-inf"))
    ids = [3, 900, CHUNK - 1, CHUNK, CHUNK + 49]  # across the chunk boundary
    logits[0, ids] = torch.tensor([0.0, 1.0, 0.5, -1.0, 2.0])
    q = torch.softmax(logits[0, ids], 0).double().numpy()
    u = torch.arange(500, dtype=torch.float64) / 500 + 1e-3
    got = torch.cat([run(backend, logits, torch.ones(1), u[i:i + 1])[0] for i in range(0, 500, 10)])
    expected = [ids[int(np.searchsorted(np.cumsum(q), x, side="right"))] for x in u[::10].tolist()]
    assert got.tolist() == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_uniforms(backend):
    """q into one depth of a [B, N, V] buffer (the other depths untouched), uniforms a column of a
    [B, depth] tensor, logits a row slice of a wider tensor."""
    B, N, V = 3, 4, 1500
    logits, temperature, _ = case(B, V, torch.float32, seed=9)
    wide = torch.zeros(B, V + 64)
    wide[:, :V] = logits
    uniforms = torch.rand(B, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    buf = torch.full((B, N, V), float("nan"))
    tokens, probs = g.softmax_sample(wide[:, :V], temperature, uniforms[:, 2], probs_out=buf[:, 1], backend=backend)
    np.testing.assert_allclose(buf[:, 1].numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
    assert torch.isnan(buf[:, [0, 2, 3]]).all()
    assert_inverse_cdf(tokens, buf[:, 1], uniforms[:, 2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_total_at_or_below_the_uniform_takes_the_last_token(backend):
    """A uniform at or above the fp64 total of q (rounding left it under 1): the last id with q > 0."""
    logits, temperature, uniforms = case(6, CHUNK + 300, torch.float32, seed=4, support=40)
    _, probs = run(backend, logits, temperature, uniforms)
    totals = probs.double().sum(1)
    under = (totals < 1).nonzero().flatten()
    assert len(under), totals  # some rows round under 1 (seeded)
    u = torch.where(totals < 1, totals, torch.full_like(totals, 0.5))
    tokens, probs = run(backend, logits, temperature, u)
    for b in under.tolist():
        assert tokens[b] == int((probs[b] > 0).nonzero().max())
    assert_inverse_cdf(tokens, probs, u, eps=0.0 if backend == "torch" else 1e-12)


def test_each_row_alone_as_in_a_batch():
    logits, temperature, uniforms = case(5, 2 * CHUNK + 7, torch.bfloat16, seed=6)
    tokens, probs = run("triton", logits, temperature, uniforms)
    for b in range(5):
        t, p = run("triton", logits[b:b + 1], temperature[b:b + 1], uniforms[b:b + 1])
        assert t[0] == tokens[b] and torch.equal(p[0], probs[b])


def test_empty_batch():
    for backend in BACKENDS:
        tokens, probs = g.softmax_sample(torch.zeros(0, 10), torch.zeros(0), torch.zeros(0, dtype=torch.float64),
                                         backend=backend)
        assert tokens.shape == (0,) and probs.shape == (0, 10)


def test_a_row_without_distribution_is_rejected_and_unchecked_gives_minus_one():
    logits, temperature, uniforms = case(3, 300, torch.float32, seed=2)
    logits[1] = float("-inf")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="logits must be rows whose logits / temperature has a finite "
                                             "maximum, got -inf in row 1"):
            g.softmax_sample(logits, temperature, uniforms, backend=backend)
    # on a GPU without value checks nothing reads the values first: the kernel answers -1 for that row
    tokens, probs = triton_softmax_sample(logits, temperature, uniforms)
    assert tokens[1] == -1 and torch.isnan(probs[1]).all()
    ok = [0, 2]
    np.testing.assert_allclose(probs[ok].numpy(), oracle_probs(logits[ok], temperature[ok]), rtol=2e-5, atol=1e-9)


def test_bad_arguments():
    logits, temperature, uniforms = case(2, 50, torch.float32, seed=1)
    bad = [
        (dict(logits=logits[0]), ValueError, "logits must be a 2-d tensor"),
        (dict(logits=logits.long()), TypeError, "logits must be of dtype"),
        (dict(logits=logits.t()), ValueError, "logits must be stride 1"),
        (dict(temperature=temperature.double()), TypeError, "temperature must be of dtype torch.float32"),
        (dict(temperature=temperature[:1]), ValueError, "temperature must be of size 2"),
        (dict(temperature=torch.tensor([1.0, 0.0])), ValueError, "temperature must be finite and > 0"),
        (dict(uniforms=uniforms.float()), TypeError, "uniforms must be of dtype torch.float64"),
        (dict(uniforms=torch.tensor([0.5, 1.0], dtype=torch.float64)), ValueError, r"uniforms must be in \[0, 1\)"),
        (dict(probs_out=torch.zeros(2, 49)), ValueError, "probs_out must be of shape"),
        (dict(probs_out=torch.zeros(2, 50, dtype=torch.float64)), TypeError, "probs_out must be of dtype"),
        (dict(probs_out=logits), ValueError, "probs_out must be a buffer that does not overlap logits"),
    ]
    for change, exc, msg in bad:
        kw = dict(logits=logits, temperature=temperature, uniforms=uniforms) | change
        with pytest.raises(exc, match=msg):
            g.softmax_sample(kw.pop("logits"), kw.pop("temperature"), kw.pop("uniforms"), backend="triton", **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        g.softmax_sample(logits, temperature, uniforms, backend="tpu")
