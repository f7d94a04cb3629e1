"""CUDA rms_norm_linear / rms_norm_gate_up / rms_norm_q_rope (GPU only) against the fp64 oracle with
Hugging Face's rounding points (cases_fused_glue), outputs poisoned first: both kernels (tensor cores
for bf16 / fp16 with 16-byte rows, CUDA cores for fp32 and other layouts), split and unsplit k, token
tiles, every prologue, head dims 64-512, the real drafters' shapes, repeated calls and CUDA-graph
replays (the cached counters must be left zero), and a whole drafter step on the cuda backend with
programmatic dependent launch against the same step with every launch finished before the next.
First run on the H200 on 2026-12-04 (all passed); kernels rewritten since are listed in
benchmarks/make_verified.py's REWRITTEN until a run verifies them. Their logic runs on the CPU in
test_fused_glue_emulated.py; their registration in test_cuda_opcheck.py.

Every test's name holds the op it covers (benchmarks/gpu_suite.py counts a test for the op it names)."""
from unittest import mock

import pytest
import torch

import gemma4_mtp_kernels as g
from cases_fused_glue import DTYPES, PROLOGUES, check_glue, check_mlp_replays, make_prologue, weight
from gemma4_mtp_kernels import cuda as cuda_backend
from helpers import DRAFTERS

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
OPS = ("rms_norm_linear", "rms_norm_gate_up", "rms_norm_q_rope")
GEN = torch.Generator


def glue(op, T, H, N, dtype, kind, *, D=64, **kw):
    extra = dict(D=D) if op == "rms_norm_q_rope" else {}
    return check_glue(op, "cuda", DEV, T, H, N, dtype, kind, gen=GEN().manual_seed(T + H + N), **extra, **kw)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", PROLOGUES)
def test_prologues(op, kind, dtype):
    glue(op, 4, 136, 128, dtype, kind, **(dict(per_pos=2) if op == "rms_norm_q_rope" else {}))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T", [1, 17, 40, 70])  # one, two and four m16 tiles, two token tiles
def test_token_tiles_and_splits(op, T):
    glue(op, T, 1024, 256, torch.bfloat16, "layer")  # 8-16 tiles of an H200: k split
    glue(op, T, 64, 2048, torch.bfloat16, "layer")  # 64-128 tiles, 2 k steps: no split


@pytest.mark.parametrize("D,proportional", [(64, False), (128, True), (256, False), (512, True)])
def test_rms_norm_q_rope_head_dims(D, proportional):
    glue("rms_norm_q_rope", 6, 256, 4 * D, torch.bfloat16, "layer", D=D, proportional=proportional, per_pos=3)


@pytest.mark.parametrize("op", OPS)
def test_strided_and_misaligned_rows(op):
    """Row strides of H + 3 / H + 5 elements, and x one element into its storage: no 16-byte vectors,
    the CUDA-core kernel."""
    glue(op, 5, 96, 128, torch.bfloat16, "layer", strided=True)
    glue(op, 3, 128, 64, torch.bfloat16, "layer", shifted=True)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1, 8])
def test_rms_norm_gate_up_with_down_weight(name, T):
    """The whole MLP at a real drafter's shapes: one launch for E2B / E4B at T = 1 (the kernel's tree over
    the tiles' down partials), gate_up then down_proj otherwise (glue_logic.h glue_mlp_one_launch)."""
    d = DRAFTERS[name]
    glue("rms_norm_gate_up", T, d["Hd"], d["inter"], torch.bfloat16, "layer", down=d["Hd"])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1, 64])
def test_real_shapes(op, name, T):
    d = DRAFTERS[name]
    Hd, Hq = d["Hd"], d["Hq"]
    if op == "rms_norm_q_rope":
        for D, prop in ((d["D_swa"], False), (d["D_full"], True)):
            glue(op, T, Hd, Hq * D, torch.bfloat16, "layer", D=D, proportional=prop)
    elif op == "rms_norm_gate_up":
        glue(op, T, Hd, d["inter"], torch.bfloat16, "residual")
    else:
        glue(op, T, Hq * d["D_full"], Hd, torch.bfloat16, "none")  # o_proj of the full layer
        glue(op, T, d["inter"], Hd, torch.bfloat16, "none")  # down_proj
        glue(op, T, Hd, d["Hb"], torch.bfloat16, "layer")  # post_projection with the final norm


