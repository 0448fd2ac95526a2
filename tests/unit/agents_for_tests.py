"""Agents and reward functions the training tests import (tests/unit on sys.path): real OpenAI
clients against the trainer's proxy, several calls per run, as a user's agent would make them."""

from __future__ import annotations

import asyncio
import json
import urllib.request
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


def _post(url: str, body: dict[str, Any], key: str) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=60) as res:
        assert res.status == 200


async def _ask(client: Any, row: dict[str, Any]) -> Any:
    return await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=8
    )


async def rewards_by_row(client: Any, row: dict[str, Any]) -> Any:
    """What a run's reward comes from, by ``row["how"]``: returned, posted for the session, posted
    per completion, left to trainer.reward, none at all, a wrong type, a crash, or a hang."""
    how = row["how"]
    if how == "hang":
        await asyncio.sleep(3600)
    first = await _ask(client, row)
    second = await _ask(client, row)
    if how == "returned":
        return 0.25
    if how in ("session", "completions"):
        sid = row["session_of"](client.api_key)
        posts = [{"reward": 0.5}] if how == "session" else [
            {"reward": 1.0, "completion_id": first.id}, {"reward": 0.0, "completion_id": second.id}
        ]  # fmt: skip
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        for body in posts:
            await asyncio.to_thread(_post, f"{base}/rl/sessions/{sid}/reward", body, client.api_key)
        return None
    if how == "wrong":
        return "high"
    if how == "crash":
        raise KeyError("tool")
    return None  # "reward" and "none"


async def one_argument(client: Any) -> float:
    """Not an agent: it takes no row."""
    return 0.0


RUNS: dict[str, int] = {}  # runs so far per row id


async def informative_unless_r0(client: Any, row: dict[str, Any]) -> float:
    """Row r0's runs all score 0 (no signal); the runs of any other row alternate 1 and 0."""
    SEEN.append(str(row["id"]))
    await _ask(client, row)
    RUNS[row["id"]] = RUNS.get(row["id"], 0) + 1
    return 0.0 if row["id"] == "r0" else float(RUNS[row["id"]] % 2)
