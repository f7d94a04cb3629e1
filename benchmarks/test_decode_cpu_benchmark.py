"""CPU benchmark of the reference decode loop (pytest-benchmark): tokens per target forward and
wall clock of speculative decoding against target-only greedy decoding, on the tiny Hugging Face
pair of tests/hf_tiny.py whose drafter agrees with the target about half the time.

    pytest benchmarks/test_decode_cpu_benchmark.py            # timings + extra_info per case

What this measures is the loop's bookkeeping on a CPU and the acceptance the pair gives; it says
nothing about GPU speed (the tiny model is ~100 KB: every forward is Python overhead).
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import hf_tiny  # noqa: E402
from gemma4_mtp import load_drafter, load_target, speculative_generate  # noqa: E402

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("pair")
    hf_tiny.build_agreeing_pair(d / "target", d / "drafter")
    target = load_target(d / "target", block_size=4, num_blocks=256)
    drafter = load_drafter(d / "drafter", backend="torch")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in (5, 9)]
    return target, drafter, prompts


@torch.no_grad()
def target_only_greedy(target, prompt, n):
    """One target forward per token: the baseline speculative decoding is measured against."""
    req = target.new_request()
    try:
        out = target.prefill([req], [prompt])
        tok = int(out.logits[0, len(prompt) - 1].argmax())
        ids = [tok]
        while len(ids) < n:
            out = target.forward_tree([req], [torch.tensor([tok])], [[-1]])
            target.commit(req, [])
            tok = int(out.logits[0, 0].argmax())
            ids.append(tok)
        return ids
    finally:
        target.release(req)


def test_target_only(benchmark, pair):
    target, _, prompts = pair
    ids = benchmark.pedantic(lambda: [target_only_greedy(target, p, NEW_TOKENS) for p in prompts],
                             rounds=3, iterations=1)
    benchmark.extra_info.update(tokens_per_target_forward=1.0, new_tokens=sum(map(len, ids)))


@pytest.mark.parametrize("k", [2, 4])
def test_speculative_chain(benchmark, pair, k):
    target, drafter, prompts = pair
    expected = [target_only_greedy(target, p, NEW_TOKENS) for p in prompts]

    def run():
        return speculative_generate(target, drafter, prompts, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                                    eos_token_id=None)

    out = benchmark.pedantic(run, rounds=3, iterations=1)
    # the speed-up is only worth reporting if the output is the target's own greedy output
    assert [list(map(int, ids)) for ids in out.ids] == expected
    s = out.stats
    benchmark.extra_info.update(tokens_per_target_forward=s.tokens_per_target_forward,
                                mean_acceptance_length=s.mean_acceptance_length, rounds=s.rounds)
    assert s.tokens_per_target_forward > 1.0  # the pair agrees often enough to save forwards
