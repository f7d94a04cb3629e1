"""torch.compile(fullgraph=True) through every public op, with every backend.

Dynamo traces the public op's validation and `resolve` (the backend choice) and then the backend's
Python. On torch 2.11 it refused the import machinery that `resolve` used (importlib.import_module), a
graph break that `fullgraph=True` turns into an error (the first GPU run); the dispatcher now holds the
backend modules. The CPU tests trace the dispatch path (backends torch and auto on CPU tensors); the
GPU-marked tests trace each GPU backend end to end and compare with the reference.
"""
import pytest
import torch

import gemma4_mtp_kernels as g
from cases_centroid_logits import make as centroid_inputs
from cases_fused_concat_down_proj import make_inputs as down_proj_inputs
from cases_tree_verify import drafts_following, logits_for, random_tree
from helpers import paged_kv


def _inputs(op, device, dtype):
    gen = torch.Generator().manual_seed(3)
    if op == "fused_concat_down_proj":
        args = down_proj_inputs(5, 64, 48, dtype, g=gen)
        return args, dict(embed_scale=8.0)
    if op == "q_only_paged_attention":
        k, v, table, lens = paged_kv([37, 90], 16, 2, 64, dtype=dtype, generator=gen)
        q = torch.randn(2, 2, 4, 64, generator=gen).to(dtype)
        return (q, k, v, table, lens), dict(scale=0.125, window=40, return_lse=True)
    if op == "centroid_logits":
        return centroid_inputs(3, 64, 16, 16 * 8, dtype, gen=gen), dict(top_k=4, output="sparse")
    B, N, V = 2, 5, 300
    parents = random_tree(B, N, gen)
    logits = logits_for(B, N, V, dtype, gen)
    tokens = drafts_following(logits.argmax(-1), parents, V, gen)
    return (tokens, parents, logits), dict(temperature=torch.tensor([0.0, 0.9]), uniforms=torch.rand(B, N, 2, generator=gen))


OPS = ("fused_concat_down_proj", "q_only_paged_attention", "centroid_logits", "tree_verify")


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result]


def _on(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) else x


# The references of attention and tree_verify read lengths and the tree on the host (Python loops,
# .item()): they are the spec in code, not a compiled path, and graph-break under torch.compile.
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("op", ["fused_concat_down_proj", "centroid_logits"])
def test_fullgraph_through_the_dispatcher_on_cpu(op, backend):
    args, kw = _inputs(op, "cpu", torch.float32)
    fn = getattr(g, op)
    want = _flat(fn(*args, backend="torch", **kw))
    torch._dynamo.reset()
    got = _flat(torch.compile(lambda *a: fn(*a, backend=backend, **kw), fullgraph=True, backend="eager")(*args))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
@pytest.mark.parametrize("op", OPS)
def test_fullgraph_on_the_gpu(op, backend):
    """Inductor over the public op on CUDA tensors (bf16), against the reference on CPU: discrete
    outputs equal, floating outputs within the bf16 rounding of the inputs."""
    args, kw = _inputs(op, "cpu", torch.bfloat16)
    fn = getattr(g, op)
    want = _flat(fn(*args, backend="torch", **kw))
    dev_args = [_on(a, "cuda") for a in args]
    dev_kw = {k: _on(v, "cuda") for k, v in kw.items()}
    torch._dynamo.reset()
    got = _flat(torch.compile(lambda *a: fn(*a, backend=backend, **dev_kw), fullgraph=True)(*dev_args))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a = a.cpu()
        if a.dtype.is_floating_point:
            assert (a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max() + 0.02
        else:
            assert torch.equal(a, b)
