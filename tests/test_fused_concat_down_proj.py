"""Reference fused_concat_down_proj (SPEC §4.1) against an independent fp64 computation."""
import math

import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import reference
from helpers import DRAFTERS, assert_tolerance, poisoned

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def exact(token_ids, table, hidden, weight, embed_scale):
    """fp64 result with Gemma's two roundings: the scale to the table dtype, then the scaled row."""
    s = torch.tensor([embed_scale], dtype=torch.float64).to(table.dtype).double()
    # the product of two bf16/fp16/fp32 values is exact in fp64, so one rounding follows here
    emb = (table.double()[token_ids.long()] * s).to(table.dtype).double()
    return torch.cat([emb, hidden.double()], dim=1) @ weight.double().T


def same_dtype(token_ids, table, hidden, weight, embed_scale):
    """The same math done naively in the inputs' own dtype: the error budget for the result."""
    dt = table.dtype
    emb = table[token_ids.long()] * torch.tensor(embed_scale, dtype=dt)
    return torch.cat([emb, hidden], dim=1) @ weight.T


def inputs(T, V, Hb, Hd, dtype, *, gen=None):
    ids = torch.randint(0, V, (T,), generator=gen)
    table = torch.randn(V, Hb, generator=gen).to(dtype)
    hidden = torch.randn(T, Hb, generator=gen).to(dtype)
    weight = (torch.randn(Hd, 2 * Hb, generator=gen) / math.sqrt(2 * Hb)).to(dtype)
    return ids, table, hidden, weight


def check(y, args, embed_scale, what):
    ids, table, hidden, weight = args
    assert y.dtype == hidden.dtype and y.shape == (ids.shape[0], weight.shape[0])
    ex = exact(ids, table, hidden, weight, embed_scale)
    ref = same_dtype(ids, table, hidden, weight, embed_scale)
    # fp32 accumulation over 2*Hb products of O(sqrt(Hb))-sized values
    atol = 1e-5 * max(1.0, ex.abs().max().item() if ex.numel() else 0.0)
    assert_tolerance(y, ex, ref, atol=atol, what=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_real_drafter_shapes(name, dtype):
    d = DRAFTERS[name]
    args = inputs(5, 97, d["Hb"], d["Hd"], dtype)
    scale = math.sqrt(d["Hb"])
    y = g.fused_concat_down_proj(*args, embed_scale=scale, backend="torch")
    check(y, args, scale, f"{name} {dtype}")


@pytest.mark.parametrize("T", [0, 1, 2, 7, 33])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_awkward_token_counts(T, index_dtype):
    ids, table, hidden, weight = inputs(T, 11, 64, 48, torch.bfloat16)
    if T:
        ids[0], ids[-1] = 0, 10  # the first and last rows of the table
    ids = ids.to(index_dtype)
    y = g.fused_concat_down_proj(ids, table, hidden, weight, embed_scale=8.0, backend="torch")
    check(y, (ids, table, hidden, weight), 8.0, f"T={T}")


def test_reference_module_directly_and_repeated_ids():
    ids, table, hidden, weight = inputs(6, 5, 128, 32, torch.float32)
    ids[:] = torch.tensor([3, 3, 0, 4, 3, 0])
    y = reference.fused_concat_down_proj(ids, table, hidden, weight, embed_scale=2.5)
    check(y, (ids, table, hidden, weight), 2.5, "reference module")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_buffer_poisoned(dtype):
    args = inputs(9, 40, 256, 64, dtype)
    out = poisoned((9, 64), dtype)
    y = g.fused_concat_down_proj(*args, embed_scale=16.0, out=out, backend="torch")
    assert y is out
    check(out, args, 16.0, "out=")


def test_strided_inputs():
    """Row-strided views (stride 1 in the last dim) are legal inputs."""
    ids, table, hidden, weight = inputs(4, 20, 96, 40, torch.bfloat16)
    table_v = torch.cat([table, torch.full_like(table, float("nan"))], dim=1)[:, :96]
    hidden_v = torch.cat([torch.full_like(hidden, float("nan")), hidden], dim=1)[:, 96:]
    weight_v = torch.cat([weight, torch.full_like(weight, float("nan"))], dim=1)[:, :192]
    assert not hidden_v.is_contiguous()
    y = g.fused_concat_down_proj(ids, table_v, hidden_v, weight_v, embed_scale=3.0, backend="torch")
    check(y, (ids, table, hidden, weight), 3.0, "strided")


def test_bf16_scale_rounding_sqrt_1536():
    """sqrt(1536) = 39.19... is 39.25 in bf16, and the op must use 39.25 (then round the product)."""
    Hb = 1536
    assert torch.tensor(math.sqrt(Hb), dtype=torch.bfloat16).item() == 39.25
    V = 8
    table = torch.randn(V, Hb).to(torch.bfloat16)
    # weight = [I | 0] makes y the scaled embedding row itself, with no accumulation error
    weight = torch.cat([torch.eye(Hb), torch.zeros(Hb, Hb)], dim=1).to(torch.bfloat16)
    hidden = torch.randn(V, Hb).to(torch.bfloat16)
    ids = torch.arange(V)
    y = g.fused_concat_down_proj(ids, table, hidden, weight, embed_scale=math.sqrt(Hb), backend="torch")
    want = (table.double() * 39.25).to(torch.bfloat16)
    assert torch.equal(y, want)
    # the inputs tell the roundings apart: the unrounded scale and the unrounded product differ
    unrounded_scale = (table.double() * math.sqrt(Hb)).to(torch.bfloat16)
    assert not torch.equal(y, unrounded_scale)
    unrounded_product = (table.double() * 39.25).float()
    assert not torch.equal(y.float(), unrounded_product)


def test_fp16_scale_rounding():
    Hb = 2816  # 26B-A4B: sqrt(2816) = 53.066..., 53.0625 in fp16
    s16 = torch.tensor(math.sqrt(Hb), dtype=torch.float16).item()
    assert s16 != math.sqrt(Hb)
    table = torch.randn(4, Hb).to(torch.float16)
    weight = torch.cat([torch.eye(Hb), torch.zeros(Hb, Hb)], dim=1).to(torch.float16)
    hidden = torch.randn(4, Hb).to(torch.float16)
    y = g.fused_concat_down_proj(torch.arange(4), table, hidden, weight, embed_scale=math.sqrt(Hb), backend="torch")
    assert torch.equal(y, (table.double() * s16).to(torch.float16))


def test_hidden_half_is_second():
    """The embedding half of the weight comes first: zero embedding weight leaves weight[:, Hb:] @ h."""
    ids, table, hidden, weight = inputs(3, 10, 64, 16, torch.float32)
    weight[:, :64] = 0
    y = g.fused_concat_down_proj(ids, table, hidden, weight, embed_scale=8.0, backend="torch")
    torch.testing.assert_close(y.double(), hidden.double() @ weight[:, 64:].double().T, rtol=1e-5, atol=1e-5)
