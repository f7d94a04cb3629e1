"""Train the embedded default model: tokenizer, a tiny Gemma 4 target and its MTP drafter.

    python -m gemma4_mtp.train [--out DIR] [--stage all|tokenizer|target|drafter] [--threads 1]

The defaults are exactly what produced the checkpoints shipped in gemma4_mtp/assets/. Every stage is
seeded and runs on CPU; the stages are independent given the previous stage's files, so running
them one by one gives the same weights as `--stage all`.

Corpus: the Python standard library's own source (`.py` files under sysconfig's stdlib path, PSF
License), available offline wherever the interpreter is. Files are split by a hash of their relative
path, so the held-out set is the same on every machine with the same Python version. The weights
reproduce exactly with the same Python (3.11.7 made the shipped ones), torch and thread count.

Target: next-token prediction on random corpus windows. Drafter: distils the target's next-token
choice (its argmax and its distribution) DRAFT_STEPS steps ahead from every position at once, over
the frozen target's hidden state and last sliding/full K/V, on corpus windows and the target's own
greedy continuations; then a balanced k-means of its LM head rows gives the centroid head's
token_ordering and the centroids learn to pick the cluster of the dense head's choice.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

ASSETS = pathlib.Path(__file__).resolve().parent / "assets"

SEED = 0
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2: Gemma's pad/eos/bos convention
HELD_OUT_MODULUS = 20  # one file in 20 (by path hash) is held out for evaluation

# Stdlib parts that are not representative library code (test suites, GUI demos, generated tables).
EXCLUDED_TOP_LEVEL = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip")

SEQ_LEN = 256
SLIDING_WINDOW = 128

TARGET = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, global_head_dim=128,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    final_logit_softcapping=30.0,
)
TARGET_STEPS = 400
TARGET_BATCH = 16
TARGET_LR = 3e-3

DRAFTER = dict(
    hidden_size=128, intermediate_size=512, num_attention_heads=4,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
)
NUM_CENTROIDS = 64
CENTROID_TOP_K = 8
DRAFT_STEPS = 4  # unrolled draft steps per training position, fed back through post_projection
DRAFTER_STEPS = 250
DRAFTER_BATCH = 8
DRAFTER_LR = 2e-3
# Half of every drafter batch is the target's own greedy continuation of a corpus prompt: the text a
# greedy speculative decode actually drafts on.
GREEDY_POOL = 256
GREEDY_PROMPT = 64
CENTROID_STEPS = 60
KMEANS_ITERS = 8


# ---------------------------------------------------------------- corpus

def corpus_files() -> tuple[pathlib.Path, list[pathlib.Path], list[pathlib.Path]]:
    """(stdlib root, training files, held-out files), both lists sorted by relative path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if rel.parts[0] in EXCLUDED_TOP_LEVEL or rel.parts[0].startswith("config-") or "__pycache__" in rel.parts:
            continue
        files.append(f)
    train, held_out = [], []
    for f in files:
        digest = hashlib.sha256(f.relative_to(root).as_posix().encode()).digest()
        (held_out if int.from_bytes(digest[:4], "little") % HELD_OUT_MODULUS == 0 else train).append(f)
    return root, train, held_out


