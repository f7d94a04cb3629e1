"""CUDA fused_concat_down_proj against the reference (SPEC §4.1, §6). Needs a GPU (marked `gpu`).

Same matrix as tests/test_fused_concat_down_proj_triton.py, plus larger T, every drafter at T up to
64, CUDA-graph replay and torch.compile. bf16 / fp16 with 16-byte aligned rows take the tensor-core
path (1-4 m16 token tiles per CTA, k split over CTAs with a last-CTA reduction when 32-row tiles do
not fill the GPU); fp32 and unaligned rows the CUDA-core kernel. Outputs are poisoned (NaN) first."""
import math

import pytest
import torch

from gemma4_mtp_kernels import cuda as cuda_backend
from gemma4_mtp_kernels import fused_concat_down_proj
from cases_fused_concat_down_proj import check_backend, exact_down_proj, make_inputs
from helpers import DRAFTERS, assert_tolerance, poisoned

pytestmark = pytest.mark.gpu
DEV = "cuda"


def check(T, Hb, Hd, dtype, **kw):
    check_backend("cuda", DEV, T, Hb, Hd, dtype, **kw)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1, 3, 8, 9, 16, 17, 33, 64])
def test_drafter_shapes_bf16(name, T):
    d = DRAFTERS[name]
    check(T, d["Hb"], d["Hd"], torch.bfloat16, V=1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,Hb,Hd", [(1, 64, 16), (7, 200, 72), (17, 96, 40), (65, 64, 24), (64, 128, 33),
                                     (3, 37, 5), (300, 256, 1024), (49, 24, 40), (2, 8, 8), (40, 1536, 256)])
def test_awkward_shapes(T, Hb, Hd, dtype):
    check(T, Hb, Hd, dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_int_ids_and_strided_rows(index_dtype):
    check(5, 136, 48, torch.bfloat16, index_dtype=index_dtype, strided=True)
    check(5, 136, 48, torch.bfloat16, index_dtype=index_dtype)


def test_scale_rounding_is_table_dtype():
    """sqrt(1536) rounds to 39.25 in bf16: a kernel using the fp32 scale is off by ~0.15% and fails."""
    T, Hb, Hd = 2, 1536, 16
    token_ids, embed_table, hidden, weight = make_inputs(T, Hb, Hd, torch.bfloat16)
    hidden.zero_()
    got = cuda_backend.fused_concat_down_proj(*(t.to(DEV) for t in (token_ids, embed_table, hidden, weight)),
                                              embed_scale=math.sqrt(Hb))
    exact = exact_down_proj(token_ids, embed_table, hidden, weight, math.sqrt(Hb))
    ref = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=math.sqrt(Hb), backend="torch")
    assert_tolerance(got.cpu(), exact, ref, what="scale rounding")


def test_empty_T():
    args = [t.to(DEV) for t in make_inputs(0, 32, 16, torch.bfloat16)]
    got = fused_concat_down_proj(*args, embed_scale=2.0, backend="cuda")
    assert got.shape == (0, 16) and got.dtype == torch.bfloat16


def test_out_of_range_token_gives_nan_row_not_a_read():
    token_ids, embed_table, hidden, weight = make_inputs(3, 64, 16, torch.float32, V=10)
    token_ids[1] = 10**6
    got = cuda_backend.fused_concat_down_proj(*(t.to(DEV) for t in (token_ids, embed_table, hidden, weight)),
                                              embed_scale=1.0)
    assert torch.isnan(got[1]).all()
    assert not torch.isnan(got[[0, 2]]).any()


def test_cuda_graph_capture_and_replay():
    d = DRAFTERS["E2B"]
    token_ids, embed_table, hidden, weight = (t.to(DEV) for t in make_inputs(4, d["Hb"], d["Hd"], torch.bfloat16, V=500))
    out = poisoned((4, d["Hd"]), torch.bfloat16, device=DEV)
    fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=39.2, out=out, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=39.2, out=out, backend="cuda")
    for _ in range(2):
        token_ids.copy_(torch.randint(0, 500, (4,)))
        hidden.copy_(torch.randn(4, d["Hb"]).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        cpu = [t.cpu() for t in (token_ids, embed_table, hidden, weight)]
        exact = exact_down_proj(*cpu, 39.2)
        ref = fused_concat_down_proj(*cpu, embed_scale=39.2, backend="torch")
        assert_tolerance(out.cpu(), exact, ref, atol=1e-3, what="graph replay")


def test_torch_compile_fullgraph():
    token_ids, embed_table, hidden, weight = make_inputs(3, 256, 64, torch.bfloat16)
    args = [t.to(DEV) for t in (token_ids, embed_table, hidden, weight)]

    def step(*a):
        return fused_concat_down_proj(*a, embed_scale=16.0, backend="cuda") + 1

    got = torch.compile(step, fullgraph=True)(*args) - 1
    exact = exact_down_proj(token_ids, embed_table, hidden, weight, 16.0)
    ref = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=16.0, backend="torch")
    assert_tolerance(got.cpu().float(), exact, ref, atol=2e-2, what="compiled")


def test_opcheck():
    args = [t.to(DEV) for t in make_inputs(3, 64, 16, torch.bfloat16)]
    cuda_backend._ops()
    out = torch.empty(3, 16, dtype=torch.bfloat16, device=DEV)
    torch.library.opcheck(torch.ops.gemma4_mtp.fused_concat_down_proj.default, (*args, 8.0, out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 20, 64])
def test_out_of_range_token_gives_nan_row_on_the_tensor_core_path(T, dtype):
    d = DRAFTERS["31B"]
    token_ids, embed_table, hidden, weight = make_inputs(T, d["Hb"], d["Hd"], dtype, V=10)
    token_ids[T // 2] = 10**6
    got = cuda_backend.fused_concat_down_proj(*(t.to(DEV) for t in (token_ids, embed_table, hidden, weight)),
                                              embed_scale=1.0).cpu()
    assert torch.isnan(got[T // 2]).all()
    others = [t for t in range(T) if t != T // 2]
    assert not torch.isnan(got[others]).any()


def test_split_k_replays_and_eager_calls_agree():
    """The split-k path's per-tile counters (cached, left zero by every launch) elect each tile's last
    CTA afresh: a captured call replayed many times, with eager calls between, gives the same bits
    (deterministic: partials summed in split order)."""
    d = DRAFTERS["31B"]
    token_ids, embed_table, hidden, weight = (t.to(DEV) for t in make_inputs(1, d["Hb"], d["Hd"], torch.bfloat16))
    first = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=73.5, backend="cuda")
    out = poisoned((1, d["Hd"]), torch.bfloat16, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=73.5, out=out, backend="cuda")
    for _ in range(20):
        graph.replay()
        eager = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=73.5, backend="cuda")
    torch.cuda.synchronize()
    assert not first.isnan().any()
    assert torch.equal(out, first) and torch.equal(eager, first)
