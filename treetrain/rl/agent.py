"""Agents as rollouts: a user's ``async def run(client, row) -> float | None`` played against the
trainer's OpenAI-compatible proxy (treetrain.proxy), each run in its own session, whose recorded
completions become training samples.

One run is one episode; a group is ``groupSize`` runs of one dataset row (GRPO). Every run has its
own session (seeded ``seed_of(seed, step, group, run)``), its own ``openai.AsyncOpenAI`` client
keyed to that session, and ``trainer.episodeTimeoutSeconds`` to finish. All runs of a call share
one asyncio loop in the calling thread, so their requests reach the proxy together and its
batching sampler merges them into one generate call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treetrain.rl.collect import Rollouts, Sample, merge_rollouts, seed_of
from treetrain.rl.task import TaskError, _first_line, _import

if TYPE_CHECKING:
    from treetrain.proxy.server import ProxyServer
    from treetrain.proxy.sessions import SampleRecord
    from treetrain.rl.rewards import RewardRunner

Agent = Callable[[Any, dict[str, Any]], Awaitable[Any]]
Log = Callable[[str], None]

# How long a run waits, in all, for a session when the proxy is at its session bound.
SESSION_WAIT_S = 60.0


class AgentError(TaskError):
    """The agent cannot be loaded (exit 2, one line naming the spec and the fix)."""


def load_agent(spec: str) -> Agent:
    """``package.module:function``, an ``async def`` taking ``(client, row)``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentError(f"trainer.agent {spec!r} must be package.module:function (an async def run(client, row))")
    try:
        module = _import(module_name)
    except TaskError as err:
        raise AgentError(str(err).replace("task module", "agent module", 1)) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise AgentError(f"trainer.agent: module {module_name!r} has no {attr!r}; fix: name an async def in it")
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"trainer.agent {spec!r} is not an async def; fix: define it as async def {attr}(client, row)")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError:
        raise AgentError(
            f"trainer.agent {spec!r} must take two arguments (client, row); fix: async def {attr}(client, row)"
        ) from None
    except ValueError:  # no signature to read: let the call tell
        pass
    agent: Agent = fn
    return agent


@dataclass(frozen=True)
class Job:
    """One run to play: the row, its session seed, and what names it in log lines."""

    row: dict[str, Any]
    seed: int
    where: str


@dataclass
class Run:
    """A finished run: its completions, its reward, and the error that failed it (None: it did not)."""

    records: list[SampleRecord] = field(default_factory=list)
    reward: float = 0.0
    error: str | None = None


def run_agents(
    agent: Agent,
    jobs: Sequence[Job],
    *,
    server: ProxyServer,
    timeout_s: float,
    reward_runner: RewardRunner | None,
    log: Log,
    name: str = "agent",
    on_done: Callable[[], None] | None = None,
) -> list[Run]:
    """Play every job concurrently on a fresh event loop in this thread, then end and discard
    their sessions (the proxy keeps nothing of them). Never raises for the agent's failures:
    a failed run comes back with ``error`` set and one log line. ``on_done`` is called as each
    run ends (the trainer's progress count)."""
    sessions: list[tuple[str, str]] = []
    try:
        for job in jobs:  # one by one: those opened before a failure are still discarded
            sessions.append(_open_session(server, job.seed))
        outcomes = asyncio.run(_play_all(agent, jobs, sessions, server.url, timeout_s, on_done))
        runs = []
        for job, (sid, _), outcome in zip(jobs, sessions, outcomes, strict=True):
            _end_quietly(server, sid)
            runs.append(_finish(job, sid, outcome, server=server, reward_runner=reward_runner, log=log, name=name))
        return runs
    finally:
        for sid, _ in sessions:
            _end_quietly(server, sid)
            server.store.discard(sid)


def _open_session(server: ProxyServer, seed: int) -> tuple[str, str]:
    """A session of our own; at the proxy's session bound, wait as it says (bounded)."""
    session = server.store.create_waiting(seed=seed, wait_s=SESSION_WAIT_S)
    if isinstance(session, str):
        raise TaskError(f"agent proxy: no session after {SESSION_WAIT_S:g}s: {session}")
    return session.id, session.api_key


def _end_quietly(server: ProxyServer, sid: str) -> None:
    with contextlib.suppress(Exception):  # already ended (an agent may end its own session), or gone
        server.store.end(sid)


async def _play_all(
    agent: Agent,
    jobs: Sequence[Job],
    sessions: Sequence[tuple[str, str]],
    url: str,
    timeout_s: float,
    on_done: Callable[[], None] | None = None,
) -> list[Any]:
    """Each job's return value, or the exception that ended it."""
    import openai

    async def one(job: Job, key: str) -> Any:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        try:
            return await asyncio.wait_for(agent(client, dict(job.row)), timeout_s)
        finally:
            await client.close()
            if on_done is not None:
                on_done()

    return await asyncio.gather(
        *(one(job, key) for job, (_, key) in zip(jobs, sessions, strict=True)), return_exceptions=True
    )


