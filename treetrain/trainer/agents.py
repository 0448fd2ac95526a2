"""Agents as an episode source: a user's ``async def run(client, row) -> float | None`` played
against rank 0's OpenAI-compatible proxy, each run in its own session, whose recorded completions
become training samples.

One run is one episode; a group is ``groupSize`` runs of one dataset row (GRPO). Every run has its
own session, opened in-process on the proxy's RL service (seeded ``seed_of(seed, step, group,
run)``), its own ``openai.AsyncOpenAI`` client keyed to that session, and
``trainer.episodeTimeoutSeconds`` to finish. All runs of a call share one asyncio loop in the
calling thread, so their requests reach the proxy together and its batching sampler merges them
into one generate call. The samples are taken from the service, in the proxy's token-aligned form,
and the sessions discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treetrain.config import TrainConfig, TrainerSettings
from treetrain.config.schema import max_staleness
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.sampler import LOCAL_BATCH_TOKENS
from treetrain.proxy.server import ProxyServer, RLService
from treetrain.proxy.sessions import ProxyLimits, SampleRecord
from treetrain.rl.agent import Agent
from treetrain.rl.episodes import Generate, GroupCall, greedy
from treetrain.rl.limits import TaskClock
from treetrain.rl.progress import RolloutProgress, RolloutStopped
from treetrain.rl.rewards import RewardRunner
from treetrain.rl.samples import Rollouts, Sample, merge_rollouts, seed_of
from treetrain.rl.user_code import TaskError, first_line

Log = Callable[[str], None]

# How long a run waits, in all, for a session when the proxy is at its session bound.
SESSION_WAIT_S = 60.0


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


class AgentSource:
    """The agent's runs as an :class:`~treetrain.rl.episodes.EpisodeSource`: the rows of a call's
    groups (``row(step, group)``), ``groupSize`` runs each. ``progress`` (the synchronous loop's):
    runs count as they end, and runs that failed because SIGTERM stopped generation stop the step
    (RolloutStopped) instead of training on what is left."""

    def __init__(
        self,
        agent: Agent,
        server: ProxyServer,
        settings: TrainerSettings,
        *,
        row: Callable[[int, int], dict[str, Any]],
        reward_runner: RewardRunner | None,
        log: Log,
        progress: RolloutProgress | None = None,
    ) -> None:
        self.agent, self.server, self.settings, self.row = agent, server, settings, row
        self.reward_runner, self.log, self.progress = reward_runner, log, progress

    def play(self, call: GroupCall, clock: TaskClock) -> Rollouts:
        t, step, size = self.settings, call.step, self.settings.group_size
        jobs = [
            Job(
                row=self.row(step, g),
                seed=seed_of(t.seed, step, g, run),
                where=f"step {step + 1}, group {g}, run {run}",
            )
            for g in call.groups
            for run in range(size)
        ]
        done = self.progress.episodes_finished if self.progress is not None else None
        runs = run_agents(
            self.agent,
            jobs,
            server=self.server,
            timeout_s=t.episode_timeout_seconds,
            reward_runner=self.reward_runner,
            log=self.log,
            on_done=done,
        )
        if self.progress is not None and (self.progress.stopped or self.progress.stop_requested):
            # The agents' calls failed because generation stopped (SIGTERM): not their fault.
            raise RolloutStopped("the agents' runs were stopped by SIGTERM")
        parts = [
            group_rollouts(runs[k * size : (k + 1) * size], g, t.max_new_tokens) for k, g in enumerate(call.groups)
        ]
        return merge_rollouts(parts)


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
    service = server.service
    sessions: list[tuple[str, str]] = []
    try:
        for job in jobs:  # one by one: those opened before a failure are still discarded
            session = service.open_waiting(job.seed, SESSION_WAIT_S)
            if isinstance(session, str):
                raise TaskError(f"agent proxy: no session after {SESSION_WAIT_S:g}s: {session}")
            sessions.append((session.id, session.api_key))
        outcomes = asyncio.run(_play_all(agent, jobs, sessions, server.url, timeout_s, on_done))
        runs = []
        for job, (sid, _), outcome in zip(jobs, sessions, outcomes, strict=True):
            with contextlib.suppress(Exception):  # already ended (an agent may end its own session)
                service.end(sid)
            records, posted = service.samples(sid) if not isinstance(outcome, BaseException) else ([], None)
            runs.append(_finish(job, outcome, records, posted, reward_runner=reward_runner, log=log, name=name))
        return runs
    finally:
        for sid, _ in sessions:
            service.discard(sid)


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
    outcome: Any,
    records: list[SampleRecord],
    posted: float | None,
    *,
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
            problem = f"raised {type(outcome).__name__}: {first_line(outcome)}"
        log(f"{name}: {job.where}: {problem}; that run is left out of its group")
        return Run(error=problem)
    if outcome is not None and not _is_reward(outcome):
        problem = f"returned {type(outcome).__name__} {str(outcome)[:40]!r}, not a float or None"
        log(f"{name}: {job.where}: {problem}; that run is left out of its group")
        return Run(error=problem)
    if outcome is not None:
        return Run(records=records, reward=float(outcome))
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
    """One completion as a training sample, as the proxy recorded it (token-aligned already): its
    prompt ends at the first sampled token; its version is the oldest its tokens were sampled
    with. None: a completion with no sampled token."""
    try:
        prompt_len = record.loss_mask.index(1)
    except ValueError:
        return None
    versions = [v for v, m in zip(record.versions, record.loss_mask, strict=True) if m]
    return Sample(
        episode=episode,
        tokens=list(record.input_ids),
        prompt_len=prompt_len,
        logprobs=list(record.logprobs),
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


def serve_proxies(
    cfg: TrainConfig, generate: Generate, renderer: ChatRenderer, *, in_pod: bool, max_staleness: int, log: Log
) -> tuple[ProxyServer, ProxyServer | None]:
    """Rank 0's proxy on ``generate`` (the one the agents call), and with ``trainer.eval`` a
    greedy one on loopback for evaluation runs. New sessions are refused while the open ones would
    pass what the steps in flight can train: (maxStaleness + 1) steps of groupsPerStep x groupSize."""
    t, p = cfg.trainer, cfg.trainer.proxy
    local = t.rollout.kind == "local" or (t.rollout.kind == "auto" and not cfg.rollout.servers)
    limits = proxy_limits(t, local=local)
    bound = (max_staleness + 1) * t.groups_per_step * t.group_size
    name = cfg.model.path
    service = RLService(generate=generate, renderer=renderer, model_name=name, limits=limits)
    service.admit = lambda: 1.0 if service.stats.snapshot()["sessions_open"] >= bound else None
    server = ProxyServer(service)
    host = p.host or ("0.0.0.0" if in_pod else "127.0.0.1")
    try:
        port = server.start(host, p.port)
    except OSError as err:
        if in_pod:  # the trainer Service's openai port names this one: another would serve no one
            server.close()
            raise TaskError(
                f"trainer.proxy.port {p.port} cannot be served ({err.strerror}); fix: free the port in the pod "
                "or choose another trainer.proxy.port"
            ) from None
        # Off a pod a busy port must not stop training (a second run on one machine): any free port.
        port = server.start(host, 0)
        log(f"proxy: port {p.port} unavailable ({err.strerror}); serving on port {port}")
    log(f"proxy: http://{host}:{port}/v1 (sessions: POST /rl/sessions)")
    if t.eval is None:
        return server, None
    evaluation = ProxyServer(RLService(generate=greedy(generate), renderer=renderer, model_name=name, limits=limits))
    evaluation.start("127.0.0.1", 0)
    return server, evaluation


def check_sessions(cfg: TrainConfig) -> None:
    """Every rank, before the model loads: the proxy must hold the runs in flight."""
    t, r, servers = cfg.trainer, cfg.trainer.rollout, cfg.rollout.servers
    local = r.kind == "local" or (r.kind == "auto" and not servers)
    bound = ((0 if local else max_staleness(r, servers)) + 1) * t.groups_per_step * t.group_size
    if bound > t.proxy.max_sessions:
        raise TaskError(
            f"trainer.proxy.maxSessions ({t.proxy.max_sessions}) is below the agent runs in flight, (maxStaleness + 1) "
            f"x groupsPerStep x groupSize = {bound}; fix: raise trainer.proxy.maxSessions to {bound} or more"
        )


def proxy_limits(t: TrainerSettings, *, local: bool = False) -> ProxyLimits:
    """The proxy's bounds from the config: trainer.proxy, maxNewTokens and maxEpisodeTokens;
    ``local``: its sampler's batches are bounded in tokens (local rollout's KV cache)."""
    p = t.proxy
    return ProxyLimits(
        max_sessions=p.max_sessions,
        max_session_tokens=t.max_episode_tokens,
        idle_timeout_s=p.idle_timeout_seconds,
        max_body_bytes=p.max_body_bytes,
        max_tokens=t.max_new_tokens,
        max_sessions_per_client=p.max_sessions_per_client,
        unused_timeout_s=p.unused_timeout_seconds,
        max_batch_tokens=LOCAL_BATCH_TOKENS if local else None,
    )
