"""The ``treetrain`` command line: one module per subcommand, each with ``add_parser``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from treetrain import __version__
from treetrain.cli import alloc, check, memory, pack_stats, proxy, train

# Each module adds its subcommand and sets ``func`` (args -> exit code).
SUBCOMMANDS = (alloc, check, memory, pack_stats, proxy, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treetrain",
        description="RL training for LLM agents with tree (shared-prefix) packing.",
    )
    parser.add_argument("--version", action="version", version=f"treetrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