@pytest.mark.parametrize("op", OPS)
def test_repeated_calls_and_graph_replays(op):
    """The split-k and head counters are cached per device and never reset by a memset: every launch
    must leave them zero, or the next call (or replay) would sum the wrong partials."""
    x, kw = make_prologue(2, 1024, torch.bfloat16, "layer", GEN().manual_seed(5))
    x, kw = x.to(DEV), {k: v.to(DEV) for k, v in kw.items()}
    w = weight(512, 1024, torch.bfloat16, GEN().manual_seed(6)).to(DEV)
    args = {"rms_norm_linear": (w,), "rms_norm_gate_up": (w, w),
            "rms_norm_q_rope": (w, torch.ones(128, dtype=torch.bfloat16, device=DEV), torch.arange(2, device=DEV),
                                torch.rand(64, device=DEV))}[op]
    want = getattr(g, op)(x, *args, backend="cuda", **kw)
    for _ in range(3):
        assert torch.equal(getattr(g, op)(x, *args, backend="cuda", **kw), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = getattr(g, op)(x, *args, backend="cuda", **kw)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        assert torch.equal(got, want)


def test_rms_norm_gate_up_one_launch_mlp_repeated_calls_and_graph_replays():
    check_mlp_replays("cuda")  # E2B at T = 1: 128 tiles in 8 groups


@pytest.mark.parametrize("bad", ["columns", "dtype", "out"])
def test_rms_norm_gate_up_raw_op_refuses_a_bad_down_weight_naming_it(bad):
    """The C++ checks alone (torch.ops, no Python wrapper in front): a down_weight whose columns are not I,
    of another dtype, or an out of gate_up's shape instead of [T, N] is refused with the tensor's name,
    before any launch."""
    x = torch.randn(1, 256, device=DEV).to(torch.bfloat16)
    wg = torch.randn(2048, 256, device=DEV).to(torch.bfloat16)
    wd = torch.randn(256, 2047 if bad == "columns" else 2048, device=DEV)
    wd = wd if bad == "dtype" else wd.to(torch.bfloat16)
    out = torch.empty(1, 2048 if bad == "out" else 256, dtype=torch.bfloat16, device=DEV)
    error = TypeError if bad == "dtype" else ValueError
    with pytest.raises(error, match="out" if bad == "out" else "down_weight"):
        torch.ops.gemma4_mtp.rms_norm_gate_up(x, wg, wg, wd, None, 1e-6, None, None, None, out, None)
    torch.cuda.synchronize()


class _Serialized:
    """torch.ops.gemma4_mtp with the device drained after every op: no kernel can start before the
    previous one has finished, whatever programmatic dependent launch allows."""

    def __getattr__(self, name):
        op = getattr(torch.ops.gemma4_mtp, name)

        def call(*args):
            op(*args)
            torch.cuda.synchronize()
        return call


@pytest.mark.parametrize("name", ["E2B", "31B"])
def test_drafter_step_on_the_cuda_backend_rms_norm_linear_gate_up_q_rope(name):
    """A whole step with backend="cuda" (four ops, the fused glue and the head on CUDA): graph-replayed
    (programmatic dependent launch between its kernels on sm_90) it gives the bits of the same step with
    every launch drained before the next (a kernel reading its predecessor's output too early would not),
    and it drafts the tokens the Triton step drafts (different summation orders: >= 3/4 of them)."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context

    drafter = random_drafter(name, device=DEV, backend="cuda")
    ctx = synthetic_context(drafter, 3, 8192, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    pending = torch.randint(0, drafter.config.text.vocab_size, (3, 1), generator=gen, device=DEV)
    hidden = torch.randn(3, 1, drafter.config.backbone_hidden_size, generator=gen, device=DEV).to(torch.bfloat16)

    def step():
        last, post = drafter.step(ctx, pending, hidden)
        return last, post, drafter.top_tokens(last, 1)

    step()  # the checked first step
    with mock.patch.object(cuda_backend, "_ops", lambda: _Serialized()):
        want = [t.clone() for t in step()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for _ in range(3):
        graph.replay()
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    drafter.backend = "triton"
    triton_tokens = step()[2]
    assert (triton_tokens == want[2]).double().mean().item() >= 0.75
