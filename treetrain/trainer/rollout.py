"""The loop's one rollout object: a step's rollouts (:meth:`Rollout.take`), the evaluation, the
weight version's changes, the step's rollout figures, the stop, and what a checkpoint keeps.

One path for every run. The episodes come from one source (a task's, or an agent's runs through
rank 0's proxy; treetrain.rl.episodes), the group scheduler (treetrain.rl.scheduler) plays them:
inline in the step with ``trainer.rollout.maxStaleness`` 0 (local rollout's only value), in
rollout threads ahead of the trainer with N >= 1. Either way rank 0 alone plays them; with local
rollout on several ranks the others take part in its generate calls (treetrain.trainer.lockstep),
and rank 0's result, or its error, reaches every rank in one broadcast (:meth:`Rollout.rank0`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from treetrain.config import Launch, TrainConfig
from treetrain.config.schema import max_staleness
from treetrain.engines.base import Engine
from treetrain.engines.errors import CheckpointUnreadableError
from treetrain.engines.layout import Layout
from treetrain.proxy.server import ProxyServer
from treetrain.rl.episodes import EpisodeSource, TaskSource
from treetrain.rl.limits import TaskClock
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.rollout import Generation, LocalRollout, RolloutClient, SamplingParams, remote_client
from treetrain.rl.samples import Rollouts
from treetrain.rl.scheduler import GroupScheduler
from treetrain.trainer.agents import AgentSource, serve_proxies
from treetrain.trainer.data import RunData
from treetrain.trainer.evaluation import Evaluation
from treetrain.trainer.lockstep import Lockstep

T = TypeVar("T")

ROLLOUT_STATE = "rollout.json"  # the group scheduler's state, beside the engines' files
STOP_JOIN_S = 5.0  # SIGTERM or the end: how long the rollout threads get to finish


def rollout_client(cfg: TrainConfig, actor: Engine, progress: RolloutProgress) -> RolloutClient | None:
    """This rank's rollout client: local rollout samples with the actor's own model on every rank;
    with rollout servers only rank 0 talks to them (the others get its results: None)."""
    r, servers = cfg.trainer.rollout, cfg.rollout.servers
    if r.kind == "local" or (r.kind == "auto" and not servers):
        return LocalRollout(actor.sampling_model(), actor.layout.device, progress=progress)
    if not actor.layout.is_main:
        return None
    # A server's own kind wins; trainer.rollout.kind names the ones left to auto.
    pairs = [(s.url, r.kind if s.kind == "auto" else s.kind) for s in servers]
    client = remote_client(
        pairs, timeout_s=r.timeout_seconds, retries=r.retries, model=r.model, ready_timeout_s=r.ready_timeout_seconds
    )
    client.wait_ready(r.ready_timeout_seconds)
    return client


class Rollout:
    """See the module docstring. ``client``: this rank's rollout client (None on ranks other than
    0 with rollout servers); ``keep``: dynamic sampling's rule; ``stopping``: SIGTERM was received
    (the synchronous loop abandons requests to servers then)."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        data: RunData,
        client: RolloutClient | None,
        layout: Layout,
        launch: Launch,
        progress: RolloutProgress,
        clock: TaskClock,
        keep: Callable[[Rollouts], bool] | None,
        stopping: Callable[[], bool],
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.data, self.client, self.layout, self.launch = cfg, data, client, layout, launch
        self.progress, self.clock, self.keep, self.log = progress, clock, keep, log
        self.main = layout.is_main
        self.remote = not isinstance(client, LocalRollout)
        t = cfg.trainer
        self.max_staleness = max_staleness(t.rollout, cfg.rollout.servers) if self.remote else 0
        if self.remote and client is not None and self.max_staleness == 0:
            # Synchronous: SIGTERM abandons the step's requests (rank 0 alone waits on servers; its
            # RolloutStopped reaches the other ranks in the result's broadcast).
            client.stop = stopping
        self.evaluation = Evaluation(cfg, data, log)
        self.lockstep: Lockstep | None = None
        self.scheduler: GroupScheduler | None = None
        self.server: ProxyServer | None = None
        self.eval_server: ProxyServer | None = None
        self.resumed_state: dict[str, Any] | None = None  # the scheduler's, read from the resumed checkpoint
        self._marks: dict[str, float] = {}  # rollout counters at the previous step: steps report increments
        self._waited = 0.0  # seconds rank 0 waited in take()

    # -- starting --------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Rank 0's proxy (agents) and the scheduler, from ``step`` on; once (a later call, as
        train_step makes without run(), finds them started)."""
        if self.lockstep is not None:
            return
        client = self.client

        def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
            assert client is not None
            return client.generate(prompts, params, seed=seed)

        self.lockstep = Lockstep(generate if client is not None else None, 1 if self.remote else self.layout.world_size)
        if not self.main:
            return
        assert client is not None
        t, inline = self.cfg.trainer, self.max_staleness == 0
        progress = self.progress if inline else None  # the ticker shows the step in progress only
        source: EpisodeSource
        if self.data.agent is not None:
            assert self.data.renderer is not None
            self.server, self.eval_server = serve_proxies(
                self.cfg,
                self.lockstep.lead,
                self.data.renderer,
                in_pod=self.launch.in_pod,
                max_staleness=self.max_staleness,
                log=self.log,
            )
            source = AgentSource(
                self.data.agent,
                self.server,
                t,
                row=self.data.row,
                reward_runner=self.data.reward_runner,
                log=self.log,
                progress=progress,
            )
        else:
            assert self.data.task is not None
            version = client.gate
            source = TaskSource(
                self.data.task, self.lockstep.lead, t, version=lambda: version.version, progress=progress
            )
        self.scheduler = GroupScheduler(
            source,
            task=self.data.describe(),
            episode_timeout_s=t.episode_timeout_seconds,
            groups_per_step=t.groups_per_step,
            max_staleness=self.max_staleness,
            steps=t.steps,
            start_step=step,
            version=lambda: client.gate.version,  # the weight version's one owner
            keep=self.keep,
            state=self.resumed_state,
            clock=self.clock,
            progress=progress,
            group_size=t.group_size,
            log=self.log,
        )

    # -- the loop's calls ------------------------------------------------------------------
    def take(self, step: int) -> Rollouts:
        """Step ``step``'s rollouts, on every rank."""
        self.start(step)

        def played() -> Rollouts:
            assert self.scheduler is not None
            began = time.perf_counter()
            try:
                return self.scheduler.take(step)
            finally:
                self._waited += time.perf_counter() - began

        rollouts = self.rank0(played)
        if self.client is not None:
            self.client.forget()  # local rollout's KV cache: training needs the memory
        return rollouts

    def evaluate(self, step: int) -> float | None:
        """``trainer.eval``: the mean greedy reward on the evaluation rows at ``step`` (1-based,
        just trained), on every rank; None when it is no evaluation step."""
        if not self.evaluation.due(step):
            return None
        assert self.lockstep is not None
        lead = self.lockstep.lead
        reward = self.rank0(lambda: self.evaluation.run(step, lead, self.eval_server))
        if self.client is not None:
            self.client.forget()
        return reward

    def rank0(self, play: Callable[[], T]) -> T:
        """``play()`` on rank 0 while the other ranks take part in its generate calls (local
        rollout); its result, or its error, then reaches every rank: the one broadcast of what
        rank 0 played, so no rank waits for a result that never comes."""
        assert self.lockstep is not None
        out: list[Any] = [None]
        if self.main:
            try:
                out = [play()]
            except Exception as err:
                out = [err]
            finally:
                self.lockstep.stop()
        else:
            self.lockstep.follow()
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], BaseException):
            raise out[0]
        result: T = out[0]
        return result

    def version_changed(self) -> None:
        """The weights were synced (the gate holds the new version): admission may move on."""
        if self.scheduler is not None:
            self.scheduler.version_changed()

    def figures(self, step: int, rollouts: Rollouts) -> dict[str, Any]:
        """What the step's rollout side reports (rank 0; counters as increments since the last
        step): staleness per sample, the buffer, idle seconds, dropped groups, resubmissions."""
        c, marks = self.scheduler, self._marks
        assert c is not None

        def since(name: str, now: float) -> float:
            before, marks[name] = marks.get(name, 0.0), now
            return now - before

        return {
            "staleness": tuple(step - s.version for s in rollouts.samples),
            "trainer_idle_seconds": since("waited", self._waited),
            "rollout_idle_seconds": since("rollout_idle", c.idle_seconds()),
            "dropped_filtered": int(since("filtered", c.dropped["filtered"])),
            "dropped_failed": int(since("failed", c.dropped["failed"])),
            "resubmitted": int(since("resubmitted", float(getattr(self.client, "resubmitted", 0)))),
            "buffer_groups": c.buffered(),
        }

    def proxy_figures(self) -> dict[str, Any] | None:
        """The proxy's counters (an agent run's rank 0), for the metrics."""
        return self.server.stats.snapshot() if self.server is not None else None

    # -- stopping and checkpoints ----------------------------------------------------------
    def stop_soon(self) -> None:
        """SIGTERM (from its handler): local generation stops at its next check; groups of later
        steps wait for the resumed run."""
        self.progress.request_stop()
        if self.scheduler is not None:
            self.scheduler.halt()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop(timeout_s=STOP_JOIN_S)

    def close(self) -> None:
        self.stop()
        for server in (self.server, self.eval_server):
            if server is not None:
                server.close()
        self.server = self.eval_server = None

    def save(self, path: Path) -> None:
        """Rank 0: finished untrained groups and what each step has consumed, so a resumed run
        neither loses nor repeats a group (nothing with bound 0)."""
        state = self.scheduler.state() if self.scheduler is not None else None
        if state is not None:
            (path / ROLLOUT_STATE).write_text(json.dumps(state))

    def load(self, path: Path) -> None:
        """Rank 0: the scheduler's state saved in checkpoint ``path``, for :meth:`start`."""
        file = path / ROLLOUT_STATE
        if not file.is_file():
            self.resumed_state = None
            return
        try:
            self.resumed_state = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointUnreadableError(f"{file} cannot be read ({err}); it holds the rollout buffer") from None
