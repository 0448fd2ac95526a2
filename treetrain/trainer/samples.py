"""``trainer.logSamples``: what the model wrote. N completions per step go to ``samples.jsonl`` in
``checkpoint.dir`` (prompt, completion, reward, token counts), and the first one is printed, so a
reward that stays at 0 can be read, not guessed at.

The picks spread over the step's groups (one episode of each group first), and each is its
episode's whole conversation: the first prompt, then everything after it (replies and, in
multi-turn tasks, the user turns between them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treetrain.rl.samples import Rollouts, Sample

SAMPLES_FILE = "samples.jsonl"
PRINTED_CHARS = 240  # of the prompt's end and the completion's start, in the printed line

Decode = Callable[[list[int]], str]


def pick_episodes(groups: list[int], n: int) -> list[int]:
    """``n`` episode indices spread over the groups: the first episode of every group, then the
    second of every group, and so on."""
    rank: dict[int, int] = {}
    order = []
    for e, g in enumerate(groups):
        order.append((rank.get(g, 0), e))
        rank[g] = rank.get(g, 0) + 1
    return [e for _, e in sorted(order)[:n]]


def sample_records(step: int, rollouts: Rollouts, n: int, decode: Decode) -> list[dict[str, Any]]:
    """The JSON records of ``n`` episodes of ``rollouts`` (step is 1-based)."""
    by_episode: dict[int, list[Sample]] = {}
    for s in rollouts.samples:
        by_episode.setdefault(s.episode, []).append(s)
    records = []
    for e in pick_episodes(rollouts.groups, n):
        turns = by_episode.get(e)
        if not turns:
            continue  # an episode with no sample (an agent run that failed)
        first, last = turns[0], turns[-1]
        completion = last.tokens[first.prompt_len :]
        records.append(
            {
                "step": step,
                "episode": e,
                "group": rollouts.groups[e],
                "reward": rollouts.rewards[e],
                "turns": len(turns),
                "prompt": decode(first.tokens[: first.prompt_len]),
                "completion": decode(completion),
                "prompt_tokens": first.prompt_len,
                "completion_tokens": len(completion),
            }
        )
    return records


def printed(record: dict[str, Any]) -> str:
    """One line: the prompt's end and the completion's start, escaped."""
    prompt, completion = record["prompt"], record["completion"]
    if len(prompt) > PRINTED_CHARS:
        prompt = "..." + prompt[-PRINTED_CHARS:]
    if len(completion) > PRINTED_CHARS:
        completion = completion[:PRINTED_CHARS] + "..."
    return (
        f"sample (step {record['step']}, group {record['group']}, reward {record['reward']:.3f}, "
        f"{record['completion_tokens']} tokens): {prompt!r} -> {completion!r}"
    )


class SampleLog:
    """Writes ``n`` sampled completions per step (rank 0); see the module docstring."""

    def __init__(self, n: int, root: str | None, get_tokenizer: Callable[[], Any], log: Callable[[str], None]) -> None:
        self.n = n
        self.path = Path(root) / SAMPLES_FILE if root else None
        self._get_tokenizer = get_tokenizer
        self._decode: Decode | None = None
        self.log = log

    def decode(self, ids: list[int]) -> str:
        if self._decode is None:
            tokenizer = self._get_tokenizer()
            if tokenizer is None:  # a random built-in model: its tokens are ids only
                self._decode = lambda ids: " ".join(map(str, ids))
            else:
                self._decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
        return self._decode(ids)

    def write(self, step: int, rollouts: Rollouts) -> None:
        if self.n == 0:
            return
        records = sample_records(step, rollouts, self.n, self.decode)
        if records:
            self.log(printed(records[0]))
        if self.path is not None and records:
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
