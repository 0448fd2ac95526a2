"""The ``rljob`` command line (the operator side)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from treetrain import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rljob",
        description="Operator tools for RLJob resources. Not built yet: 'plan', 'crd' and 'operator' "
        "arrive with the operator; until then this command only reports its version.",
    )
    parser.add_argument("--version", action="version", version=f"rljob {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
