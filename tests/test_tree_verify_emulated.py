"""The CUDA tree_verify kernel runs on the CPU: its own source (csrc/include/gemma4_mtp/tree_verify.cuh,
prepare and launcher included) compiled with g++ against tests/cuda_emulator (threads as fibers, warp
shuffles, a plain-access stand-in for libcu++'s atomic_ref), under AddressSanitizer, against the torch
reference with the comparison every backend's tests use (cases_tree_verify: greedy decisions exact,
sampling decisions equal except at honest floating-point boundaries).

tests/cuda_emulator/tree_main.cpp copies the inputs into allocations of exactly their extent (a read
past a row or a tensor is an AddressSanitizer error), poisons the outputs and the workspace, launches
once and checks that every counter was left zero. Blocks run one after another in launch order, which
is also the ticket order of a draft-probability launch, so phase B's waits find their rows decided (a
wait that could never end fails the run as a deadlock). Covered: the 16-byte and the element-wise loads, rows of one to
many chunks, greedy trees with padding and duplicate children, chains accepting fully, ties spanning
chunks, sampling rows mixed with greedy ones, uniforms on CDF boundaries, draft probabilities in fp32
and in the logits' type (phase A and phase B, the residual, an empty residual). Not covered: timing, the
GPU's memory ordering between CTAs and the ticket order under real concurrency: test_tree_verify_cuda.py
verifies those on a GPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import emulated
from cases_tree_verify import (assert_matches_reference, bench_like_chains, cdf_boundary_case, draft_probs_chains_case,
                               drafts_following, logits_for, random_tree, sampling_trees_case)
from gemma4_mtp_kernels import tree_verify
from gemma4_mtp_kernels._types import VerifyResult


@pytest.fixture(scope="module")
def binary(request):
    return emulated.build(request, "tree_main.cpp", "tree")


def run_emulated(binary, d: Path, draft_tokens, parents, logits, *, temperature=None, uniforms=None, draft_probs=None,
             sms=8, pad=0, schedule="rr") -> tuple[VerifyResult, dict]:
    """tree_verify on the emulator; `pad`: the logits' rows sit `pad` NaN elements apart (a strided
    [B, N, V] view whose gaps a kernel must never read); `schedule`: emu::Schedule (behind: warps and
    blocks from the highest index down)."""
    B, N, V = logits.shape
    for name, t in (("draft_tokens", draft_tokens), ("parents", parents), ("logits", logits)):
        emulated.write(d / f"{name}.bin", t)
    flags = f"ls={V + pad} sample={int(temperature is not None)} draft={int(draft_probs is not None)}"
    if temperature is not None:
        emulated.write(d / "temperature.bin", temperature.float())
        emulated.write(d / "uniforms.bin", uniforms.float())
    if draft_probs is not None:
        emulated.write(d / "draft_probs.bin", draft_probs)
        flags += f" qf32={int(draft_probs.dtype == torch.float32)}"
    plan = emulated.run(binary, f"dir={d} dtype={emulated.DTYPE_NAMES[logits.dtype]} B={B} N={N} V={V} "
                                f"ids64={int(draft_tokens.dtype == torch.int64)} {flags} sms={sms} schedule={schedule}")
    read = emulated.read
    got = VerifyResult(read(d / "accept_len.bin", torch.int32, (B,)), read(d / "accepted_nodes.bin", torch.int32, (B, N)),
                       read(d / "output_tokens.bin", torch.int64, (B, N)), read(d / "last_node.bin", torch.int32, (B,)))
    return got, plan

def check(binary, tmp_path, draft_tokens, parents, logits, *, sms=8, pad=0, schedule="rr", **kw):
    got, plan = run_emulated(binary, tmp_path, draft_tokens, parents, logits, sms=sms, pad=pad, schedule=schedule,
                             **kw)
    ref = tree_verify(draft_tokens, parents, logits, backend="torch", **kw)
    assert_matches_reference(got, ref, draft_tokens, parents, logits, **kw)
    return got, ref, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B,N,V", [(4, 9, 3001), (2, 5, 4096), (3, 1, 50)])
def test_greedy_trees(binary, tmp_path, B, N, V, dtype):
    g = torch.Generator().manual_seed(1)
    parents = random_tree(B, N, g)
    logits = logits_for(B, N, V, dtype, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g)
    _, _, plan = check(binary, tmp_path, tokens, parents, logits)
    assert plan["path"] == ("vec" if V % 8 == 0 else "scalar")


def test_greedy_chains_accept_fully_with_int32_ids_and_padded_rows(binary, tmp_path):
    g = torch.Generator().manual_seed(7)
    B, N, V = 3, 6, 4096
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=1.0).int()
    got, _, plan = check(binary, tmp_path, tokens, parents, logits, pad=8)
    assert got.accept_len.tolist() == [N - 1] * B
    assert plan["path"] == "vec"  # rows at a stride of V + 8 elements: still 16-byte aligned


def test_greedy_ties_lowest_id_and_duplicate_children(binary, tmp_path):
    """The tie spans chunks of the grid (many SMs: one row is cut in several CTAs)."""
    V = 20000
    logits = torch.zeros(1, 4, V)
    logits[0, 0, [700, 15000]] = 5.0
    logits[0, 1, [3, 4]] = 1.0
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    tokens = torch.tensor([[9, 700, 700, 3]])
    got, _, plan = check(binary, tmp_path, tokens, parents, logits, sms=132)
    assert int(plan["chunks"]) > 1
    assert got.accepted_nodes[0].tolist() == [1, 3, -1, -1]


def test_sampling_trees_mixed_with_greedy(binary, tmp_path):
    tokens, parents, logits, kw = sampling_trees_case(1500, torch.Generator().manual_seed(3))
    check(binary, tmp_path, tokens, parents, logits, **kw)


def test_sampling_uniforms_on_cdf_boundaries(binary, tmp_path):
    tokens, parents, logits, kw = cdf_boundary_case(torch.Generator().manual_seed(4))
    check(binary, tmp_path, tokens, parents, logits, **kw)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chains_with_draft_probs(binary, tmp_path, q_dtype):
    """Phase A decides each row, phase B sums the residual of rejected rows (one with p == q: an empty
    residual, sampled from p), in one launch of twice the CTAs."""
    tokens, parents, logits, kw = draft_probs_chains_case(2100, torch.Generator().manual_seed(5))
    kw["draft_probs"] = kw["draft_probs"].to(q_dtype)
    _, ref, _ = check(binary, tmp_path, tokens, parents, logits, sms=16, **kw)
    assert int(ref.accept_len.sum()) > 0 and bool((ref.accept_len < parents.shape[1] - 1).any())


@pytest.mark.parametrize("schedule", ["rr", "behind"])
def test_bench_like_chains_reject_into_the_residual(binary, tmp_path, schedule):
    """behind: the warps and the blocks from the highest index down, so the block that decides a row (the
    last of its chunks to arrive) is its first by index."""
    tokens, parents, logits, kw = bench_like_chains(4, 5, 4096, torch.bfloat16, torch.Generator().manual_seed(6),
                                                    torch.bfloat16)
    check(binary, tmp_path, tokens, parents, logits, sms=16, schedule=schedule, **kw)


def test_real_vocabulary_over_many_chunks(binary, tmp_path):
    """Gemma's 262144 ids at B = 1 on an H100's 132 SMs: a row in more than 28 chunks, so more than 224
    granules and every warp of the deciding CTA merges some (its block-wide argmax over all 8 warps)."""
    g = torch.Generator().manual_seed(8)
    B, N, V = 1, 3, 262144
    parents = random_tree(B, N, g, chain=True)
    logits = logits_for(B, N, V, torch.bfloat16, g)
    for node, best in enumerate((262000, 250000, 255555)):  # maxima in the last granules
        logits[0, node, best] = 40.0
    tokens = drafts_following(logits.float().argmax(-1), parents, V, g, hit=1.0)
    got, _, plan = check(binary, tmp_path, tokens, parents, logits, sms=132)
    assert int(plan["chunks"]) * 8 > 224
    assert got.accept_len.tolist() == [N - 1] and got.output_tokens[0].tolist() == [262000, 250000, 255555]
