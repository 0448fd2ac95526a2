"""Easy math word problems of our own making, GSM8K-shaped: one addition of small numbers, the
question ending with the answer format the reward reads ("Answer with just the number."), a
worked answer ending in ``#### N`` (what ``builtin:math`` and ``builtin:exact`` read). Easy enough
that the embedded 135M model solves some, so GRPO groups differ and it learns. Deterministic by
seed, written in every format ``trainer.dataset.path`` reads (tests use it too):

    python examples/gsm8k/make_data.py     # rewrites train.jsonl (64 rows) and test.jsonl (16 rows) here
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "json", "parquet", "csv", "disk")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemi", "Luca")
THINGS = ("apples", "marbles", "stickers", "books", "pencils", "shells", "cards", "stamps")
FORMAT = "Answer with just the number."


def _gets(rng: random.Random) -> tuple[str, str, int]:
    who, thing = rng.choice(NAMES), rng.choice(THINGS)
    have, more = rng.randint(2, 12), rng.randint(2, 9)
    question = f"{who} has {have} {thing} and gets {more} more. How many {thing} does {who} have now?"
    return question, f"{have} + {more} = {have + more}", have + more


def _together(rng: random.Random) -> tuple[str, str, int]:
    who, thing = rng.sample(NAMES, 2), rng.choice(THINGS)
    first, second = rng.randint(2, 12), rng.randint(2, 9)
    question = f"{who[0]} has {first} {thing} and {who[1]} has {second}. How many {thing} do they have together?"
    return question, f"{first} + {second} = {first + second}", first + second


PROBLEMS: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (_gets, _together)


def rows(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``n`` problems: {"question", "answer"}, the answer's last line ``#### N``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, work, result = rng.choice(PROBLEMS)(rng)
        out.append({"question": f"{question} {FORMAT}", "answer": f"{work}\n#### {result}"})
    return out


def write(
    directory: str | Path, n: int = 64, seed: int = 0, formats: Sequence[str] = FORMATS, name: str = "train"
) -> dict[str, Path]:
    """``name``.FORMAT in ``directory`` for each of ``formats`` (``disk``: a save_to_disk
    directory holding a DatasetDict with the split ``name``); returns format -> path."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown formats {unknown}; known: {', '.join(FORMATS)}")
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = rows(n, seed)
    paths: dict[str, Path] = {}
    for fmt in formats:
        path = out_dir / (f"{name}-disk" if fmt == "disk" else f"{name}.{fmt}")
        _WRITERS[fmt](data, path, name)
        paths[fmt] = path
    return paths


def _jsonl(data: list[dict[str, str]], path: Path, _: str) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))


def _json(data: list[dict[str, str]], path: Path, _: str) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def _columns(data: list[dict[str, str]]) -> dict[str, list[str]]:
    return {key: [r[key] for r in data] for key in ("question", "answer")}


def _parquet(data: list[dict[str, str]], path: Path, _: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(_columns(data)), path)


def _csv(data: list[dict[str, str]], path: Path, _: str) -> None:
    import csv

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(data)


def _disk(data: list[dict[str, str]], path: Path, split: str) -> None:
    import datasets

    datasets.DatasetDict({split: datasets.Dataset.from_dict(_columns(data))}).save_to_disk(str(path))


_WRITERS: dict[str, Callable[[list[dict[str, str]], Path, str], Any]] = {
    "jsonl": _jsonl,
    "json": _json,
    "parquet": _parquet,
    "csv": _csv,
    "disk": _disk,
}


def main() -> int:
    here = Path(__file__).resolve().parent
    write(here, n=64, seed=0, formats=("jsonl",), name="train")
    write(here, n=16, seed=1, formats=("jsonl",), name="test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
