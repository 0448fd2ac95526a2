"""What the row checks cost: ``treetrain.rl.dataset_check.scan_file`` against ``datasets``' own
read of the same JSON-lines file (what ``load_rows`` does after the scan).

    python bench/dataset_scan.py [--rows 100000] [--repeat 3] [--chat]

Writes GSM8K-shaped rows (a question of about 300 characters, an answer ending ``#### N``; with
``--chat`` the prompt is a list of two {role, content} messages), then times, best of
``--repeat`` after one burn-in each: ``scan`` (every row checked, builtin:math's rules) and
``datasets`` (``load_dataset("json")`` into memory, offline, no cache kept). Prints both and the
ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from treetrain.rl.dataset_check import RowRules, scan_file


def write_rows(path: Path, n: int, chat: bool) -> None:
    rng = random.Random(0)
    words = ["apples", "trains", "minutes", "each", "costs", "dollars", "more", "than", "twice", "left"]
    with path.open("w") as f:
        for i in range(n):
            question = " ".join(rng.choice(words) for _ in range(50)) + f" {i}?"
            prompt: object = question
            if chat:
                prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
            f.write(json.dumps({"prompt": prompt, "answer": f"{rng.random():.3f} so #### {i}", "id": i}) + "\n")


def best(fn: Callable[[], object], repeat: int) -> float:
    fn()  # burn-in: the file in the page cache, imports done
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chat", action="store_true", help="prompts as lists of messages")
    args = parser.parse_args()

    import datasets

    datasets.disable_progress_bars()
    datasets.config.HF_HUB_OFFLINE = True
    with tempfile.TemporaryDirectory(prefix="treetrain-bench-") as tmp:
        path = Path(tmp) / "rows.jsonl"
        write_rows(path, args.rows, args.chat)
        rules = RowRules("trainer.dataset", str(path), "prompt", "answer", "builtin:math")

        def read() -> object:
            with tempfile.TemporaryDirectory(prefix="treetrain-bench-cache-") as cache:
                return datasets.load_dataset(
                    "json", data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
                )

        scan_s = best(lambda: scan_file(path, "json", rules), args.repeat)
        read_s = best(read, args.repeat)
        size = path.stat().st_size / 2**20
        kind = "chat" if args.chat else "string"
        print(f"{args.rows} rows ({kind} prompts), {size:.1f} MiB, best of {args.repeat}:")
        print(f"  scan      {scan_s:7.3f}s  ({args.rows / scan_s:,.0f} rows/s)")
        print(f"  datasets  {read_s:7.3f}s  ({args.rows / read_s:,.0f} rows/s)")
        print(f"  scan / datasets = {scan_s / read_s:.2f}")


if __name__ == "__main__":
    main()
