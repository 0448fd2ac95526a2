"""Rows for the calculator agent: one-step multiplication word problems ("12 boxes of 34 pencils").

Two-digit products are beyond the embedded 135M model's own arithmetic, so a row is solved by
writing the right calculator call and then repeating the result: what the agent example trains.
Deterministic by seed, GSM8K-shaped (``question``, ``answer`` ending in ``#### N``):

    python examples/agents/make_data.py     # rewrites train.jsonl (64 rows) and test.jsonl (16 rows) here
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kemi", "Luca")
# (containers, things): "{who} buys {a} {containers} with {b} {things} in each ..."
GOODS = (
    ("boxes", "pencils"),
    ("bags", "marbles"),
    ("packs", "stickers"),
    ("crates", "apples"),
    ("jars", "buttons"),
    ("trays", "cookies"),
)
PLACES = (("shelves", "books"), ("rows", "trees"), ("pages", "stamps"), ("tables", "chairs"))


def problem(rng: random.Random) -> tuple[str, int, int]:
    """A question whose answer is ``a * b``, with a and b two-digit numbers."""
    a, b = rng.randint(11, 99), rng.randint(11, 99)
    if rng.random() < 0.5:
        who, (containers, things) = rng.choice(NAMES), rng.choice(GOODS)
        question = f"{who} buys {a} {containers} with {b} {things} in each. How many {things} does {who} buy?"
    else:
        parts, things = rng.choice(PLACES)
        question = f"There are {a} {parts} with {b} {things} on each. How many {things} are there?"
    return question, a, b


def rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` problems: {"question", "answer"}, the answer's last line ``#### N``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, a, b = problem(rng)
        out.append({"question": question, "answer": f"{a} * {b} = {a * b}\n#### {a * b}"})
    return out


def main() -> int:
    here = Path(__file__).resolve().parent
    for name, n, seed in (("train", 64, 0), ("test", 16, 1)):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
