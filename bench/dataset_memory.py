"""Peak memory of loading a dataset: ``treetrain.rl.dataset.load_rows`` in a fresh process per
file, its peak resident set (``ru_maxrss``) against the file's size.

    python bench/dataset_memory.py [--rows 2000000] [--line-mib 64] [--cases tiny,list,line,csv]

Writes, in a temporary directory: ``tiny`` (``--rows`` rows of about 30 bytes, JSON lines),
``list`` (the same rows as one JSON list), ``line`` (a few good rows and one whose prompt is ``--line-mib`` MiB, JSON lines), ``csv`` (the
same in a CSV field). Each is loaded as the trainer loads it (the default
``trainer.maxEpisodeTokens``; builtin:math's rules), once with the cache empty and once again
(``tiny`` and ``list``: the second load maps the Arrow cache the first wrote). The cache goes to the
temporary directory (``TREETRAIN_CACHE``). Also measured: a process that only imports the
modules, so the load's own share is the difference. Prints one line a load, with the process's
anonymous and file-backed resident memory at its end (mapped rows are file-backed: page cache
the kernel can drop); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import resource, sys, time
import datasets
from treetrain.config.trainer_settings import DatasetSettings
from treetrain.rl import dataset
path = sys.argv[1]
start = time.perf_counter()
outcome = "imports only"
if path != "-":
    try:
        rows = dataset.load_rows(DatasetSettings(path=path, shuffle=False), answer_for="builtin:math")
        outcome = f"{len(rows)} rows loaded"
    except dataset.DatasetError as err:
        outcome = "refused: " + str(err)[:150]
took = time.perf_counter() - start
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
now = ", ".join(f"{k} {int(status[k].split()[0]) // 1024} MiB" for k in ("RssAnon", "RssFile") if k in status)
print(f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}\\t{took:.1f}\\t{outcome} (at the end: {now})")
"""


def write_tiny(path: Path, rows: int) -> None:
    with path.open("w") as f:
        for i in range(rows):
            f.write(f'{{"prompt": "q{i}", "answer": "{i % 97}"}}\n')


def write_list(path: Path, rows: int) -> None:
    with path.open("w") as f:
        f.write("[\n")
        for i in range(rows):
            f.write(f'{"," if i else " "}{{"prompt": "q{i}", "answer": "{i % 97}"}}\n')
        f.write("]\n")


def write_line(path: Path, mib: int) -> None:
    good = json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n"
    with path.open("w") as f:
        f.write(good * 3)
        f.write('{"prompt": "')
        chunk = "word " * (1 << 18)  # 1.25 MiB
        written = 0
        while written < mib << 20:
            f.write(chunk)
            written += len(chunk)
        f.write('", "answer": "4"}\n')
        f.write(good)


def write_csv(path: Path, mib: int) -> None:
    with path.open("w") as f:
        f.write("prompt,answer\n" + "What is 2 + 2?,4\n" * 3)
        chunk = "word " * (1 << 18)
        written = 0
        while written < mib << 20:
            f.write(chunk)
            written += len(chunk)
        f.write(",4\nWhat is 3 + 3?,6\n")


def measure(path: str, env: dict[str, str]) -> tuple[float, float, str]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, path], capture_output=True, text=True, env=env, timeout=3600, check=False
    )
    if result.returncode != 0:
        return float("nan"), float("nan"), f"exit {result.returncode}: {result.stderr.strip()[-200:]}"
    rss, took, outcome = result.stdout.strip().splitlines()[-1].split("\t", 2)
    return float(rss), float(took), outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--line-mib", type=int, default=64)
    parser.add_argument("--cases", default="tiny,list,line,csv")
    args = parser.parse_args()
    cases = args.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="treetrain-bench-") as tmp:
        env = {**os.environ, "TREETRAIN_CACHE": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "1"}
        base, _, _ = measure("-", env)
        print(f"imports only: peak RSS {base:.0f} MiB")
        for case in cases:
            suffix = {"csv": ".csv", "list": ".json"}.get(case, ".jsonl")
            path = Path(tmp) / f"{case}{suffix}"
            start = time.perf_counter()
            if case == "tiny":
                write_tiny(path, args.rows)
            elif case == "list":
                write_list(path, args.rows)
            elif case == "line":
                write_line(path, args.line_mib)
            else:
                write_csv(path, args.line_mib)
            size = path.stat().st_size / 2**20
            print(f"{case}: {size:.1f} MiB written in {time.perf_counter() - start:.1f} s")
            for attempt in ("first load", "second load")[: 2 if case in ("tiny", "list") else 1]:
                rss, took, outcome = measure(str(path), env)
                print(
                    f"  {attempt}: peak RSS {rss:.0f} MiB ({rss - base:+.0f} over imports, "
                    f"{(rss - base) / size:.1f}x the file), {took:.1f} s: {outcome}"
                )
            path.unlink()


if __name__ == "__main__":
    main()