def read_text(f: pathlib.Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def token_stream(tokenizer, files) -> torch.Tensor:
    """All files tokenized and concatenated, each followed by <eos>."""
    eos = tokenizer.token_to_id("<eos>")
    ids = []
    for enc in tokenizer.encode_batch([read_text(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def held_out_stream(tokenizer) -> torch.Tensor:
    """Token ids of the held-out files (evaluation text for tests and the CLI)."""
    return token_stream(tokenizer, corpus_files()[2])


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


# ---------------------------------------------------------------- configs

def target_config():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, num_hidden_layers=len(TARGET["layer_types"]), sliding_window=SLIDING_WINDOW,
        max_position_embeddings=4096, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=0, enable_moe_block=False, attention_k_eq_v=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, **TARGET,
    )


def drafter_config(tcfg):
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    # The drafter's attention reads the target's cache, so its head dims and KV head counts are the target's.
    text = Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, num_hidden_layers=len(DRAFTER["layer_types"]), sliding_window=tcfg.sliding_window,
        max_position_embeddings=tcfg.max_position_embeddings, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0, enable_moe_block=False, attention_k_eq_v=False,
        num_key_value_heads=TARGET["num_key_value_heads"], head_dim=TARGET["head_dim"],
        global_head_dim=TARGET["global_head_dim"],
        rope_parameters=tcfg.rope_parameters, pad_token_id=0, eos_token_id=1, bos_token_id=2, **DRAFTER,
    )
    return Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=tcfg.hidden_size, use_ordered_embeddings=True,
        num_centroids=NUM_CENTROIDS, centroid_intermediate_top_k=CENTROID_TOP_K, tie_word_embeddings=True,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- stages

def train_tokenizer(out: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _, train, _ = corpus_files()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read_text(f) for f in train), trainer=trainer, length=len(train))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return tok


def load_tokenizer(out: pathlib.Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(out / "tokenizer.json"))


@torch.no_grad()
def eval_target_loss(model, stream: torch.Tensor, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(SEED + 1)
    model.eval()
    losses = [model(input_ids=w, labels=w).loss.item()
              for w in (random_windows(stream, TARGET_BATCH, SEQ_LEN, gen) for _ in range(batches))]
    model.train()
    return sum(losses) / len(losses)


def train_target(out: pathlib.Path, steps: int):
    from tqdm import tqdm
    from transformers import Gemma4ForCausalLM

    tok = load_tokenizer(out)
    _, train_files, held_files = corpus_files()
    train, held = token_stream(tok, train_files), token_stream(tok, held_files)
    print(f"corpus: {len(train_files)} training files ({train.numel()} tokens), "
          f"{len(held_files)} held-out files ({held.numel()} tokens)")

    torch.manual_seed(SEED)
    model = Gemma4ForCausalLM(target_config()).float()
    model.config._attn_implementation = "sdpa"
    params = sum(p.numel() for p in model.parameters())
    print(f"target: {params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=TARGET_LR, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    bar = tqdm(range(steps), desc="target", dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, TARGET_LR, warmup=min(100, steps // 10 + 1))
        w = random_windows(train, TARGET_BATCH, SEQ_LEN, gen)
        loss = model(input_ids=w, labels=w).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    print(f"target held-out loss: {eval_target_loss(model, held):.3f} nats/token")
    model.save_pretrained(out / "target")
    return model


def load_target(out: pathlib.Path):
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(out / "target", dtype=torch.float32, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def drafter_masks(num_queries: int, num_keys: int, window: int) -> dict[str, torch.Tensor]:
    """Boolean [1, 1, Q, S] masks: the query at position P sees the target's keys [0, P] (its sliding
    layers only the last `window` of them); every draft step of a round sits at the same position."""
    q = torch.arange(num_queries)[:, None]
    k = torch.arange(num_keys)[None, :]
    full = k <= q
    return {"full_attention": full[None, None], "sliding_attention": (full & (k > q - window))[None, None]}


@torch.no_grad()
def target_features(target, windows: torch.Tensor):
    """What the drafter gets from the target: final hidden states, the last sliding/full layers' K/V,
    and the target's next-token distribution at every position (the distillation labels)."""
    out = target(input_ids=windows, output_hidden_states=True, return_shared_kv_states=True)
    kv = {k: (v[0].contiguous(), v[1].contiguous()) for k, v in out.shared_kv_states.items()}
    return out.hidden_states[-1], kv, out.logits.float()


def drafter_unroll(drafter, target, windows, hidden, kv, masks, num_steps: int, head):
    """Run `num_steps` draft steps from every position P at once (teacher-forced on the window's
    tokens: step k reads token P+k and the previous step's post_projection). Yields (step, logits,
    final normed hidden)."""
    S = windows.shape[1]
    P = S - num_steps
    positions = torch.arange(P)[None].expand(windows.shape[0], P)
    h = hidden[:, :P]
    embed = target.get_input_embeddings()
    for k in range(1, num_steps + 1):
        x = drafter.pre_projection(torch.cat([embed(windows[:, k:P + k]), h], dim=-1))
        last = drafter.model(inputs_embeds=x, attention_mask=masks, position_ids=positions,
                             shared_kv_states=kv, use_cache=False).last_hidden_state
        h = drafter.post_projection(last)
        yield k, head(last), last


@torch.no_grad()
def greedy_pool(target, stream: torch.Tensor, n: int, gen: torch.Generator, batch: int = 64) -> torch.Tensor:
    """n windows of SEQ_LEN tokens: a corpus prompt followed by the target's greedy continuation."""
    from tqdm import tqdm

    pool = []
    for _ in tqdm(range(0, n, batch), desc="greedy continuations", dynamic_ncols=True):
        prompts = random_windows(stream, batch, GREEDY_PROMPT, gen)
        new = SEQ_LEN - GREEDY_PROMPT
        pool.append(target.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                    eos_token_id=None, pad_token_id=0))
    return torch.cat(pool)[:n]


def drafter_batch(stream, pool, gen):
    """Half corpus windows, half greedy continuations."""
    real = random_windows(stream, DRAFTER_BATCH - DRAFTER_BATCH // 2, SEQ_LEN, gen)
    greedy = pool[torch.randint(0, pool.shape[0], (DRAFTER_BATCH // 2,), generator=gen)]
    return torch.cat([real, greedy])


def train_drafter(out: pathlib.Path, steps: int, centroid_steps: int):
    from tqdm import tqdm
    from transformers import Gemma4AssistantForCausalLM

    tok = load_tokenizer(out)
    _, train_files, _ = corpus_files()
    train = token_stream(tok, train_files)
    target = load_target(out)

    torch.manual_seed(SEED)
    cfg = drafter_config(target.config)
    drafter = Gemma4AssistantForCausalLM(cfg).float()
    drafter.model.config._attn_implementation = "sdpa"
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters")
    S = SEQ_LEN
    masks = drafter_masks(S - DRAFT_STEPS, S, cfg.text_config.sliding_window)
    gen = torch.Generator().manual_seed(SEED + 2)
    pool = greedy_pool(target, train, GREEDY_POOL, gen)

    # Stage 1: dense LM head, distilling the target's next-token choice several steps ahead.
    params = [p for n, p in drafter.named_parameters() if not n.startswith("masked_embedding")]
    opt = torch.optim.AdamW(params, lr=DRAFTER_LR, betas=(0.9, 0.95), weight_decay=0.01)
    drafter.train()
    bar = tqdm(range(steps), desc="drafter", dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, DRAFTER_LR, warmup=min(50, steps // 10 + 1))
        w = drafter_batch(train, pool, gen)
        hidden, kv, tlogits = target_features(target, w)
        loss, accs = 0.0, []
        for k, logits, _ in drafter_unroll(drafter, target, w, hidden, kv, masks, DRAFT_STEPS, drafter.lm_head):
            t = tlogits[:, k:S - DRAFT_STEPS + k]
            soft = -(t.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
            hard = F.cross_entropy(logits.flatten(0, 1), t.argmax(-1).flatten())
            loss = loss + (soft + hard) / DRAFT_STEPS
            accs.append((logits.argmax(-1) == t.argmax(-1)).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
    drafter.eval()

    # Stage 2: the centroid head. Balanced clusters of the LM head rows give token_ordering; the
    # centroids are then trained to pick the cluster of the dense head's choice.
    ordering = balanced_kmeans(drafter.lm_head.weight.detach(), NUM_CENTROIDS, KMEANS_ITERS, SEED)
    me = drafter.masked_embedding
    me.token_ordering.copy_(ordering)
    cluster_of = torch.empty(VOCAB_SIZE, dtype=torch.long)
    cluster_of[ordering] = torch.arange(VOCAB_SIZE) // (VOCAB_SIZE // NUM_CENTROIDS)
    with torch.no_grad():
        rows = F.normalize(drafter.lm_head.weight, dim=-1)[ordering].view(NUM_CENTROIDS, -1, drafter.hidden_size)
        me.centroids.weight.copy_(rows.mean(1))
    opt = torch.optim.AdamW(me.centroids.parameters(), lr=1e-2, weight_decay=0.0)
    bar = tqdm(range(centroid_steps), desc="centroids", dynamic_ncols=True)
    for step in bar:
        w = drafter_batch(train, pool, gen)
        hidden, kv, _ = target_features(target, w)
        with torch.no_grad():
            states = [(logits.argmax(-1), last) for _, logits, last in
                      drafter_unroll(drafter, target, w, hidden, kv, masks, DRAFT_STEPS, drafter.lm_head)]
        loss, recalls = 0.0, []
        for choice, last in states:
            c_logits = me.centroids(last)
            label = cluster_of[choice]
            loss = loss + F.cross_entropy(c_logits.flatten(0, 1), label.flatten()) / len(states)
            top = c_logits.topk(CENTROID_TOP_K, dim=-1).indices
            recalls.append((top == label[..., None]).any(-1).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", recall=f"{sum(recalls) / len(recalls):.3f}")
    drafter.save_pretrained(out / "drafter")
    return drafter


def balanced_kmeans(rows: torch.Tensor, clusters: int, iters: int, seed: int) -> torch.Tensor:
    """Spherical k-means with equal cluster sizes (an assignment problem per iteration).
    Returns token_ordering: cluster c owns ordering[c*V/C:(c+1)*V/C]."""
    from scipy.optimize import linear_sum_assignment

    V = rows.shape[0]
    size = V // clusters
    x = F.normalize(rows.double(), dim=-1)
    gen = torch.Generator().manual_seed(seed)
    centers = x[torch.randperm(V, generator=gen)[:clusters]]
    for _ in range(iters):
        cost = -(x @ centers.T)  # [V, C]
        _, slot = linear_sum_assignment(cost.repeat_interleave(size, dim=1).numpy())
        assign = torch.as_tensor(slot) // size
        centers = F.normalize(torch.stack([x[assign == c].mean(0) for c in range(clusters)]), dim=-1)
    # Within a cluster, tokens in ascending id order: the ordering is canonical given the assignment.
    return torch.cat([torch.nonzero(assign == c).flatten() for c in range(clusters)])


def write_notice(out: pathlib.Path, seconds: dict[str, float]):
    root, train, held = corpus_files()
    (out / "NOTICE.md").write_text(
        "# Embedded default model\n\n"
        "Produced by `python -m gemma4_mtp.train` (the script's defaults are exactly what made these files).\n\n"
        "## Training corpus\n\n"
        f"The `.py` source files of the Python {sys.version.split()[0]} standard library ({len(train)} training and "
        f"{len(held)} held-out files), Copyright (c) Python Software Foundation, used under the "
        "PSF License Agreement (https://docs.python.org/3/license.html; copied in LICENSE-PSF.txt). The model "
        "weights are a statistical summary of that text; no file of it is redistributed here.\n\n"
        "## Training\n\n"
        + "".join(f"- {k}: {v:.0f} s\n" for k, v in seconds.items())
    )
    if (root / "LICENSE.txt").is_file():
        (out / "LICENSE-PSF.txt").write_text((root / "LICENSE.txt").read_text())
    (out / "training.json").write_text(json.dumps({
        "python": sys.version.split()[0], "torch": torch.__version__, "threads": torch.get_num_threads(),
        "seconds": seconds, "train_files": len(train), "held_out_files": len(held),
    }, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gemma4_mtp.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ASSETS, help="output folder (default: the shipped assets)")
    ap.add_argument("--stage", choices=["all", "tokenizer", "target", "drafter"], default="all")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 made the shipped weights; on a shared machine it is also the fastest)")
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--drafter-steps", type=int, default=DRAFTER_STEPS)
    ap.add_argument("--centroid-steps", type=int, default=CENTROID_STEPS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    timings_file = args.out / "training.json"
    seconds = json.loads(timings_file.read_text())["seconds"] if timings_file.exists() else {}
    for stage, run in (("tokenizer", lambda: train_tokenizer(args.out)),
                       ("target", lambda: train_target(args.out, args.target_steps)),
                       ("drafter", lambda: train_drafter(args.out, args.drafter_steps, args.centroid_steps))):
        if args.stage in ("all", stage):
            t0 = time.perf_counter()
            run()
            seconds[stage] = time.perf_counter() - t0
    write_notice(args.out, seconds)


if __name__ == "__main__":
    main()
