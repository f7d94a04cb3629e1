"""gemma4_mtp.Gemma4Target against Hugging Face Gemma4ForCausalLM (fp32, tiny random checkpoints)."""
import json

import pytest
import torch

import hf_tiny
from helpers import tree_path
from gemma4_mtp import OutOfBlocksError, UnsupportedModelError, load_target
from gemma4_mtp.config import parse_drafter_config, parse_target_config

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module", params=[True, False], ids=["k_eq_v", "separate_v"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = hf_tiny.build_target(path, seed=3, k_eq_v=request.param, tie=request.param)
    return hf, load_target(path, block_size=4, num_blocks=64)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(ids)[None]).logits[0].float()


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_prefill_and_chain_steps_match_hf(pair):
    hf, target = pair
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, hf_tiny.VOCAB, (23,), generator=g)
    r = target.new_request()
    try:
        out = target.prefill([r], [seq[:13]])  # longer than the window (8), several blocks of 4
        close(out.logits[0, :13], hf_logits(hf, seq[:13]))
        r2 = target.new_request()
        last = target.prefill([r2], [seq[:13]], last_only=True)
        target.release(r2)
        close(last.logits[0], out.logits[0, 12:13])
        close(last.hidden[0], out.hidden[0, 12:13])
        # pending token seq[13]: verify chains of 1 and 4 nodes, accepting all
        for lo, hi in ((13, 14), (14, 18), (18, 23)):
            out = target.forward_tree([r], [seq[lo:hi]], [[-1] + list(range(hi - lo - 1))])
            close(out.logits[0, :hi - lo], hf_logits(hf, seq[:hi])[lo:hi])
            target.commit(r, list(range(1, hi - lo)))
    finally:
        target.release(r)


def _random_tree(n, g):
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    return parents


def test_tree_forward_and_commit_match_sequential(pair):
    """Every node's logits equal HF's on prefix + its path; after committing a path that skips
    earlier siblings, the cache holds what a fresh prefill of the accepted sequence holds."""
    hf, target = pair
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, hf_tiny.VOCAB, (11,), generator=g)
    n = 9
    parents = _random_tree(n, g)
    tokens = torch.randint(0, hf_tiny.VOCAB, (n,), generator=g)
    r = target.new_request()
    fresh = target.new_request()
    try:
        target.prefill([r], [prefix[:-1]])
        out = target.forward_tree([r], [torch.cat([prefix[-1:], tokens[1:]])], [parents])
        for i in range(n):
            seq = torch.cat([prefix, tokens[tree_path(parents, i)]])
            close(out.logits[0, i], hf_logits(hf, seq)[-1])
        deepest = max(range(n), key=lambda i: (len(tree_path(parents, i)), i))
        path = tree_path(parents, deepest)
        assert path != list(range(1, len(path) + 1)), "the test tree should commit a non-contiguous path"
        target.commit(r, path)
        accepted = torch.cat([prefix, tokens[path]])
        assert target.lengths[r] == len(accepted)
        target.prefill([fresh], [accepted])
        L = len(accepted)
        for t, cache in target.caches.items():
            lo = 0 if cache.window is None else L - cache.window
            pos = torch.arange(lo, L)
            for layer in range(cache.k.shape[0]):
                k1, v1 = cache.read(layer, r, pos)
                k2, v2 = cache.read(layer, fresh, pos)
                close(k1, k2)
                close(v1, v2)
        nxt = torch.randint(0, hf_tiny.VOCAB, (3,), generator=g)
        out = target.forward_tree([r], [nxt], [[-1, 0, 1]])
        close(out.logits[0], hf_logits(hf, torch.cat([accepted, nxt]))[L:])
    finally:
        target.release(r)
        target.release(fresh)


