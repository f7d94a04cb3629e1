"""The compiled ops' registration, without a GPU: schemas, fake implementations (FakeTensorMode,
meta tensors, torch.library.opcheck's schema and fake-tensor checks) and torch.compile tracing of
the cuda backend. The full opcheck on real CUDA tensors is in tests/test_*_cuda.py (marked gpu)."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import cuda as cuda_backend
from gemma4_mtp_kernels import reference
from gemma4_mtp_kernels._dispatch import BackendUnavailableError
from helpers import SMALL_DRAFTER

ok, why = cuda_backend.extension_status()
pytestmark = pytest.mark.skipif(not ok, reason=f"cuda extension unavailable: {why}")

OPS = {
    "fused_concat_down_proj": ["out"],
    "q_only_paged_attention": ["out", "lse"],
    "centroid_logits": ["ids", "logits"],
    "tree_verify": ["accept_len", "accepted_nodes", "output_tokens", "last_node"],
    "rms_norm_linear": ["out", "residual_out", "normed_out"],
    "rms_norm_gate_up": ["out", "residual_out"],
    "rms_norm_q_rope": ["out", "residual_out"],
    "softmax_sample": ["probs", "tokens"],
    "drafter_step": ["last", "proj", "ids", "scores", "probs"],
}


def ops():
    return cuda_backend._ops()


@pytest.mark.parametrize("name", list(OPS))
def test_fake_takes_the_schema_arguments_in_order(name):
    """Each fake's parameters are its schema's arguments, in order: opcheck on meta tensors does not check
    the positions (it passed rms_norm_gate_up's old positions after the schema gained down_weight)."""
    schema = getattr(ops(), name).default._schema
    from gemma4_mtp_kernels.cuda import _fake  # registers on import: after ops() has loaded the extension
    fake = getattr(_fake, f"_{name}")
    assert list(inspect.signature(fake).parameters) == [a.name for a in schema.arguments]


@pytest.mark.parametrize("name", list(OPS))
def test_schema_registered_with_written_outputs(name):
    schema = getattr(ops(), name).default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == OPS[name]
    assert len(schema.returns) == 0
    # only the outputs are written: inputs carry no alias annotation
    assert all(a.alias_info is None for a in schema.arguments if a.name not in OPS[name])


def down_proj_args(device, T=3, Hb=64, Hd=32, V=10, dtype=torch.bfloat16):
    return (torch.zeros(T, dtype=torch.long, device=device), torch.ones(V, Hb, dtype=dtype, device=device),
            torch.ones(T, Hb, dtype=dtype, device=device), torch.ones(Hd, 2 * Hb, dtype=dtype, device=device))


def attention_args(device, B=2, Qn=3, Hq=4, Hkv=2, D=128, nb=6, bs=16, dtype=torch.float16):
    return (torch.ones(B, Qn, Hq, D, dtype=dtype, device=device), torch.ones(nb, bs, Hkv, D, dtype=dtype, device=device),
            torch.ones(nb, bs, Hkv, D, dtype=dtype, device=device), torch.zeros(B, 3, dtype=torch.int32, device=device),
            torch.full((B,), 5, dtype=torch.int32, device=device))


def centroid_args(device, T=2, Hd=32, C=8, V=64, dtype=torch.float32):
    return (torch.ones(T, Hd, dtype=dtype, device=device), torch.ones(C, Hd, dtype=dtype, device=device),
            torch.arange(V, device=device), torch.ones(V, Hd, dtype=dtype, device=device))


def tree_args(device, B=2, N=4, V=50, dtype=torch.float32):
    parents = torch.tensor([[-1, 0, 1, 2]] * B, dtype=torch.int32, device=device)
    return (torch.zeros(B, N, dtype=torch.long, device=device), parents, torch.zeros(B, N, V, dtype=dtype, device=device))


def glue_args(device, T=3, H=64, N=40, dtype=torch.bfloat16):
    """x, the weight and the full prologue (norm, residual, its norm, the layer scalar)."""
    kw = dict(dtype=dtype, device=device)
    return ((torch.ones(T, H, **kw), torch.ones(N, H, **kw)),
            dict(norm_weight=torch.ones(H, **kw), residual=torch.ones(T, H, **kw),
                 residual_norm_weight=torch.ones(H, **kw), layer_scalar=torch.ones(1, **kw)))


def q_rope_args(device, T=4, H=64, Hq=2, D=64, dtype=torch.bfloat16):
    kw = dict(dtype=dtype, device=device)
    return (torch.ones(T, H, **kw), torch.ones(Hq * D, H, **kw), torch.ones(D, **kw),
            torch.zeros(T // 2, dtype=torch.long, device=device), torch.ones(D // 2, device=device))


def sample_args(device, B=3, V=5000, dtype=torch.float32):
    return (torch.zeros(B, V, dtype=dtype, device=device), torch.ones(B, device=device),
            torch.full((B,), 0.5, dtype=torch.float64, device=device))


def opcheck_meta(op, args):
    result = torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result


def test_opcheck_meta_down_proj():
    opcheck_meta(ops().fused_concat_down_proj,
                 (*down_proj_args("meta"), 8.0, torch.empty(3, 32, dtype=torch.bfloat16, device="meta")))


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (17, 30.0)])
def test_opcheck_meta_attention(window, softcap):
    q = attention_args("meta")[0]
    opcheck_meta(ops().q_only_paged_attention,
                 (*attention_args("meta"), 1.0, window, softcap, torch.empty_like(q),
                  torch.empty(q.shape[:3], device="meta")))


@pytest.mark.parametrize("output,ids_shape,logits_shape", [("argmax", (2,), (2,)), ("topk", (2, 3), (2, 3)),
                                                           ("sparse", (2, 16), (2, 16)), ("dense", (0,), (2, 64))])
def test_opcheck_meta_centroid(output, ids_shape, logits_shape):
    opcheck_meta(ops().centroid_logits,
                 (*centroid_args("meta"), 2, output, torch.empty(ids_shape, dtype=torch.long, device="meta"),
                  torch.empty(logits_shape, device="meta")))


@pytest.mark.parametrize("sampling", [False, True])
def test_opcheck_meta_tree_verify(sampling):
    tokens, parents, logits = tree_args("meta")
    B, N, V = logits.shape
    extra = (torch.ones(B, device="meta"), torch.zeros(B, N, 2, device="meta"), torch.zeros(B, N, V, device="meta")) \
        if sampling else (None, None, None)
    outs = (torch.empty(B, dtype=torch.int32, device="meta"), torch.empty(B, N, dtype=torch.int32, device="meta"),
            torch.empty(B, N, dtype=torch.long, device="meta"), torch.empty(B, dtype=torch.int32, device="meta"))
    opcheck_meta(ops().tree_verify, (tokens, parents, logits, *extra, *outs))


def test_opcheck_meta_glue():
    (x, w), kw = glue_args("meta")
    T, H = x.shape
    rows = lambda: torch.empty(T, H, dtype=x.dtype, device="meta")  # noqa: E731
    pro = (kw["norm_weight"], 1e-6, kw["residual"], kw["residual_norm_weight"], kw["layer_scalar"])
    out = torch.empty(T, w.shape[0], dtype=x.dtype, device="meta")
    opcheck_meta(ops().rms_norm_linear, (x, w, *pro, out, rows(), rows()))
    opcheck_meta(ops().rms_norm_linear, (x, w, None, 1e-6, None, None, None, out, None, None))
    opcheck_meta(ops().rms_norm_gate_up, (x, w, w, None, *pro, out, rows()))
    down = torch.empty(H, w.shape[0], dtype=x.dtype, device="meta")  # the whole MLP: out [T, H]
    opcheck_meta(ops().rms_norm_gate_up, (x, w, w, down, *pro, rows(), rows()))
    qx, qw, qn, pos, freq = q_rope_args("meta")
    opcheck_meta(ops().rms_norm_q_rope, (qx, qw, qn, pos, freq, None, 1e-6, None, None, None,
                                         torch.empty(4, 2, 64, dtype=qx.dtype, device="meta"), None))


def test_opcheck_meta_softmax_sample():
    logits, temperature, uniforms = sample_args("meta", dtype=torch.bfloat16)
    B, V = logits.shape
    opcheck_meta(ops().softmax_sample, (logits, temperature, uniforms, torch.empty(B, V, device="meta"),
                                        torch.empty(B, dtype=torch.long, device="meta")))


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gemma4_mtp":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_cuda_step_is_one_op_and_its_fake_checks():
    """backend="cuda": Gemma4MTPDrafter.step is the one drafter_step op (its fake on meta tensors, which
    opcheck checks against the schema), step_top_tokens and step_sample_tokens too (the head in the call), and
    the 22 ops one by one with one_call_step False."""
    from unittest import mock

    from gemma4_mtp.drafter import random_drafter, synthetic_context
    from gemma4_mtp_kernels import _dispatch

    drafter = random_drafter(SMALL_DRAFTER, device="meta", backend="cuda")
    ctx = synthetic_context(drafter, 2, 70, device="meta")
    tokens = torch.empty(2, 3, dtype=torch.long, device="meta")
    hidden = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="meta")
    with _OpCounter() as counted:
        last, proj = drafter.step(ctx, tokens, hidden)
    assert counted.names == ["drafter_step"]
    assert last.shape == (2, 3, 128) and proj.shape == (2, 3, 64) and last.dtype == proj.dtype == torch.bfloat16
    t = drafter.config.text
    kinds = list(dict.fromkeys(t.layer_types))
    weights = [w for i in range(t.num_layers) for w in drafter._layer_weights(i)]
    step_args = (  # the schema's arguments up to eps
        tokens, hidden.view(6, 64), ctx.embed_table, 8.0, drafter.pre_projection.weight, weights,
        [kinds.index(k) for k in t.layer_types], [ctx.k_cache[k] for k in kinds], [ctx.v_cache[k] for k in kinds],
        [ctx.block_table[k] for k in kinds], [ctx.window[k] or 0 for k in kinds], ctx.seq_lens, ctx.positions,
        drafter.norm.weight, drafter.post_projection.weight, 1e-6)
    opcheck_meta(ops().drafter_step, (*step_args, None, None, None, 0, None, None, torch.empty_like(last),
                                      torch.empty_like(proj), None, None, None))
    with _OpCounter() as counted:  # the step and its head: still the one op
        _, _, ids = drafter.step_top_tokens(ctx, tokens, hidden, 4)
    assert counted.names == ["drafter_step"] and ids.shape == (2, 3, 4) and ids.dtype == torch.int64
    from gemma4_mtp.graphs import DraftSampling, draft_tree
    with _OpCounter() as counted:  # a greedy round: one op a level
        draft_tree(drafter, ctx, tokens[:, 0], hidden[:, 0], (2, 1))
    assert counted.names == ["drafter_step", "drafter_step"], counted.names
    sampling = DraftSampling(torch.ones(2, device="meta"), torch.empty(2, 2, dtype=torch.float64, device="meta"))
    with _OpCounter() as counted:  # a sampled round: one op a level too (the head's logits and softmax_sample)
        draft_tree(drafter, ctx, tokens[:, 0], hidden[:, 0], (1, 1), sampling=sampling)
    assert counted.names == ["drafter_step", "drafter_step"], counted.names
    scores = torch.empty(2, 3, 4, device="meta")
    opcheck_meta(ops().drafter_step, (*step_args, None, None, drafter.lm_head_weight, 0, None, None,
                                      torch.empty_like(last), torch.empty_like(proj), torch.empty_like(ids), scores,
                                      None))
    V = drafter.lm_head_weight.shape[0]
    opcheck_meta(ops().drafter_step, (*step_args, None, None, drafter.lm_head_weight, 0, torch.ones(6, device="meta"),
                                      torch.empty(6, dtype=torch.float64, device="meta"), torch.empty_like(last),
                                      torch.empty_like(proj), torch.empty(2, 3, 1, dtype=torch.long, device="meta"),
                                      None, torch.empty(6, V, device="meta")))
    drafter.one_call_step = False
    meta_ok = _dispatch.BackendStatus(True, "meta tensors standing for CUDA tensors")
    with mock.patch.object(_dispatch, "_cuda_status", lambda device=None: meta_ok), _OpCounter() as counted:
        drafter.step(ctx, tokens, hidden)
    # the pre-projection, 4 a layer (q, attention, o_proj, the MLP: one op, which launches gate / up and down
    # as one kernel or two), the post-projection
    assert "drafter_step" not in counted.names and len(counted.names) == 1 + 4 * 4 + 1, counted.names


