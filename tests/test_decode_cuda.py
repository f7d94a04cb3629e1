"""The decode loop on CUDA tensors (GPU only): the embedded target and drafter on the device, the
drafter's ops and tree_verify through each GPU backend.

Greedy speculative decoding must reproduce target-only greedy decoding on the same device token for
token (chains, trees, a ragged batch); sampling must emit in-vocabulary tokens and repeat itself for
the same seed. The first GPU run failed here: the greedy Triton tree_verify launch did not compile.
"""
import pytest
import torch

from gemma4_mtp import load_drafter, load_target, speculative_generate
from gemma4_mtp import train as T
from helpers import held_out_prompts

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SHAPES = {"chain 4": dict(num_draft_tokens=4), "tree 2,2,1": dict(num_draft_tokens=None, tree=(2, 2, 1))}


@pytest.fixture(scope="module")
def target():
    return load_target(T.ASSETS / "target", device=DEV)


@pytest.fixture(scope="module")
def prompts():
    return held_out_prompts((64, 41, 23))  # ragged


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_greedy_matches_target_only_decoding(target, prompts, backend, shape):
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend=backend)
    spec = speculative_generate(target, drafter, prompts, max_new_tokens=48, **SHAPES[shape])
    base = speculative_generate(target, None, prompts, max_new_tokens=48, num_draft_tokens=0)
    for b in range(len(prompts)):
        assert torch.equal(spec.ids[b].cpu(), base.ids[b].cpu()), f"request {b}"
    assert spec.stats.tokens_per_target_forward > 1.0


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("backend", ["auto", "triton", "cuda"])
def test_sampling_runs_and_repeats_for_a_seed(target, prompts, backend, shape):
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend=backend)
    kw = dict(max_new_tokens=32, temperature=0.8, seed=7, **SHAPES[shape])
    first = speculative_generate(target, drafter, prompts[:2], **kw)
    again = speculative_generate(target, drafter, prompts[:2], **kw)
    V = target.config.vocab_size
    for b in range(2):
        ids = first.ids[b].cpu()
        assert ids.numel() > 0
        assert bool(((ids >= 0) & (ids < V)).all())
        assert torch.equal(ids, again.ids[b].cpu())


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_sampled_drafts_with_draft_probabilities(target, prompts, backend):
    """sample_drafts=True verifies chains with the drafter's probabilities (rejection sampling)."""
    drafter = load_drafter(T.ASSETS / "drafter", device=DEV, backend=backend)
    out = speculative_generate(target, drafter, prompts[:2], max_new_tokens=32, num_draft_tokens=3,
                               temperature=1.0, seed=3, sample_drafts=True)
    V = target.config.vocab_size
    for b in range(2):
        ids = out.ids[b].cpu()
        assert ids.numel() > 0 and bool(((ids >= 0) & (ids < V)).all())
