"""``treetrain pack-stats`` on about 5M tokens of agent samples: time and peak memory, side by side.

    python bench/pack_stats.py [--tokens 5000000] [--repeat 3] [--max-tokens 32768]

Writes the agentic workload of ``bench/workloads.py`` (each turn one sample holding the whole
conversation so far) as JSONL, then runs each variant in a fresh process (so its peak RSS is its
own), a burn-in run first and the best of ``--repeat`` measured runs after:

- ``read``: read each line and ``json.loads`` it, nothing kept (the floor).
- ``before``: what pack-stats did before issue 21: every line parsed into a list of Python ints,
  the items checked one by one in generator expressions, then ``pack`` (trees laid out).
- ``after``: ``treetrain.cli.pack_stats`` now: each line parsed, checked in C and kept as one
  ``array('i')`` row, then ``pack_stats`` (the same plan, no layout).

Each line prints the variant's time, its ratio to ``read``, and the process's peak RSS (Linux
``VmHWM``; also as a multiple of the file's size; the interpreter and imports alone take about
20 MiB); ``before`` and ``after`` must give the same stats (checked).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workloads import agentic_tokens

from treetrain.tree import PackConfig, PackingError, pack

MAX_TOKEN_ID = (1 << 31) - 1


def _before_sequence(raw: bytes, where: str) -> list[int]:
    """The per-line checks of pack-stats before issue 21 (item by item, in Python)."""
    value = json.loads(raw.decode("utf-8"))
    if isinstance(value, dict):
        value = value.get("input_ids")
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise PackingError(f'{where}: expected a JSON list of token ids or an object with "input_ids": [...]')
    bad = next((i for i, t in enumerate(value) if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise PackingError(f"{where}: token {bad} is {value[bad]}; token ids are 0..{MAX_TOKEN_ID}")
    return value


def _lines(path: str) -> Any:
    with open(path, "rb") as f:
        for lineno in itertools.count(1):
            raw = f.readline()
            if not raw:
                return
            if raw.strip():
                yield lineno, raw


def run_variant(variant: str, path: str, max_tokens: int) -> dict[str, Any]:
    """One run in this process: seconds and the stats (None for ``read``)."""
    config = PackConfig(max_tokens_per_mb=max_tokens)
    t0 = time.perf_counter()
    stats = None
    if variant == "read":
        for _, raw in _lines(path):
            json.loads(raw)
    elif variant == "before":
        seqs = [_before_sequence(raw, f"{path}:{n}") for n, raw in _lines(path)]
        stats = pack(seqs, config).stats.to_dict()
    elif variant == "after":
        from treetrain.cli.pack_stats import read_jsonl
        from treetrain.tree import pack_stats

        stats = pack_stats(list(read_jsonl(path)), config).to_dict()
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    return {"seconds": time.perf_counter() - t0, "stats": stats}


def child(variant: str, path: str, max_tokens: int, repeat: int) -> None:
    run_variant(variant, path, max_tokens)  # burn-in
    runs = [run_variant(variant, path, max_tokens) for _ in range(repeat)]
    # VmHWM: the peak RSS of this process image (ru_maxrss would carry the parent's over exec).
    status = Path("/proc/self/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    print(json.dumps({"seconds": min(r["seconds"] for r in runs), "stats": runs[0]["stats"], "peak_kib": peak_kib}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=5_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.max_tokens, args.repeat)
        return

    seqs = agentic_tokens(args.tokens)
    n_tokens = sum(map(len, seqs))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agentic.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in seqs))
        del seqs
        size = path.stat().st_size
        print(
            f"config: {n_tokens} original tokens, {size / 1e6:.1f} MB JSONL, max_tokens_per_mb={args.max_tokens}, "
            f"burn-in 1 + best of {args.repeat}, one process per variant"
        )
        results = {}
        flags = ["--max-tokens", str(args.max_tokens), "--repeat", str(args.repeat)]
        for variant in ("read", "before", "after"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(path), *flags],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[variant] = json.loads(out)
    if results["before"]["stats"] != results["after"]["stats"]:
        raise SystemExit(f"stats differ: {results['before']['stats']} vs {results['after']['stats']}")
    read_s = results["read"]["seconds"]
    print(f"{'variant':<8} {'seconds':>8} {'x read':>7} {'M tokens/s':>10} {'peak RSS MiB':>12} {'x file':>7}")
    for variant, r in results.items():
        peak = r["peak_kib"] * 1024
        print(
            f"{variant:<8} {r['seconds']:>8.3f} {r['seconds'] / read_s:>7.2f} {n_tokens / r['seconds'] / 1e6:>10.2f} "
            f"{peak / 2**20:>12.1f} {peak / size:>7.2f}"
        )
    stats = results["after"]["stats"]
    print(f"stats (before == after): {stats['trees']} trees, tree_token_ratio {stats['tree_token_ratio']:.4f}")


if __name__ == "__main__":
    main()
