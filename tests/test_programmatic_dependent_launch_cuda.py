"""Programmatic dependent launch (GPU, sm_90 and newer): every Triton kernel of a drafter step is
scheduled before the kernel whose output it reads has finished and waits for it in
griddepcontrol.wait (`gemma4_mtp_kernels.triton._common.pdl_args`). A kernel that read too early would
change bits; the CPU half (every sm_90 launch has the flag and waits before its first global access)
is tests/test_triton_aot.py."""
from unittest import mock

import pytest
import torch

from gemma4_mtp.drafter import random_drafter, synthetic_context
from gemma4_mtp.graphs import DraftGraphs, draft_tree
from gemma4_mtp_kernels.triton import _common

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("name", ["E2B", "31B"])
def test_programmatic_dependent_launch_changes_no_bit(name):
    """On sm_90 every Triton kernel of a step is scheduled before the kernel it reads has finished and
    waits for it in griddepcontrol.wait: steps and replayed rounds with it give the bits they give
    without it (a kernel reading its predecessor's output too early would not), replay after replay."""
    if not _common.pdl_args(DEV).get("launch_pdl"):
        pytest.skip("programmatic dependent launch: sm_90 and newer, GEMMA4_MTP_PDL not 0")
    drafter = random_drafter(name, device=DEV, backend="triton")
    ctx = synthetic_context(drafter, 3, 8192, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    pending = torch.randint(0, drafter.config.text.vocab_size, (3,), generator=g, device=DEV)
    hidden = torch.randn(3, drafter.config.backbone_hidden_size, generator=g, device=DEV).to(torch.bfloat16)

    def step():
        last, post = drafter.step(ctx, pending.view(-1, 1), hidden.unsqueeze(1))
        return last.clone(), post.clone(), drafter.top_tokens(last, 2)

    with mock.patch.object(_common, "PDL", False):
        want = step()
        want_round = draft_tree(drafter, ctx, pending, hidden, (2, 2, 1))
    for got, exp in zip(step(), want):
        assert torch.equal(got, exp)
    runner = DraftGraphs(drafter, table_width=ctx.block_table["full_attention"].shape[1], buckets=(4,), keep_after=1)
    for _ in range(5):
        assert torch.equal(runner.draft(ctx, pending, hidden, (2, 2, 1)), want_round)