def test_commit_many_keeps_each_accepted_path(pair):
    """A round's commits batched (one gather and one scatter per cache for all requests): each request's
    cache then holds what a fresh prefill of its accepted sequence holds; a bad path anywhere changes
    no request."""
    _, target = pair
    g = torch.Generator().manual_seed(2)
    n = 9
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 6]
    paths = [tree_path(parents, 7), tree_path(parents, 8), [1, 3], []]  # two skip siblings, two do not
    prefixes = [torch.randint(0, hf_tiny.VOCAB, (L,), generator=g) for L in (11, 6, 9, 13)]
    trees = [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g) for _ in prefixes]
    batch = [target.new_request() for _ in prefixes]
    fresh = [target.new_request() for _ in prefixes]
    try:
        target.prefill(batch, [p[:-1] for p in prefixes])
        target.forward_tree(batch, [torch.cat([p[-1:], t[1:]]) for p, t in zip(prefixes, trees)],
                            [parents] * len(batch))
        lengths = [target.lengths[r] for r in batch]
        with pytest.raises(ValueError, match="accepted_nodes"):
            target.commit_many([(batch[0], paths[0]), (batch[1], [2, 1])])
        assert [target.lengths[r] for r in batch] == lengths
        target.commit_many(list(zip(batch, paths)))
        accepted = [torch.cat([p, t[path]]) for p, t, path in zip(prefixes, trees, paths)]
        target.prefill(fresh, accepted)
        for a, b, seq in zip(batch, fresh, accepted):
            L = len(seq)
            assert target.lengths[a] == target.lengths[b] == L
            for cache in target.caches.values():
                pos = torch.arange(0 if cache.window is None else L - cache.window, L)
                for layer in range(cache.k.shape[0]):
                    for x, y in zip(cache.read(layer, a, pos), cache.read(layer, b, pos)):
                        close(x, y)
    finally:
        for r in batch + fresh:
            target.release(r)


def test_batched_ragged_equals_alone(pair):
    _, target = pair
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g) for n in (3, 12, 7)]
    trees = [[-1, 0, 0, 1], [-1], [-1, 0, 1, 1, 0]]
    drafts = [torch.randint(0, hf_tiny.VOCAB, (len(t),), generator=g) for t in trees]
    reqs = [target.new_request() for _ in prompts]
    try:
        pre = target.prefill(reqs, prompts)
        out = target.forward_tree(reqs, drafts, trees)
        for b in range(3):
            r = target.new_request()
            try:
                alone = target.prefill([r], [prompts[b]])
                close(pre.logits[b, :len(prompts[b])], alone.logits[0, :len(prompts[b])])
                one = target.forward_tree([r], [drafts[b]], [trees[b]])
                close(out.logits[b, :len(trees[b])], one.logits[0])
            finally:
                target.release(r)
    finally:
        for r in reqs:
            target.release(r)


def test_sliding_blocks_leave_the_window_and_are_released(pair):
    _, target = pair
    sliding, full = target.caches["sliding_attention"], target.caches["full_attention"]
    free_s, free_f = sliding.allocator.num_free, full.allocator.num_free
    r = target.new_request()
    try:
        target.prefill([r], [torch.randint(0, hf_tiny.VOCAB, (30,))])
        table = sliding.tables[r]
        # window 8 (+1 kept for HF-convention drafters), block 4: positions < 21 are no longer read, blocks 0..4 go
        assert table[:5] == [-1] * 5 and min(table[5:]) >= 0
        assert min(full.tables[r]) >= 0 and len(full.tables[r]) == 8
        assert sliding.allocator.num_free == free_s - 3
        assert full.allocator.num_free == free_f - 8
    finally:
        target.release(r)
    assert (sliding.allocator.num_free, full.allocator.num_free) == (free_s, free_f)


def test_out_of_blocks_raises(tmp_path):
    hf_tiny.build_target(tmp_path, seed=0)
    target = load_target(tmp_path, block_size=4, num_blocks=2)
    r = target.new_request()
    with pytest.raises(OutOfBlocksError, match="num_blocks=2"):
        target.prefill([r], [torch.arange(9)])


def test_bad_tree_raises(pair):
    _, target = pair
    r = target.new_request()
    try:
        with pytest.raises(ValueError, match="parents"):
            target.forward_tree([r], [torch.tensor([1, 2])], [[-1, 1]])
        with pytest.raises(ValueError, match="tokens"):
            target.forward_tree([r], [torch.tensor([1, 999])], [[-1, 0]])
    finally:
        target.release(r)


BASE = {
    "model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"]}


MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8}


