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
import math
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


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _seed(text: str) -> int:
    value = _int_at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**63, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gemma4_mtp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="speculative decoding with the embedded (or a given) model")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=_int_at_least(1), default=96)
    gen.add_argument("--draft-tokens", type=_int_at_least(0), default=4,
                     help="chain length (ignored with --tree); 0 decodes with the target alone")
    gen.add_argument("--tree", type=_tree, default=None, help="per-depth branch counts, e.g. 2,2,1")
    gen.add_argument("--temperature", type=_temperature, default=0.0)
    gen.add_argument("--seed", type=_seed, default=0)
    gen.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cuda"),
                     help="backend of the drafter's ops and of tree_verify")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--model-dir", type=pathlib.Path, default=ASSETS,
                     help="folder holding target/, drafter/ and tokenizer.json")
    sub.add_parser("selfcheck", help="run each op through every available backend against the reference")
    return parser


def _device(parser: argparse.ArgumentParser, name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"argument --device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: expected cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: torch sees no CUDA device here (use --device cpu)")
    return device


def generate(args) -> int:
    """Errors of the user's making (missing files, an unusable backend, arguments the models reject)
    end in one line on stderr and exit status 2, not a traceback."""
    from gemma4_mtp_kernels import BackendUnavailableError

    from .config import UnsupportedModelError
    from .kv_cache import OutOfBlocksError

    try:
        return _generate(args)
    except (FileNotFoundError, UnsupportedModelError, BackendUnavailableError, OutOfBlocksError, ValueError) as e:
        print(f"python -m gemma4_mtp: error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    import torch
    from tokenizers import Tokenizer

    from . import load_drafter, load_target, speculative_generate

    device = args.device
    if args.backend == "triton" and device.type == "cpu":
        _with_triton_interpreter(args.argv)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    tokenizer_file = args.model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"--model-dir: no tokenizer.json in {args.model_dir}")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
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

    # Time steady state, both ways warmed up the same, as an engine serves. On a GPU the first calls
    # compile Triton kernels and capture the CUDA graphs of each shape (at its second use): a full run
    # of each. On CPU there is nothing to compile or capture, but the first calls still pay one-time
    # costs (the drafter's first-step glue checks, torch's first dispatch): timing speculative decoding
    # cold against a warmer target-only run read ~0.75x where warmed runs of both read ~1.0x.
    cuda = device.type == "cuda"
    warm = dict(common, max_new_tokens=common["max_new_tokens"] if cuda else min(8, common["max_new_tokens"]))
    speculative_generate(target, drafter, prompt, **warm, **shape)
    speculative_generate(target, None, prompt, num_draft_tokens=0, **warm)
    if cuda:
        torch.cuda.synchronize(device)
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
    # a graph captured while timed (a round shape the warm-up did not meet twice) costs ~3 eager rounds
    captured = spec.stats.new_static_shapes + base.stats.new_static_shapes
    print(f"wall clock          speculative {t_spec:.2f} s, target only {t_base:.2f} s "
          f"({t_base / t_spec:.2f}x), after a warm-up run of each"
          f"{f' (CUDA graphs replayed, {captured} captured while timed)' if cuda else ''}")
    if args.temperature == 0:
        same = torch.equal(spec.ids[0], base.ids[0])
        print(f"exact               greedy output {'matches' if same else 'DIFFERS FROM'} target-only decoding")
        return 0 if same else 1
    print("exact               sampling: same distribution as the target's (not comparable token by token)")
    return 0


def _with_triton_interpreter(argv: list[str]) -> None:
    """Runs this command again with TRITON_INTERPRET=1 unless it is set: Triton decides when a kernel is
    defined, on import, whether it runs compiled or interpreted, and the package imported its kernels
    before this module ran (setting the variable now would leave them compiled, with no GPU to run on)."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "gemma4_mtp", *argv], dict(os.environ, TRITON_INTERPRET="1"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.command == "selfcheck":
        import torch

        from . import selfcheck

        if not torch.cuda.is_available():  # the Triton rows run on CPU tensors
            _with_triton_interpreter(argv)
        return selfcheck.main()
    if args.command is None:
        argv = ["generate"]
        args = _parser().parse_args(argv)
    args.argv = argv
    args.device = _device(_parser(), args.device)
    return generate(args)


if __name__ == "__main__":
    sys.exit(main())
