"""`python -m gemma4_mtp`: the README's main command, run as a newcomer runs it."""
import os
import subprocess
import sys

import pytest
import torch


def _run(*args, env=None):
    """The command with env's variables set (None: removed)."""
    full = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-m", "gemma4_mtp", *args], capture_output=True, text=True,
                          timeout=600, env=full)


def test_default_command_generates_exactly():
    p = _run("generate", "--max-new-tokens", "32")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "greedy output matches target-only decoding" in out
    tpf = float(out.split("tokens per forward")[1].split()[0])
    assert tpf > 1.0  # the trained drafter gets drafts accepted on the default prompt


@pytest.mark.parametrize("args", [["--tree", "2,2,1"], ["--temperature", "0.8", "--seed", "1"]])
def test_generate_tree_and_sampling(args):
    p = _run("generate", "--max-new-tokens", "16", *args)
    assert p.returncode == 0, p.stderr
    assert "tokens per forward" in p.stdout


def test_bad_tree_argument_is_an_argparse_error():
    p = _run("generate", "--tree", "2,0")
    assert p.returncode == 2 and "--tree" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("interpret", ["1", None], ids=["TRITON_INTERPRET=1", "as a newcomer runs it"])
def test_selfcheck_all_available_backends_agree(interpret):
    """Without TRITON_INTERPRET in the environment too (the command sets it for itself on a machine
    without CUDA: it used to report every Triton row as an error there)."""
    p = _run("selfcheck", env={"TRITON_INTERPRET": interpret})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MISMATCH" not in p.stdout and "ERROR" not in p.stdout
    rows = [line.split() for line in p.stdout.splitlines()[1:]]
    for op in ("fused_concat_down_proj", "q_only_paged_attention", "centroid_logits", "tree_verify",
               "softmax_sample"):
        if not torch.cuda.is_available():
            assert [op, "triton", "ok"] in [r[:3] for r in rows], p.stdout  # the interpreter serves every op


def test_generate_with_triton_on_cpu_as_a_newcomer_runs_it():
    p = _run("generate", "--max-new-tokens", "6", "--backend", "triton", "--device", "cpu",
             env={"TRITON_INTERPRET": None})
    assert p.returncode == 0, p.stderr
    assert "greedy output matches target-only decoding" in p.stdout


@pytest.mark.parametrize("args,name", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--draft-tokens", "-1"], "--draft-tokens"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--seed", str(2**64)], "--seed"),
    (["--device", "gpu"], "--device"),
], ids=lambda a: a if isinstance(a, str) else " ".join(a))
def test_bad_numbers_are_argparse_errors(args, name):
    p = _run("generate", *args)
    assert p.returncode == 2 and name in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("args,words", [
    (["--model-dir", "/nonexistent"], "tokenizer.json"),
    (["--tree", "1000"], "tree"),  # more branches than the centroid head has candidates
    (["--backend", "cuda", "--device", "cpu"], "cuda"),
], ids=["model-dir", "tree-too-wide", "cuda-backend-on-cpu"])
def test_user_errors_are_one_line_not_a_traceback(args, words):
    p = _run("generate", "--max-new-tokens", "4", *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "error:" in p.stderr and words in p.stderr, p.stderr


def test_zero_draft_tokens_decode_with_the_target_alone():
    p = _run("generate", "--max-new-tokens", "6", "--draft-tokens", "0")
    assert p.returncode == 0, p.stderr
    assert "greedy output matches target-only decoding" in p.stdout
