"""The interpreter's published-read check (tests/published_reads.py) on two toy launches: programs that
sum every program's value, electing the last to arrive (passes), or each summing without an election
(fails, though its final output is right: the last program's sum overwrites the early ones)."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the check hooks the interpreter")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from published_reads import PublishedReadError  # noqa: E402


@triton.jit
def _sum_all(values, partials, counter, out, N: tl.constexpr, ELECT: tl.constexpr):
    pid = tl.program_id(0)
    tl.store(partials + pid, tl.load(values + pid) * 2)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if (arrived == N - 1) or (not ELECT):
        total = tl.sum(tl.load(partials + tl.arange(0, N), cache_modifier=".cg"), axis=0)
        tl.store(out, total)
        tl.store(counter, 0)


def _run(elect: bool) -> torch.Tensor:
    N = 4
    values = torch.arange(1.0, N + 1)
    partials = torch.full((N,), float("nan"))
    counter = torch.zeros(1, dtype=torch.int32)
    out = torch.full((1,), float("nan"))
    _sum_all[(N,)](values, partials, counter, out, N=N, ELECT=elect)
    return out


def test_the_check_is_installed():
    import conftest
    assert conftest.PUBLISHED_READS_CHECKED


def test_an_elected_merge_passes():
    assert _run(True).item() == 20.0


def test_a_merge_without_election_fails_though_its_output_is_right():
    with pytest.raises(PublishedReadError, match="_sum_all"):
        _run(False)