@pytest.mark.parametrize("fields,match", [
    ({"use_bidirectional_attention": "all"}, "'use_bidirectional_attention'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}, "full_attention": {}}}, "rope_type"),
    ({"num_kv_shared_layers": 2}, "'num_kv_shared_layers'"),  # every layer shared: nothing computes K/V
    ({"num_kv_shared_layers": 1}, "'num_kv_shared_layers'"),  # the shared full layer has no full layer to read
    ({"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 100, "vocab_size": 128},
     "'vocab_size_per_layer_input'"),
    ({**MOE, "num_experts": None}, "'num_experts'"),
    ({**MOE, "top_k_experts": 5}, "'top_k_experts'"),
    ({**MOE, "top_k_experts": 0}, "'top_k_experts'"),
    ({**MOE, "moe_intermediate_size": None}, "'moe_intermediate_size'"),
], ids=["bidirectional", "rope_type", "all_shared", "shared_without_source", "ple_vocab", "num_experts",
        "top_k_above", "top_k_zero", "moe_intermediate"])
def test_unsupported_targets_are_rejected(fields, match):
    with pytest.raises(UnsupportedModelError, match=match):
        parse_target_config({**BASE, **fields})


def test_every_family_config_parses():
    """PLE, KV sharing, double-wide MLPs and MoE are read (no longer rejected)."""
    cfg, _ = parse_target_config({**BASE, "num_hidden_layers": 4, **MOE, "hidden_size_per_layer_input": 16,
                                  "vocab_size_per_layer_input": 262_144, "num_kv_shared_layers": 2,
                                  "use_double_wide_mlp": True, "intermediate_size": 32,
                                  "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert (cfg.hidden_size_per_layer_input, cfg.num_kv_shared_layers, cfg.num_experts, cfg.top_k_experts,
            cfg.moe_intermediate_size) == (16, 2, 4, 2, 8)
    assert [cfg.kv_source(i) for i in range(4)] == [0, 1, 0, 1]
    assert [cfg.mlp_intermediate_size(i) for i in range(4)] == [32, 32, 64, 64]
    assert (cfg.kv_layer_of("sliding_attention"), cfg.kv_layer_of("full_attention")) == (0, 1)


@pytest.mark.parametrize("field,value", [("hidden_size_per_layer_input", 16), ("enable_moe_block", True),
                                         ("use_double_wide_mlp", True), ("num_kv_shared_layers", 1)])
def test_drafter_configs_keep_the_assistant_rules(field, value):
    text = {**BASE, "hidden_size_per_layer_input": 0, field: value}
    with pytest.raises(UnsupportedModelError, match=f"'{field}'"):
        parse_drafter_config({"model_type": "gemma4_assistant", "text_config": text})


def test_unsupported_checkpoint_rejected_by_loader(tmp_path):
    hf_tiny.build_target(tmp_path, seed=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size_per_layer_input"] = 16
    cfg["vocab_size_per_layer_input"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="vocab_size_per_layer_input"):
        load_target(tmp_path)


@torch.no_grad()
def test_loads_multimodal_checkpoint_text_part(tmp_path):
    """Gemma4ForConditionalGeneration checkpoints keep the text model under model.language_model."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = hf_tiny._text_config(hidden=hf_tiny.HB, layers=hf_tiny.TARGET_LAYERS, k_eq_v=True, softcap=30.0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=None, audio_config=None))
    hf_tiny._randomize(hf.eval(), torch.Generator().manual_seed(4))
    hf.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    ids = torch.tensor([4, 50, 6, 70, 8])
    r = target.new_request()
    close(target.prefill([r], [ids]).logits[0], hf(input_ids=ids[None]).logits[0].float())


def test_config_reads_global_head_dim_form():
    """Hub configs may carry global_head_dim / num_global_key_value_heads instead of per_layer_config."""
    cfg, prefix = parse_target_config({**BASE, "head_dim": 64, "global_head_dim": 128, "num_key_value_heads": 2,
                                       "num_global_key_value_heads": 1, "attention_k_eq_v": True})
    assert prefix == "model."
    assert (cfg.attention["full_attention"].head_dim, cfg.attention["full_attention"].num_kv_heads) == (128, 1)
    assert (cfg.attention["sliding_attention"].head_dim, cfg.attention["sliding_attention"].num_kv_heads) == (64, 2)
    cfg, prefix = parse_target_config({"model_type": "gemma4", "text_config": BASE})
    assert prefix == "model.language_model." and cfg.num_layers == 2
