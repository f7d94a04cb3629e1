"""`python -m gemma4_mtp`: the command-line entry.

Until the embedded default model lands, the main job is the op self-check: every op through every
available backend on small inputs, compared with the torch reference.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma4_mtp", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("selfcheck", help="run each op through every available backend against the reference")
    parser.parse_args(argv)
    from . import selfcheck

    return selfcheck.main()


if __name__ == "__main__":
    sys.exit(main())
