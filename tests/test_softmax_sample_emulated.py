"""The CUDA softmax_sample kernels run on the CPU: their own source (csrc/include/gemma4_mtp/softmax_sample.cuh,
launcher included) compiled with g++ against tests/cuda_emulator (threads as fibers, warp shuffles), under
AddressSanitizer, against test_softmax_sample's oracle like the other backends.

tests/cuda_emulator/softmax_sample_main.cpp copies the logits, temperatures and uniforms into allocations
of exactly their extent (a read past a row is an AddressSanitizer error), poisons q (NaN), the tokens (-1)
and the workspace, launches, checks the launches (two; programmatic dependent launch on sm_90 only; the
counters left zero) and writes q and the tokens back. The emulator also fails a block that reads another
block's chunk mass or q before the row's election (check_published_reads). Covered: one and several
chunks, a ragged last chunk, a centroid head's -inf outside its candidates, every dtype, strided rows and
uniforms, the fallback when the total stays at or below u, more than 256 chunks (the crossing found in a
second pass of the block scan), a row without a distribution (-1). Not covered: timing, the GPU's
memory ordering (test_softmax_sample.py runs the op on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import emulated
from test_softmax_sample import CHUNK, assert_inverse_cdf, case, oracle_probs


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "softmax_sample_main.cpp", "softmax_sample")


def emulated_sample(binary, tmp_path, logits, temperature, uniforms, *, ls=None, qs=None, us=1, major=9,
                    schedule="rr"):
    """softmax_sample through the emulator: logits rows at stride ls, q rows at qs, uniforms at us."""
    B, V = logits.shape
    ls, qs = ls or V, qs or V
    emulated.write(tmp_path / "logits.bin", logits)
    emulated.write(tmp_path / "temperature.bin", temperature)
    emulated.write(tmp_path / "uniforms.bin", uniforms)
    emulated.run(binary, f"dir={tmp_path} dtype={emulated.DTYPE_NAMES[logits.dtype]} B={B} V={V} ls={ls} qs={qs} "
                         f"us={us} major={major} schedule={schedule}")
    return (emulated.read(tmp_path / "tokens.bin", torch.int64, (B,)),
            emulated.read(tmp_path / "probs.bin", torch.float32, (B, V)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,V,support", [(1, 100, None), (3, 2 * CHUNK + 904, None), (2, 3 * CHUNK, 700)],
                         ids=["one chunk", "ragged last chunk", "centroid support"])
def test_against_the_oracle(binary, tmp_path, dtype, B, V, support):
    logits, temperature, uniforms = case(B, V, dtype, seed=V + B, support=support)
    tokens, probs = emulated_sample(binary, tmp_path, logits, temperature, uniforms)
    np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
    assert_inverse_cdf(tokens, probs, uniforms)


@pytest.mark.parametrize("major,schedule", [(8, "rr"), (9, "behind"), (9, "ahead")])
def test_strided_rows_and_schedules(binary, tmp_path, major, schedule):
    logits, temperature, uniforms = case(3, CHUNK + 77, torch.bfloat16, seed=3)
    tokens, probs = emulated_sample(binary, tmp_path, logits, temperature, uniforms, ls=CHUNK + 80, qs=CHUNK + 96,
                                    us=3, major=major, schedule=schedule)
    np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
    assert_inverse_cdf(tokens, probs, uniforms)


def test_total_at_or_below_the_uniform_takes_the_last_token(binary, tmp_path):
    logits, temperature, uniforms = case(6, CHUNK + 300, torch.float32, seed=4, support=40)
    _, probs = emulated_sample(binary, tmp_path, logits, temperature, uniforms)
    totals = probs.double().sum(1)
    assert bool((totals < 1).any()), totals
    u = torch.where(totals < 1, totals, torch.full_like(totals, 0.5))
    tokens, probs = emulated_sample(binary, tmp_path, logits, temperature, u)
    for b in (totals < 1).nonzero().flatten().tolist():
        assert tokens[b] == int((probs[b] > 0).nonzero().max())
    assert_inverse_cdf(tokens, probs, u)


def test_more_chunks_than_threads(binary, tmp_path):
    """300 chunks: the crossing chunk is found in the second 256-chunk pass for uniforms near 1."""
    V = 300 * CHUNK - 5
    logits, temperature, _ = case(2, V, torch.bfloat16, seed=8, scale=0.5)
    uniforms = torch.tensor([0.97, 0.2], dtype=torch.float64)
    tokens, probs = emulated_sample(binary, tmp_path, logits, temperature, uniforms)
    np.testing.assert_allclose(probs.numpy(), oracle_probs(logits, temperature), rtol=2e-5, atol=1e-9)
    assert_inverse_cdf(tokens, probs, uniforms)
    assert tokens[0] >= 256 * CHUNK


def test_a_row_without_distribution_gives_minus_one(binary, tmp_path):
    logits, temperature, uniforms = case(3, 300, torch.float32, seed=2)
    logits[1] = float("-inf")
    tokens, probs = emulated_sample(binary, tmp_path, logits, temperature, uniforms)
    assert tokens[1] == -1 and torch.isnan(probs[1]).all()
    ok = [0, 2]
    np.testing.assert_allclose(probs[ok].numpy(), oracle_probs(logits[ok], temperature[ok]), rtol=2e-5, atol=1e-9)
    assert_inverse_cdf(tokens[ok], probs[ok], uniforms[ok])
