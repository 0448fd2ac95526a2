"""Agents and reward functions the training tests import (tests/unit on sys.path): real OpenAI
clients against the trainer's proxy, several calls per run, as a user's agent would make them."""

from __future__ import annotations

from typing import Any

SEEN: list[str] = []  # the row ids the agents ran, in order (the tests read and clear it)


async def two_turns(client: Any, row: dict[str, Any]) -> float:
    """Ask, then append the reply unchanged and a follow-up user turn, and ask again: the second
    prompt extends the first completion's tokens. 1.0 when the answer is in the last reply."""
    SEEN.append(str(row["id"]))
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Check it once more and give the number only."},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    return 1.0 if str(row["answer"]) in (second.choices[0].message.content or "") else 0.0


async def flaky(client: Any, row: dict[str, Any]) -> float | None:
    """One call; raises on rows whose id ends in 1, and leaves the reward to trainer.reward (None)."""
    SEEN.append(str(row["id"]))
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=8
    )
    if str(row["id"]).endswith("1"):
        raise RuntimeError(f"tool crashed on {row['id']}")
    return None


def failing_reward(completion: str, row: dict[str, Any]) -> float:
    """A reward function that fails on every row whose id ends in 2."""
    if str(row["id"]).endswith("2"):
        raise ValueError("cannot parse the answer")
    return 1.0 if str(row["answer"]) in completion else 0.0
