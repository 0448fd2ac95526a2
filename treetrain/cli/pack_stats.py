"""``treetrain pack-stats FILE.jsonl --max-tokens N [--json]``: how well a batch packs into trees."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from array import array
from collections.abc import Iterator
from typing import Any

from treetrain.tree import PackConfig, PackingError, pack_stats

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
    for flag, value, limit in (("--dp", args.dp, MAX_DP), ("--block-size", args.block_size, MAX_BLOCK_SIZE)):
        if not 1 <= value <= limit:
            print(f"treetrain pack-stats: error: {flag} must be in 1..{limit}, got {value}", file=sys.stderr)
            return 2
    try:
        # Streamed: each line becomes a compact row as it is read, and only the stats are planned
        # (no tree is laid out), so memory is the rows (4 bytes a token) plus O(sequences).
        sequences = list(read_jsonl(args.file))
        config = PackConfig(max_tokens_per_mb=args.max_tokens, block_size=args.block_size, dp_size=args.dp)
        stats = pack_stats(sequences, config)
    except (OSError, PackingError) as err:
        # The library names its setting; here the user typed --max-tokens / --block-size.
        message = str(err).replace("max_tokens_per_mb", "--max-tokens").replace("block_size=", "--block-size=")
        print(f"treetrain pack-stats: error: {message}", file=sys.stderr)
        return 2
    row = {"file": args.file, **stats.to_dict()}
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


# Bounds on hostile input: a line holds one sequence (a million tokens fit in 16 MiB), token
# ids fit in 32 bits, and ranks are at most what any cluster has.
MAX_LINE_BYTES = 16 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_DP = 4096
MAX_BLOCK_SIZE = 65536

# Sequences are kept as C ints (4 bytes a token, against about 36 for a list of Python ints):
# converting a parsed line checks in C that every item is an int of at most MAX_TOKEN_ID.
TOKEN_TYPECODE = "i"
assert array(TOKEN_TYPECODE).itemsize == 4 and MAX_TOKEN_ID == (1 << 31) - 1
_SIGN_BYTE = 3 if sys.byteorder == "little" else 0  # the byte of each C int that holds its sign bit


def read_jsonl(path: str) -> Iterator[array[int]]:
    """Token sequences from a JSONL file, one ``array('i')`` per line, read as they are consumed;
    a bad line raises ``PackingError`` naming it.

    Only the line being parsed is held as Python objects: memory is the sequences' 4 bytes a
    token, not the file's JSON. A line is read at most ``MAX_LINE_BYTES`` at a time
    (``/dev/zero`` or one huge line is refused, not swallowed), and every failure of the JSON
    reader (bad UTF-8, deep nesting, numbers past Python's digit limit) is one line."""
    stream = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    empty = True
    with stream:
        for lineno in itertools.count(1):
            raw = stream.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise PackingError(
                    f"{path}:{lineno}: line longer than {MAX_LINE_BYTES >> 20} MiB; one sequence per line"
                )
            if raw.strip():
                empty = False
                yield _sequence(raw, f"{path}:{lineno}")
    if empty:
        raise PackingError(f"{path}: no sequences")


def _sequence(raw: bytes, where: str) -> array[int]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise PackingError(f"{where}: not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise PackingError(f"{where}: not JSON ({err.msg})") from None
    except RecursionError:
        raise PackingError(f"{where}: JSON nested too deeply; expected a flat list of token ids") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise PackingError(f"{where}: not JSON ({str(err).split(':')[0]})") from None
    if isinstance(value, dict):
        value = value.get("input_ids")
    if isinstance(value, list):
        # The checks in C: the conversion refuses any item that is not an int in -2**31..2**31-1
        # (floats, strings, lists, None, big ints), the sign bytes say whether one is negative,
        # and only bools get through as ints: JSON spells them true/false, both with an "e",
        # which a list of integers never has (one memchr, then a search only when it is there).
        try:
            row = array(TOKEN_TYPECODE, value)
        except (TypeError, OverflowError):
            row = None
        if (
            row is not None
            and row.tobytes()[_SIGN_BYTE::4].isascii()
            and not (b"e" in raw and (b"true" in raw or b"false" in raw))
        ):
            return row
    return _checked(value, where)


def _checked(value: Any, where: str) -> array[int]:
    """The item-by-item checks, for the message naming what is wrong (or a row after all, when
    "true" was only in a string of the object)."""
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise PackingError(f'{where}: expected a JSON list of token ids or an object with "input_ids": [...]')
    bad = next((i for i, t in enumerate(value) if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise PackingError(f"{where}: token {bad} is {value[bad]}; token ids are 0..{MAX_TOKEN_ID}")
    return array(TOKEN_TYPECODE, value)