def shapes(x):
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    return tuple(shapes(t) for t in x)


CASES = {
    "down_proj": (lambda d: (down_proj_args(d), dict(embed_scale=8.0)), "fused_concat_down_proj"),
    "attention": (lambda d: (attention_args(d), dict(window=4, return_lse=True)), "q_only_paged_attention"),
    "attention_no_lse": (lambda d: (attention_args(d), dict()), "q_only_paged_attention"),
    "centroid_argmax": (lambda d: (centroid_args(d), dict(top_k=2)), "centroid_logits"),
    "centroid_sparse": (lambda d: (centroid_args(d), dict(top_k=3, output="sparse")), "centroid_logits"),
    "centroid_topk": (lambda d: (centroid_args(d), dict(top_k=3, output="topk", k=2)), "centroid_logits"),
    "centroid_dense": (lambda d: (centroid_args(d), dict(top_k=3, output="dense", fill_value=-1.0)), "centroid_logits"),
    "tree_greedy": (lambda d: (tree_args(d), dict()), "tree_verify"),
    "rms_norm_linear": (lambda d: glue_args(d), "rms_norm_linear"),
    "rms_norm_gate_up": (lambda d: ((*glue_args(d)[0], glue_args(d)[0][1]), glue_args(d)[1]), "rms_norm_gate_up"),
    "rms_norm_q_rope": (lambda d: (q_rope_args(d), dict()), "rms_norm_q_rope"),
    "softmax_sample": (lambda d: (sample_args(d), dict()), "softmax_sample"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fake_cuda_outputs_match_the_reference(case):
    """Under FakeTensorMode (no GPU needed) the cuda backend returns what the reference returns on
    real CPU tensors: same structure, shapes and dtypes, on the CUDA device."""
    make, op = CASES[case]
    args, kw = make("cpu")
    want = getattr(reference, op)(*args, **kw)
    with FakeTensorMode():
        fargs, fkw = make("cuda")
        got = getattr(cuda_backend, op)(*fargs, **fkw)
        assert all(t.device.type == "cuda" for t in (got if isinstance(got, tuple) else (got,)))
    assert shapes(got) == shapes(want)


@pytest.mark.parametrize("case", ["down_proj", "attention", "centroid_sparse", "tree_greedy", "rms_norm_gate_up",
                                  "rms_norm_q_rope", "softmax_sample"])
def test_compile_fullgraph_traces_the_backend(case):
    """Dynamo traces the cuda backend's Python (allocation + op call) without a graph break; the
    meta tensors run the fake implementations."""
    make, op = CASES[case]
    args, kw = make("meta")
    fn = getattr(cuda_backend, op)
    compiled = torch.compile(lambda *a: fn(*a, **kw), fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    cpu_args, cpu_kw = make("cpu")
    want = getattr(reference, op)(*cpu_args, **cpu_kw)
    assert shapes(got) == shapes(want)


def test_cuda_backend_refuses_cpu_tensors_with_a_reason():
    with pytest.raises(BackendUnavailableError, match="cuda"):
        g.fused_concat_down_proj(*down_proj_args("cpu"), embed_scale=1.0, backend="cuda")


def test_dispatch_to_cuda_traces_in_fullgraph():
    """The dispatcher asks for the extension's status while torch.compile traces a public op; the
    answer must be a trace-time constant, not a traced import (which would break the graph)."""
    from gemma4_mtp_kernels import _dispatch

    def f(x):
        return x + (1.0 if _dispatch._cuda_status(torch.device("cuda")).available else 2.0)

    eager = f(torch.zeros(2))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2)), eager)
