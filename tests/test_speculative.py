"""speculative_generate: exact against the greedy oracle over Hugging Face's forward (hf_tiny.greedy_oracle,
whole-sequence recompute, prompts longer than the sliding window), the target's distribution when
sampling, batched == alone, schedules, EOS. Tiny fp32 checkpoints, backend="torch" ops.

Random drafters accept almost nothing, so most cases also run the "agreeing" pair of hf_tiny, whose
drafter usually holds the target's next token in its top-2: multi-token acceptance, accepted tree
branches that are not first children, and K/V commits of non-contiguous paths all happen."""

import pytest
import torch

import hf_tiny
from gemma4_mtp import load_drafter, load_target, speculative_generate

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


MAX_NEW = 20


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    tp, dp = tmp_path_factory.mktemp("rt"), tmp_path_factory.mktemp("rd")
    hf = hf_tiny.build_target(tp, seed=11, k_eq_v=False, tie=False)
    hf_tiny.build_drafter(dp, seed=12, k_eq_v=False, ordered=True)
    return hf, load_target(tp, block_size=4, num_blocks=512), load_drafter(dp, backend="torch")


@pytest.fixture(scope="module")
def agreeing_pair(tmp_path_factory):
    tp, dp = tmp_path_factory.mktemp("at"), tmp_path_factory.mktemp("ad")
    hf, _ = hf_tiny.build_agreeing_pair(tp, dp, seed=0, ordered=False)
    return hf, load_target(tp, block_size=4, num_blocks=4096), load_drafter(dp, backend="torch")


