"""softmax_sample's cuda kernels on a GPU at the real vocabulary, against test_softmax_sample's
oracle (its CPU tests run the kernel source under the emulation, test_softmax_sample_emulated.py)."""
import numpy as np
import pytest
import torch

from test_softmax_sample import assert_inverse_cdf, case, oracle_probs, run


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 32])
def test_real_vocabulary_on_gpu(B):
    """V = 262144 as the E2B centroid head gives it (4096 finite candidates) and as a dense head does."""
    for support in (4096, None):
        logits, temperature, uniforms = case(B, 262144, torch.float32, seed=B, support=support)
        tokens, probs = run("cuda", logits, temperature, uniforms, device="cuda")
        np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
        assert_inverse_cdf(tokens, probs, uniforms)


@pytest.mark.gpu
def test_replays_in_a_cuda_graph():
    """Captured once, replayed with new inputs: the counters reset themselves, the outputs follow."""
    logits, temperature, uniforms = case(4, 262144, torch.float32, seed=1, support=4096)
    dev = [t.cuda() for t in (logits, temperature, uniforms)]
    probs = torch.empty(4, 262144, device="cuda")
    run("cuda", logits, temperature, uniforms, device="cuda")  # warm-up (compiles)
    import gemma4_mtp_kernels as g
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = g.softmax_sample(*dev, probs_out=probs, backend="cuda")
    for seed in (2, 3):
        new = case(4, 262144, torch.float32, seed=seed, support=4096)
        for d, n in zip(dev, new):
            d.copy_(n)
        probs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(probs.cpu().numpy(), oracle_probs(new[0], new[1]), rtol=2e-5, atol=1e-9)
        assert_inverse_cdf(out.cpu(), probs.cpu(), new[2])
