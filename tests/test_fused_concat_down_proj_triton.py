"""Triton fused_concat_down_proj against the reference (SPEC §4.1, §6), under the interpreter on CPU."""
import math

import pytest
import torch

from gemma4_mtp_kernels import fused_concat_down_proj
from gemma4_mtp_kernels.triton import fused_concat_down_proj as triton_impl
from gemma4_mtp_kernels.triton._common import num_sms
from cases_fused_concat_down_proj import check_backend, exact_down_proj, make_inputs
from helpers import DRAFTERS, assert_tolerance, poisoned


def check(T, Hb, Hd, dtype, device="cpu", **kw):
    check_backend("triton", device, T, Hb, Hd, dtype, **kw)


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1])
def test_drafter_shapes_bf16(name, T):
    d = DRAFTERS[name]
    check(T, d["Hb"], d["Hd"], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,Hb,Hd", [(1, 64, 16), (7, 200, 72), (17, 96, 40), (65, 64, 24), (64, 128, 33)])
def test_awkward_shapes(T, Hb, Hd, dtype):
    check(T, Hb, Hd, dtype)


def test_int32_ids_and_strided_rows():
    check(5, 136, 48, torch.bfloat16, index_dtype=torch.int32, strided=True)


@pytest.mark.parametrize("T", [1, 3])
def test_zero_width_hidden(T):
    """Hb = 0 is legal (the op accepts it): the projection of an empty concat is 0, fully written."""
    token_ids, embed_table, hidden, weight = make_inputs(T, 0, 16, torch.bfloat16)
    out = poisoned((T, 16), torch.bfloat16)
    got = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=1.0, out=out, backend="triton")
    assert torch.equal(got, torch.zeros(T, 16, dtype=torch.bfloat16))


def test_split_and_single_launch_paths_agree_with_reference():
    """Few row tiles split K (partial sums + reduce); large T leaves SPLIT_K = 1 (direct store)."""
    from gemma4_mtp_kernels.triton.fused_concat_down_proj import launch_config
    assert launch_config(1, 1536, 256, 132)["split_k"] > 1  # E2B at T=1 on an H100/H200 splits
    sms = num_sms(torch.device("cpu"))
    assert launch_config(1, 1536, 32, sms)["split_k"] > 1
    assert launch_config(64, 128, 256, sms)["split_k"] == 1
    check(1, 1536, 32, torch.bfloat16)
    check(64, 128, 256, torch.bfloat16)


def test_scale_rounding_is_table_dtype():
    """sqrt(1536) rounds to 39.25 in bf16: a kernel using the fp32 scale is off by ~0.15% and fails."""
    T, Hb, Hd = 2, 1536, 16
    token_ids, embed_table, hidden, weight = make_inputs(T, Hb, Hd, torch.bfloat16)
    hidden.zero_()  # only the embedding half contributes
    got = triton_impl(token_ids, embed_table, hidden, weight, embed_scale=math.sqrt(Hb))
    exact = exact_down_proj(token_ids, embed_table, hidden, weight, math.sqrt(Hb))
    ref = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=math.sqrt(Hb), backend="torch")
    assert_tolerance(got, exact, ref, what="scale rounding")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("T", [1, 7, 64])
def test_drafter_shapes_on_gpu(name, T):
    d = DRAFTERS[name]
    check(T, d["Hb"], d["Hd"], torch.bfloat16, device="cuda")


def test_empty_T():
    token_ids, embed_table, hidden, weight = make_inputs(0, 32, 16, torch.bfloat16)
    got = fused_concat_down_proj(token_ids, embed_table, hidden, weight, embed_scale=2.0, backend="triton")
    assert got.shape == (0, 16) and got.dtype == torch.bfloat16


def test_out_of_range_token_gives_nan_row_not_a_read():
    """The GPU path skips the host check; the kernel must not read outside the table (NaN row instead).
    Called on the backend directly, as an unchecked CUDA call would reach it."""
    token_ids, embed_table, hidden, weight = make_inputs(3, 64, 16, torch.float32, V=10)
    token_ids[1] = 10**6
    got = triton_impl(token_ids, embed_table, hidden, weight, embed_scale=1.0)
    assert torch.isnan(got[1]).all()
    assert not torch.isnan(got[[0, 2]]).any()


def test_more_splits_than_loaded_at_once(monkeypatch):
    """An H200's split count on CPU (the interpreter's SM count raised to 132): 11 partials summed 8 at
    a time (sum_splits), the second group three partials and five masked."""
    from gemma4_mtp_kernels.triton import _common
    from gemma4_mtp_kernels.triton.fused_concat_down_proj import launch_config
    monkeypatch.setattr(_common, "INTERPRETER_SMS", 132)
    cfg = launch_config(1, 704, 32, num_sms(torch.device("cpu")))
    assert (cfg["split_k"], cfg["SPLIT_LOADS"]) == (11, 8)
    check(1, 704, 32, torch.bfloat16)