def prompts(seed=0, lengths=(9, 12, 19)):
    """Ragged, every prompt longer than the sliding window (8)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, hf_tiny.VOCAB, (n,), generator=g) for n in lengths]


def hf_greedy(hf, ps, max_new=MAX_NEW, eos=1):
    """hf_tiny.greedy_oracle, remembered on the model (several tests decode the same prompts)."""
    cache = hf.__dict__.setdefault("_oracle_cache", {})
    key = (max_new, eos, tuple(tuple(p.tolist()) for p in ps))
    if key not in cache:
        cache[key] = hf_tiny.greedy_oracle(hf, ps, max_new, eos=eos)
    return cache[key]


DRAFTING = [
    dict(num_draft_tokens=1),
    dict(num_draft_tokens=3),
    dict(num_draft_tokens=2, draft_schedule="heuristic"),
    dict(num_draft_tokens=None, tree=(2, 2, 1)),
    dict(num_draft_tokens=None, tree=(3, 1)),
]


@pytest.mark.parametrize("pair", ["random_pair", "agreeing_pair"])
@pytest.mark.parametrize("kw", DRAFTING, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_greedy_matches_the_forward_oracle(pair, kw, request):
    hf, target, drafter = request.getfixturevalue(pair)
    ps = prompts()
    eos = None if pair == "agreeing_pair" else 1  # the agreeing target cycles; EOS has its own test
    out = speculative_generate(target, drafter, ps, max_new_tokens=MAX_NEW, eos_token_id=eos, **kw)
    for ids, ref in zip(out.ids, hf_greedy(hf, ps, eos=eos)):
        assert ids.tolist() == ref.tolist()
    if pair == "agreeing_pair" and kw.get("num_draft_tokens") != 1:
        assert out.stats.mean_accepted > 1.0


def test_target_only_decoding_and_streaming(random_pair):
    """num_draft_tokens=0 decodes with the target alone (one forward per token); on_tokens streams
    exactly the returned ids, in order."""
    hf, target, drafter = random_pair
    ps = prompts()
    streamed = [[] for _ in ps]
    out = speculative_generate(target, None, ps, max_new_tokens=MAX_NEW, num_draft_tokens=0,
                               on_tokens=lambda b, toks: streamed[b].extend(toks))
    for ids, ref, got in zip(out.ids, hf_greedy(hf, ps), streamed):
        assert ids.tolist() == ref.tolist() == got
    assert out.stats.target_forwards == out.stats.new_tokens
    with pytest.raises(ValueError, match="drafter"):
        speculative_generate(target, None, ps, max_new_tokens=4, num_draft_tokens=2)


def test_batch_of_one_and_query_positions(agreeing_pair):
    hf, target, drafter = agreeing_pair
    p = prompts()[1]
    expect = hf_greedy(hf, [p], eos=None)[0].tolist()
    for qp in ("last_cached", "next"):
        out = speculative_generate(target, drafter, p, max_new_tokens=MAX_NEW, num_draft_tokens=4,
                                   query_position=qp, eos_token_id=None)
        assert out.ids[0].tolist() == expect


def test_agreeing_drafter_acceptance(agreeing_pair):
    """Chain and tree acceptance of the agreeing pair; tree rounds accept branches beyond the first child."""
    _, target, drafter = agreeing_pair
    ps = prompts(seed=3, lengths=(3, 9, 14))  # the thresholds below were set on these
    chain = speculative_generate(target, drafter, ps, max_new_tokens=32, num_draft_tokens=4, eos_token_id=None)
    tree = speculative_generate(target, drafter, ps, max_new_tokens=32, num_draft_tokens=None, tree=(2, 2, 2),
                                eos_token_id=None)
    print(f"\nagreeing drafter: chain(4) mean accepted {chain.stats.mean_accepted:.2f}, "
          f"tokens/target forward {chain.stats.tokens_per_target_forward:.2f}; tree(2,2,2) mean accepted "
          f"{tree.stats.mean_accepted:.2f}, tokens/target forward {tree.stats.tokens_per_target_forward:.2f}")
    assert chain.stats.mean_accepted >= 1.5
    assert tree.stats.mean_accepted > chain.stats.mean_accepted
    # in a (2, 2, 2) tree the first-child chain is nodes 1, 3, 7
    first_children = [1, 3, 7]
    off = [path for per in tree.stats.accepted_paths for path in per if path != first_children[:len(path)]]
    assert off, "no round accepted a second branch"
    for ids_c, ids_t in zip(chain.ids, tree.ids):
        assert torch.equal(ids_c, ids_t)
    s = chain.stats
    assert s.tokens_per_target_forward == pytest.approx(sum(s.new_tokens) / sum(s.target_forwards))
    assert s.mean_acceptance_length == pytest.approx(s.mean_accepted + 1)


def test_heuristic_schedule(agreeing_pair):
    _, target, drafter = agreeing_pair
    out = speculative_generate(target, drafter, prompts(seed=4), max_new_tokens=40, num_draft_tokens=2,
                               draft_schedule="heuristic", eos_token_id=None)
    grew = shrank = False
    for accepted, drafted, n in zip(out.stats.accepted_per_round, out.stats.draft_lengths, out.stats.new_tokens):
        k, emitted = 2, 1
        for a, d in zip(accepted, drafted):
            assert d == min(k, 40 - emitted - 1)
            grew |= a == d and d > 0
            shrank |= a < d
            k = k + 2 if a == d else max(1, k - 1)
            emitted += a + 1
        assert min(emitted, 40) == n
    assert grew and shrank


@pytest.mark.parametrize("kw,temperature", [
    (dict(num_draft_tokens=3), 0.0), (dict(num_draft_tokens=None, tree=(2, 2)), 0.0),
    (dict(num_draft_tokens=3, sample_drafts=False), 1.0), (dict(num_draft_tokens=None, tree=(2, 2)), 1.0),
    (dict(num_draft_tokens=3), 1.0), (dict(num_draft_tokens=3, draft_schedule="heuristic"), 1.0),
], ids=["chain-greedy", "tree-greedy", "chain-sampling-argmax-drafts", "tree-sampling", "chain-sampled-drafts",
        "heuristic-sampled-drafts"])
def test_batched_equals_alone(agreeing_pair, kw, temperature):
    _, target, drafter = agreeing_pair
    ps = prompts(seed=5)
    batched = speculative_generate(target, drafter, ps, max_new_tokens=MAX_NEW, temperature=temperature, seed=7,
                                   eos_token_id=None, **kw)
    for b, p in enumerate(ps):
        # request b of a batch samples with seed + b
        alone = speculative_generate(target, drafter, p, max_new_tokens=MAX_NEW, temperature=temperature,
                                     seed=7 + b, eos_token_id=None, **kw)
        assert torch.equal(alone.ids[0], batched.ids[b])
        assert alone.stats.accepted_per_round[0] == batched.stats.accepted_per_round[b]


def test_eos_stops_a_request(random_pair):
    hf, target, drafter = random_pair
    ps = prompts(seed=6)
    free = speculative_generate(target, drafter, ps, max_new_tokens=MAX_NEW, num_draft_tokens=2, eos_token_id=None)
    eos = int(free.ids[1][MAX_NEW // 2])
    out = speculative_generate(target, drafter, ps, max_new_tokens=MAX_NEW, num_draft_tokens=2, eos_token_id=eos)
    for before, ids, ref in zip(free.ids, out.ids, hf_greedy(hf, ps, eos=eos)):
        hits = (before == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else MAX_NEW
        assert ids.tolist() == before[:stop].tolist() == ref.tolist()


@torch.no_grad()
def test_bf16_greedy_follows_hf_bf16(tmp_path):
    """bf16 weights and cache, centroid head: token for token the greedy oracle over HF's bf16 forward,
    except after a step where HF's own top-2 logits are within bf16 rounding (a verify forward over
    several tokens may round differently from HF's whole-sequence forward); there our token must be
    HF's runner-up."""
    hf, _ = hf_tiny.build_agreeing_pair(tmp_path / "t", tmp_path / "d", seed=2, ordered=True)
    hf = hf.to(torch.bfloat16)
    target = load_target(tmp_path / "t", dtype=torch.bfloat16, block_size=4, num_blocks=512)
    drafter = load_drafter(tmp_path / "d", dtype=torch.bfloat16, backend="torch")
    ps = prompts(seed=8)
    for kw in (dict(num_draft_tokens=3), dict(num_draft_tokens=None, tree=(2, 2))):
        out = speculative_generate(target, drafter, ps, max_new_tokens=MAX_NEW, eos_token_id=None, **kw)
        for p, ids, ref in zip(ps, out.ids, hf_greedy(hf, ps, eos=None)):
            differ = (ids != ref).nonzero()
            if len(differ):
                i = int(differ[0])
                logits = hf(torch.cat([p, ref[:i]])[None]).logits[0, -1].float()
                top = torch.topk(logits, 2)
                assert int(ids[i]) == int(top.indices[1]) and float(top.values[0] - top.values[1]) <= 0.25


