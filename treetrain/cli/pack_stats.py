"""``treetrain pack-stats FILE.jsonl --max-tokens N [--json]``: how well a batch packs into trees."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treetrain.tree import PackConfig, PackingError, pack

EXAMPLES = """\
input: one sequence per line, either a JSON list of token ids or {"input_ids": [...]}.
examples:
  treetrain pack-stats rollouts.jsonl --max-tokens 32768
  treetrain pack-stats rollouts.jsonl --max-tokens 32768 --dp 8 --json
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "pack-stats",
        help="pack token sequences into shared-prefix trees and print tree_token_ratio and padding",
        description="Pack token sequences (JSONL) into tries of at most --max-tokens tree tokens and print "
        "the number of trees, original/tree/padded tokens and tree_token_ratio (tree / original; lower is better).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="FILE.jsonl", help="sequences, one per line ('-' reads standard input)")
    p.add_argument("--max-tokens", type=int, required=True, metavar="N", help="tree tokens per micro-batch")
    p.add_argument("--block-size", type=int, default=128, metavar="B", help="attention block size (default 128)")
    p.add_argument("--dp", type=int, default=1, metavar="R", help="data-parallel ranks to balance over (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        sequences = read_jsonl(args.file)
        config = PackConfig(max_tokens_per_mb=args.max_tokens, block_size=args.block_size, dp_size=args.dp)
        batch = pack(sequences, config)
    except (OSError, PackingError) as err:
        # The library names its setting; here the user typed --max-tokens / --block-size.
        message = str(err).replace("max_tokens_per_mb", "--max-tokens").replace("block_size=", "--block-size=")
        print(f"treetrain pack-stats: error: {message}", file=sys.stderr)
        return 2
    row = {"file": args.file, **batch.stats.to_dict()}
    if args.json:
        print(json.dumps(row))
    else:
        print(
            f"{_plural(row['sequences'], 'sequence')} -> {_plural(row['trees'], 'tree')} "
            f"over {_plural(args.dp, 'rank')}\n"
            f"original tokens   {row['original_tokens']}\n"
            f"tree tokens       {row['tree_tokens']}\n"
            f"padded tokens     {row['padded_tokens']} ({row['padding_ratio']:.1%} of the packed length)\n"
            f"tree_token_ratio  {row['tree_token_ratio']:.4f}\n"
            f"tree tokens/rank  {' '.join(str(t) for t in row['rank_tree_tokens'])}"
        )
    return 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def read_jsonl(path: str) -> list[list[int]]:
    """Token sequences from a JSONL file; a bad line raises ``PackingError`` naming it."""
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    sequences: list[list[int]] = []
    with stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise PackingError(f"{path}:{lineno}: not JSON ({err.msg})") from None
            if isinstance(value, dict):
                value = value.get("input_ids")
            if not isinstance(value, list) or not all(type(t) is int for t in value):
                raise PackingError(
                    f'{path}:{lineno}: expected a JSON list of token ids or an object with "input_ids": [...]'
                )
            sequences.append(value)
    if not sequences:
        raise PackingError(f"{path}: no sequences")
    return sequences
