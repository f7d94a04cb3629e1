"""`python -m gemma4_mtp`: speculative decoding with the embedded default model, on any machine.

    python -m gemma4_mtp                       # generate with the shipped target + drafter (greedy)
    python -m gemma4_mtp generate --prompt "def parse(" --max-new-tokens 64 --draft-tokens 4
    python -m gemma4_mtp generate --tree 2,2,1 --temperature 0.8 --seed 0
    python -m gemma4_mtp selfcheck             # every op through every available backend vs the reference

`generate` streams the text, then reports the mean acceptance length, tokens per target forward, the
wall-clock time against target-only decoding of the same prompt, and (greedy) whether the two
outputs are identical, which speculative decoding guarantees.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ASSETS = pathlib.Path(__file__).resolve().parent / "assets"
# Ends mid-line: the byte-level BPE merges a newline with the next line's indentation, so a prompt
# that ends in "\n" leaves the model at a token boundary it rarely saw in training.
DEFAULT_PROMPT = "    def __init__(self, name, value=None):\n        if not isinstance(name, str):\n            raise TypeError("


def _tree(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree: expected comma-separated branch counts like 2,2,1, got {text!r}")
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--tree: branch counts must be >= 1, got {text!r}")
    return shape


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gemma4_mtp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="speculative decoding with the embedded (or a given) model")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=int, default=96)
    gen.add_argument("--draft-tokens", type=int, default=4, help="chain length (ignored with --tree)")
    gen.add_argument("--tree", type=_tree, default=None, help="per-depth branch counts, e.g. 2,2,1")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cuda"),
                     help="backend of the drafter's ops and of tree_verify")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--model-dir", type=pathlib.Path, default=ASSETS,
                     help="folder holding target/, drafter/ and tokenizer.json")
    sub.add_parser("selfcheck", help="run each op through every available backend against the reference")
    return parser


def generate(args) -> int:
    import torch
    from tokenizers import Tokenizer

    from . import load_drafter, load_target, speculative_generate

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.backend == "triton" and device == "cpu":
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    tokenizer = Tokenizer.from_file(str(args.model_dir / "tokenizer.json"))
    target = load_target(args.model_dir / "target", device=device)
    drafter = load_drafter(args.model_dir / "drafter", device=device, backend=args.backend)
    # the model was trained on windows of raw text (files separated by <eos>): no BOS
    prompt = torch.tensor(tokenizer.encode(args.prompt).ids)
    if prompt.numel() == 0:
        raise SystemExit("--prompt: needs at least one token")
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    shape = dict(num_draft_tokens=None, tree=args.tree) if args.tree else dict(num_draft_tokens=args.draft_tokens)

    print(args.prompt, end="", flush=True)
    emitted: list[int] = []
    shown = ""

    def stream(_request: int, tokens: list[int]) -> None:
        nonlocal shown
        emitted.extend(tokens)
        text = tokenizer.decode(emitted)
        if text.startswith(shown):  # a partial UTF-8 sequence can change the tail; print when settled
            print(text[len(shown):], end="", flush=True)
            shown = text

    t0 = time.perf_counter()
    spec = speculative_generate(target, drafter, prompt, on_tokens=stream, **common, **shape)
    t_spec = time.perf_counter() - t0
    print()
    t0 = time.perf_counter()
    base = speculative_generate(target, None, prompt, num_draft_tokens=0, **common)
    t_base = time.perf_counter() - t0

    s = spec.stats
    what = f"tree {','.join(map(str, args.tree))}" if args.tree else f"chain of {args.draft_tokens}"
    print("-" * 72)
    print(f"drafting            {what}, temperature {args.temperature}, backend {drafter.backend}, {device}")
    print(f"new tokens          {s.new_tokens[0]} in {s.rounds} rounds")
    print(f"mean acceptance     {s.mean_acceptance_length:.2f} tokens per round (accepted drafts + bonus)")
    print(f"tokens per forward  {s.tokens_per_target_forward:.2f} (target-only decoding: 1.00)")
    print(f"wall clock          speculative {t_spec:.2f} s, target only {t_base:.2f} s "
          f"({t_base / t_spec:.2f}x)")
    if args.temperature == 0:
        same = torch.equal(spec.ids[0], base.ids[0])
        print(f"exact               greedy output {'matches' if same else 'DIFFERS FROM'} target-only decoding")
        return 0 if same else 1
    print("exact               sampling: same distribution as the target's (not comparable token by token)")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "selfcheck":
        from . import selfcheck

        return selfcheck.main()
    if args.command is None:
        args = _parser().parse_args(["generate"])
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
