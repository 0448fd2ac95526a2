"""Realistic RL batch shapes as token sequences, and how well each packs into trees.

    python bench/workloads.py [--max-tokens 32768] [--scale 1.0] [--write DIR]

Each generator returns a list of token-id lists (seeded, deterministic). Shapes:

- ``grpo_256x1024``: GRPO, prompt 256 + response 1024, n = 8 samples per prompt.
- ``grpo_4096x512``: GRPO, prompt 4096 + response 512, n = 8.
- ``agentic_n1``: multi-turn agent, a 4k-token system prompt then 10-30 turns of 150-600
  tokens; every turn is one sample (it contains all earlier turns as its prefix), n = 1.
- ``agentic_n8``: the same with 8 rollouts per task: they share the system prompt and the
  task's first user message, then diverge.
- ``shared_system``: one long (4k) system prompt shared by every sequence, each with its own
  user prompt (200-800) and response (300-1500).

``--scale`` multiplies every length (the CPU train-step bench uses a small scale).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from treetrain.tree import PackConfig, pack

VOCAB = 151_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(max(1, n))]


def _len(scale: float, n: int) -> int:
    return max(1, round(n * scale))


def grpo(
    prompts: int, prompt_len: int, response_len: int, n: int, *, scale: float = 1.0, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(prompts):
        prompt = _tokens(rng, _len(scale, prompt_len))
        seqs += [prompt + _tokens(rng, _len(scale, response_len)) for _ in range(n)]
    return seqs


def agentic(conversations: int, n: int, *, scale: float = 1.0, seed: int = 0) -> list[list[int]]:
    """Each turn of each rollout is one sample; the sample holds the whole history so far."""
    rng = random.Random(seed)
    seqs = []
    system = _tokens(rng, _len(scale, 4096))
    for _ in range(conversations):
        task = system + _tokens(rng, _len(scale, rng.randint(150, 600)))
        turns = rng.randint(10, 30)
        for _ in range(n):
            history = list(task)
            for _ in range(turns):
                history += _tokens(rng, _len(scale, rng.randint(150, 600)))
                seqs.append(list(history))
    return seqs


def shared_system(count: int, *, scale: float = 1.0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = _tokens(rng, _len(scale, 4096))
    return [
        system + _tokens(rng, _len(scale, rng.randint(200, 800))) + _tokens(rng, _len(scale, rng.randint(300, 1500)))
        for _ in range(count)
    ]


def workloads(scale: float = 1.0) -> dict[str, Callable[[], list[list[int]]]]:
    """Name -> generator of one RL batch (about 100k-1M original tokens at scale 1)."""
    return {
        "grpo_256x1024": lambda: grpo(16, 256, 1024, 8, scale=scale),
        "grpo_4096x512": lambda: grpo(8, 4096, 512, 8, scale=scale),
        "agentic_n1": lambda: agentic(4, 1, scale=scale),
        "agentic_n8": lambda: agentic(2, 8, scale=scale),
        "shared_system": lambda: shared_system(32, scale=scale),
    }


def agentic_tokens(target: int, *, seed: int = 0) -> list[list[int]]:
    """Agentic (n = 1) conversations until at least ``target`` original tokens."""
    seqs: list[list[int]] = []
    total, conv = 0, 0
    while total < target:
        batch = agentic(1, 1, seed=seed + conv)
        seqs += batch
        total += sum(map(len, batch))
        conv += 1
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--write", metavar="DIR", help="also write each workload as DIR/NAME.jsonl")
    args = parser.parse_args()
    print(f"config: max_tokens_per_mb={args.max_tokens} scale={args.scale} block_size=128 dp=1")
    print(
        f"{'workload':<15} {'seqs':>5} {'original':>9} {'tree':>8} {'trees':>5} {'padded':>7} {'tree_token_ratio':>16}"
    )
    for name, make in workloads(args.scale).items():
        seqs = make()
        stats = pack(seqs, PackConfig(max_tokens_per_mb=args.max_tokens)).stats
        print(
            f"{name:<15} {stats.num_sequences:>5} {stats.original_tokens:>9} {stats.tree_tokens:>8} "
            f"{stats.num_trees:>5} {stats.padded_tokens:>7} {stats.tree_token_ratio:>16.4f}"
        )
        if args.write:
            out = Path(args.write)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in seqs))


if __name__ == "__main__":
    main()