@pytest.mark.parametrize("kw", [dict(num_draft_tokens=2, sample_drafts=False), dict(num_draft_tokens=2),
                                dict(num_draft_tokens=None, tree=(2, 2))],
                         ids=["chain-argmax-drafts", "chain-sampled-drafts", "tree"])
def test_sampling_matches_target_distribution(agreeing_pair, kw):
    """600 sampled 4-token continuations against the target's exact joint distribution (chi-square)."""
    hf, target, drafter = agreeing_pair
    prompt, steps, temperature, n = torch.tensor([5, 17, 33, 2]), 4, 1.0, 600
    exact = hf_tiny.exact_distribution(hf, prompt, steps, temperature)
    out = speculative_generate(target, drafter, [prompt] * n, max_new_tokens=steps, temperature=temperature,
                               seed=123, eos_token_id=None, **kw)
    assert out.stats.mean_accepted > 0.15, "drafts were hardly accepted: the test would not exercise verification"
    hf_tiny.check_distribution([tuple(ids.tolist()) for ids in out.ids], exact)


def test_bad_arguments(random_pair, request):
    _, target, drafter = random_pair
    p = torch.tensor([3, 4, 5])
    for kw, match in [
        (dict(max_new_tokens=0, num_draft_tokens=2), "max_new_tokens"),
        (dict(max_new_tokens=4, num_draft_tokens=-1), "num_draft_tokens"),
        (dict(max_new_tokens=4, num_draft_tokens=0, draft_schedule="heuristic"), "draft_schedule"),
        (dict(max_new_tokens=4, num_draft_tokens=3, tree=(2, 2)), "tree depth"),
        (dict(max_new_tokens=4, num_draft_tokens=None, tree=(2, 0)), "tree"),
        (dict(max_new_tokens=4, num_draft_tokens=None, tree=(2,), draft_schedule="heuristic"), "draft_schedule"),
        (dict(max_new_tokens=4, num_draft_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=4, num_draft_tokens=2, query_position="P+1"), "query_position"),
        (dict(max_new_tokens=4, num_draft_tokens=2, draft_schedule="fast"), "draft_schedule"),
        (dict(max_new_tokens=4, num_draft_tokens=None, tree=(1000,)), "candidate"),
        (dict(max_new_tokens=4, num_draft_tokens=2, sample_drafts=True), "sample_drafts"),
        (dict(max_new_tokens=4, num_draft_tokens=None, tree=(2,), temperature=1.0, sample_drafts=True),
         "sample_drafts"),
        (dict(max_new_tokens=4, num_draft_tokens=2, temperature=1.0, seed=2**64), "seed"),
        (dict(max_new_tokens=4, num_draft_tokens=2, temperature=1.0, seed=1.5), "seed"),
    ]:
        with pytest.raises(ValueError, match=match):
            speculative_generate(target, drafter, p, **kw)
    _, _, dense_drafter = request.getfixturevalue("agreeing_pair")  # dense LM head over the whole vocabulary
    with pytest.raises(ValueError, match="candidate"):
        speculative_generate(target, dense_drafter, p, max_new_tokens=4, num_draft_tokens=None,
                             tree=(hf_tiny.VOCAB + 1,))
    with pytest.raises(ValueError, match="prompt_ids"):
        speculative_generate(target, drafter, [], max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(ValueError, match="prompt_ids"):
        speculative_generate(target, drafter, torch.zeros(0, 3, dtype=torch.long), max_new_tokens=4,
                             num_draft_tokens=2)
    for bad in (-1, hf_tiny.VOCAB):
        with pytest.raises(ValueError, match="prompt_ids"):
            speculative_generate(target, drafter, torch.tensor([3, bad]), max_new_tokens=4, num_draft_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        speculative_generate(target, drafter, [p, torch.tensor([], dtype=torch.long)], max_new_tokens=4,
                             num_draft_tokens=2)
    assert not target.lengths, "a failed call must release its requests"


def test_every_block_is_returned(agreeing_pair):
    """After a run, and after a run that a streaming callback aborts, both caches hold every block
    exactly once (sliding-window frees and rejected-branch trims never double-release)."""
    _, target, drafter = agreeing_pair

    def full():
        for c in target.caches.values():
            assert sorted(c.allocator._free) == list(range(c.allocator.num_blocks))

    speculative_generate(target, drafter, prompts(seed=9), max_new_tokens=30, num_draft_tokens=None, tree=(2, 2),
                         eos_token_id=None)
    full()

    def abort(b, tokens):
        if b == 1 and len(tokens) > 1:
            raise KeyError("stop")

    with pytest.raises(KeyError):
        speculative_generate(target, drafter, prompts(seed=9), max_new_tokens=30, num_draft_tokens=3,
                             eos_token_id=None, on_tokens=abort)
    full()
    assert not target.lengths