def _finish(
    job: Job,
    sid: str,
    outcome: Any,
    *,
    server: ProxyServer,
    reward_runner: RewardRunner | None,
    log: Log,
    name: str,
) -> Run:
    """The run's samples and reward: the agent's returned float; else the session reward it posted;
    else the mean of its completions' posted rewards; else trainer.reward on the last completion's
    text; else 0.0 (logged)."""
    if isinstance(outcome, BaseException):
        if isinstance(outcome, asyncio.TimeoutError | TimeoutError):
            problem = "did not finish within trainer.episodeTimeoutSeconds"
        else:
            problem = f"raised {type(outcome).__name__}: {_first_line(outcome)}"
        log(f"{name}: {job.where}: {problem}; that run is left out of its group")
        return Run(error=problem)
    if outcome is not None and not _is_reward(outcome):
        problem = f"returned {type(outcome).__name__} {str(outcome)[:40]!r}, not a float or None"
        log(f"{name}: {job.where}: {problem}; that run is left out of its group")
        return Run(error=problem)
    records = server.store.samples(sid)
    if outcome is not None:
        return Run(records=records, reward=float(outcome))
    posted = server.store.session_reward(sid)
    if posted is not None:
        return Run(records=records, reward=float(posted))
    rewards = [r.reward for r in records if r.reward is not None]
    if rewards:
        return Run(records=records, reward=sum(rewards) / len(rewards))
    if reward_runner is not None and records:
        return Run(records=records, reward=reward_runner.score(records[-1].text, job.row, job.where))
    log(f"{name}: {job.where}: no reward (the agent returned None and posted none); scored 0.0")
    return Run(records=records, reward=0.0)


def _is_reward(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def sample_of(record: SampleRecord, episode: int) -> Sample | None:
    """One completion as a training sample: its prompt ends at the first sampled token; its version
    is the oldest its tokens were sampled with. None: a completion with no sampled token."""
    try:
        prompt_len = record.loss_mask.index(1)
    except ValueError:
        return None
    versions = [v for v, m in zip(record.versions, record.loss_mask, strict=True) if m]
    return Sample(
        episode=episode,
        tokens=list(record.input_ids),
        prompt_len=prompt_len,
        behav_logprobs=list(record.logprobs[prompt_len:]),
        version=min(versions),
    )


def group_rollouts(runs: Sequence[Run], group: int, max_new_tokens: int) -> Rollouts:
    """One group's runs as Rollouts. A failed run is left out of the group: it has no samples and
    no reward, so the group's baseline is the mean of the runs that finished (a crash or a timeout
    is not an outcome of the policy's tokens to learn from); a group with a failed run still trains
    the others. A run with no completion is kept (its reward counts) but has no samples."""
    samples: list[Sample] = []
    rewards: list[float] = []
    for run in runs:
        if run.error is not None:
            continue
        episode = len(rewards)
        rewards.append(run.reward)
        samples += [s for s in (sample_of(r, episode) for r in run.records) if s is not None]
    return Rollouts(samples=samples, rewards=rewards, groups=[group] * len(rewards), max_new_tokens=max_new_tokens)


def play_agent_groups(
    agent: Agent,
    rows: Sequence[tuple[int, dict[str, Any]]],
    *,
    server: ProxyServer,
    group_size: int,
    seed: int,
    step: int,
    timeout_s: float,
    reward_runner: RewardRunner | None,
    log: Log,
    max_new_tokens: int = 0,
    on_done: Callable[[], None] | None = None,
) -> Rollouts:
    """Groups ``(g, row)`` of ``step``, ``group_size`` runs each, all on one event loop."""
    jobs = [
        Job(row=row, seed=seed_of(seed, step, g, run), where=f"step {step + 1}, group {g}, run {run}")
        for g, row in rows
        for run in range(group_size)
    ]
    runs = run_agents(
        agent, jobs, server=server, timeout_s=timeout_s, reward_runner=reward_runner, log=log, on_done=on_done
    )
    parts = [
        group_rollouts(runs[k * group_size : (k + 1) * group_size], g, max_new_tokens) for k, (g, _) in enumerate(rows)
    ]
    return merge_rollouts(parts)


def play_agent_group(
    agent: Agent,
    row: dict[str, Any],
    *,
    server: ProxyServer,
    group_size: int,
    seed: int,
    step: int,
    group: int,
    timeout_s: float,
    reward_runner: RewardRunner | None,
    log: Log,
    max_new_tokens: int = 0,
) -> Rollouts:
    """One group: ``group_size`` runs of ``row`` (the asynchronous controller's ``play``)."""
    return play_agent_groups(
        agent,
        [(group, row)],
        server=server,
        group_size=group_size,
        seed=seed,
        step=step,
        timeout_s=timeout_s,
        reward_runner=reward_runner,
        log=log,
        max_new_tokens=max_new_tokens,
    )
