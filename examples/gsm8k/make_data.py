"""A small GSM8K-shaped dataset of our own making: grade-school word problems with a worked
answer ending in ``#### N``, the format ``builtin:math`` and ``builtin:exact`` read. Deterministic
by seed, written in every format ``trainer.dataset.path`` reads (tests use it too):

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


def _buy(rng: random.Random) -> tuple[str, str, int]:
    who, thing = rng.choice(NAMES), rng.choice(THINGS)
    packs, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)
    total = packs * per + extra
    question = f"{who} buys {packs} packs of {thing} with {per} in each pack, and already has {extra}. How many {thing} does {who} have now?"
    work = f"{packs} packs of {per} is {packs} * {per} = {packs * per}. With {extra} more, {packs * per} + {extra} = {total}."
    return question, work, total


def _share(rng: random.Random) -> tuple[str, str, int]:
    who, thing = rng.sample(NAMES, 2), rng.choice(THINGS)
    friends, each, kept = rng.randint(2, 8), rng.randint(2, 10), rng.randint(0, 9)
    total = friends * each + kept
    question = f"{who[0]} had {total} {thing}, gave {each} to each of {friends} friends and kept the rest. How many {thing} did {who[0]} keep?"
    work = f"{who[0]} gave away {friends} * {each} = {friends * each}. {total} - {friends * each} = {kept}."
    return question, work, kept


def _save(rng: random.Random) -> tuple[str, str, int]:
    who = rng.choice(NAMES)
    weekly, weeks = rng.randint(3, 25), rng.randint(2, 10)
    spent = rng.randint(1, min(15, weekly * weeks - 1))
    left = weekly * weeks - spent
    question = (
        f"{who} saves ${weekly} a week for {weeks} weeks, then spends ${spent} on a game. How many dollars are left?"
    )
    work = f"{who} saved {weekly} * {weeks} = {weekly * weeks} dollars. {weekly * weeks} - {spent} = {left}."
    return question, work, left


PROBLEMS: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (_buy, _share, _save)


def rows(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    """``n`` problems: {"question", "answer"}, the answer's last line ``#### N``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, work, result = rng.choice(PROBLEMS)(rng)
        out.append({"question": question, "answer": f"{work}\n#### {result}"})
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
