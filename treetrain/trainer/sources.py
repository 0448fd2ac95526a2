"""What the trainer reads rollouts from: a task, a dataset scored by a reward, or an agent played
against rank 0's OpenAI-compatible proxy; and the evaluation, and the position in the data.

The trainer (loop.py) stays a composition: :func:`build_sources` reads the config once, and the
loop asks the result for a step's rollouts (:meth:`Sources.play_agent_step`, or the task through
the existing collect path), for an evaluation (:meth:`Sources.evaluate`), and for the data
position a checkpoint keeps (:meth:`Sources.data_state`, ``data.json``).

Local rollout on several ranks: every rank must take part in every generate call, but only rank
0 runs the proxy. :class:`Lockstep` mirrors rank 0's generate calls on the other ranks, which
loop in :meth:`Lockstep.follow` until rank 0 sends the stop sentinel.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from treetrain.config import TrainConfig, TrainerSettings
from treetrain.config.algorithms import objective
from treetrain.engines.errors import CheckpointUnreadableError
from treetrain.rl.agent import Agent, Job, load_agent, play_agent_group, play_agent_groups, run_agents
from treetrain.rl.collect import Generate, Rollouts, fill_informative, play_episodes, seed_of
from treetrain.rl.progress import RolloutProgress, RolloutStopped
from treetrain.rl.rollout import Generation, SamplingParams
from treetrain.rl.task import Task, TaskError, load_task

if TYPE_CHECKING:
    from treetrain.proxy.server import ProxyServer

Log = Callable[[str], None]

DATA_STATE = "data.json"  # the DataCursor's state, beside the engines' files
EVAL_TEMPERATURE = 1e-3  # evaluation samples (nearly) greedily: a temperature of 0 divides by zero
EVAL_SALT = 7_000_001  # mixed into evaluation seeds, so they never equal a training run's


class Lockstep:
    """Rank 0's generate calls mirrored on every rank (local rollout of a sharded model): rank 0
    calls :meth:`lead` (from any thread, one call at a time), the others sit in :meth:`follow`
    until rank 0 calls :meth:`stop`. Rank 0 keeps its own result; the others discard theirs."""

    def __init__(self, generate: Generate, world_size: int) -> None:
        self.generate = generate
        self.world_size = world_size
        self._lock = threading.Lock()

    def lead(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        with self._lock:
            if self.world_size > 1:
                dist.broadcast_object_list([(prompts, params, seed)], src=0)
            return self.generate(prompts, params, seed)

    def stop(self) -> None:
        if self.world_size > 1:
            with self._lock:
                dist.broadcast_object_list([None], src=0)

    def follow(self) -> None:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            prompts, params, seed = box[0]
            try:
                self.generate(prompts, params, seed)
            except RolloutStopped:
                continue  # rank 0 stopped too (the same token); it ends the following with stop()


def greedy(generate: Generate) -> Generate:
    """``generate`` at the evaluation temperature, whatever the caller asked."""

    def call(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        return generate(prompts, dataclasses.replace(params, temperature=EVAL_TEMPERATURE, top_p=1.0), seed)

    return call


class AgentTask:
    """The task slot of an agent run: its vocabulary and reply length only (no episodes of its own;
    the agent's runs are the episodes)."""

    def __init__(self, vocab_size: int, max_new_tokens: int) -> None:
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids: tuple[int, ...] = ()

    def episode(self, seed: int) -> Any:
        raise TaskError("trainer.agent: an agent run has no task episodes (a bug: the agent path plays it)")


class Sources:
    """See the module docstring. Rank 0 starts the proxy (:meth:`start`); every rank builds the
    rest (the data cursor must agree everywhere a dataset task plays on every rank)."""

    def __init__(self, cfg: TrainConfig, get_tokenizer: Callable[[], Any], log: Log) -> None:
        self.cfg = cfg
        self.log = log
        self._get_tokenizer = get_tokenizer
        t = cfg.trainer
        self.agent: Agent | None = load_agent(t.agent) if t.agent is not None else None
        self.rows: Sequence[dict[str, Any]] | None = None
        self.eval_rows: Sequence[dict[str, Any]] | None = None
        self.reward_runner: Any = None
        self.eval_reward_runner: Any = None
        self.reward_pool: Any = None  # the reward calls' worker processes (treetrain.rl.rewards_pool)
        self.cursor: Any = None
        self.server: ProxyServer | None = None
        self.eval_server: ProxyServer | None = None
        self.lockstep: Lockstep | None = None
        self.progress: RolloutProgress | None = None  # the trainer's: agent runs count as they end
        if t.dataset is None:
            self.task: Any = load_task(t.task, t.task_args, get_tokenizer)
            return
        try:
            self._load_data(cfg, get_tokenizer)
        except TaskError:
            raise
        except ValueError as err:  # DatasetError, RewardError, ChatError: their line names the key and the fix
            raise TaskError(str(err)) from None

    def _load_data(self, cfg: TrainConfig, get_tokenizer: Callable[[], Any]) -> None:
        from treetrain.rl.dataset import ByteLimits, load_rows
        from treetrain.rl.rewards import reads_answer

        t = cfg.trainer
        assert t.dataset is not None
        # Every row checked here, before the tokenizer and the model: a bad one is one line, exit 2.
        # Sized by bytes against maxEpisodeTokens; a large file is mapped from its Arrow cache.
        answer_for = t.reward if reads_answer(t.reward, t.reward_args) else None
        limits = ByteLimits.for_episode(t.max_episode_tokens)
        self.rows = load_rows(t.dataset, answer_for=answer_for, limits=limits)
        if t.eval is not None:
            self.eval_rows = load_rows(t.eval.dataset, key="trainer.eval.dataset", answer_for=answer_for, limits=limits)
        if t.reward is not None:
            from treetrain.rl.rewards import RewardRunner, load_reward
            from treetrain.rl.rewards_pool import RewardPool

            fn = load_reward(t.reward, t.reward_args)
            self.reward_pool = RewardPool()  # training and evaluation share the workers
            self.reward_pool.start()  # its server imports while the model loads

            def runner(answer_field: str) -> RewardRunner:
                return RewardRunner(
                    fn,
                    timeout_s=t.reward_timeout_seconds,
                    answer_field=answer_field,
                    log=self.log,
                    pool=self.reward_pool,
                )

            self.reward_runner = self.eval_reward_runner = runner(t.dataset.answer_field)
            if t.eval is not None and t.eval.dataset.answer_field != t.dataset.answer_field:
                self.eval_reward_runner = runner(t.eval.dataset.answer_field)  # the eval rows name theirs
        self.resume(None)
        tokenizer = get_tokenizer()
        if tokenizer is None:
            raise TaskError(
                "trainer.dataset needs a model with a tokenizer and chat template (e.g. model.path: "
                "builtin:smollm2-135m)"
            )
        self.tokenizer = tokenizer
        if self.agent is not None:
            self.task = AgentTask(len(tokenizer), t.max_new_tokens)
            check_sessions(cfg)
            from treetrain.proxy.chat import ChatRenderer

            self.renderer = ChatRenderer(tokenizer)  # every rank: a template it refuses stops them all
        else:
            self.task = self._dataset_task()

    def describe(self) -> str:
        """What the run trains on, for the first log line."""
        t = self.cfg.trainer
        if t.dataset is None:
            return t.task
        if self.agent is not None:
            return f"agent {t.agent} over {t.dataset.path}"
        return f"{t.dataset.path} scored by {t.reward}"

    # -- the data position ------------------------------------------------------------------
    def resume(self, state: dict[str, Any] | None) -> None:
        """The data cursor, from a checkpoint's ``data.json`` (None: from the first row)."""
        if self.rows is None:
            return
        from treetrain.rl.dataset import DataCursor

        t = self.cfg.trainer
        assert t.dataset is not None
        n, gps = len(self.rows), t.groups_per_step
        if state is None:
            self.cursor = DataCursor(n, gps, shuffle=t.dataset.shuffle, seed=t.dataset.seed)
        else:
            try:
                self.cursor = DataCursor.from_state(state, n, gps, shuffle=t.dataset.shuffle, seed=t.dataset.seed)
            except ValueError as err:  # a data.json of another version: the line says to remove it
                raise TaskError(str(err)) from None
        if self.cursor.note:
            self.log(f"data: {self.cursor.note}")
        task = getattr(self, "task", None)
        if task is not None and hasattr(task, "cursor"):
            task.cursor = self.cursor  # the dataset task the trainer holds plays on from here

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        return self.cursor.state(next_step) if self.cursor is not None else None

    def row(self, step: int, group: int) -> dict[str, Any]:
        assert self.rows is not None and self.cursor is not None
        return dict(self.rows[self.cursor.row_index(step, group)])

    def _dataset_task(
        self, settings: TrainerSettings | None = None, rows: Any = None, cursor: Any = None, runner: Any = None
    ) -> Task:
        from treetrain.rl.dataset import DatasetTask

        rows = rows if rows is not None else self.rows
        runner = runner if runner is not None else self.reward_runner
        if runner is None or rows is None:
            raise TaskError("trainer.dataset without an agent needs trainer.reward (the config check says so)")
        task: Task = DatasetTask(
            rows,
            settings or self.cfg.trainer,
            self.tokenizer,
            runner,
            cursor if cursor is not None else self.cursor,
        )
        return task

    # -- the proxy --------------------------------------------------------------------------
    def start(self, generate: Generate, *, world_size: int, main: bool, in_pod: bool, max_staleness: int) -> None:
        """Agent runs: rank 0 serves the proxy (and, with ``trainer.eval``, a greedy one for
        evaluation) on ``generate``; with several ranks it is mirrored through a Lockstep."""
        if self.agent is None:
            return
        self.lockstep = Lockstep(generate, world_size)
        if not main:
            return
        from treetrain.proxy.server import ProxyServer

        t = self.cfg.trainer
        p = t.proxy
        renderer = self.renderer
        local = t.rollout.kind == "local" or (t.rollout.kind == "auto" and not self.cfg.rollout.servers)
        limits = proxy_limits(t, local=local)
        bound = (max_staleness + 1) * t.groups_per_step * t.group_size
        name = self.cfg.model.path
        self.server = ProxyServer(
            generate=self.lockstep.lead, renderer=renderer, model_name=name, limits=limits, admit=self._admit(bound)
        )
        host = p.host or ("0.0.0.0" if in_pod else "127.0.0.1")
        try:
            port = self.server.start(host, p.port)
        except OSError as err:
            if in_pod:  # the trainer Service's openai port names this one: another would serve no one
                raise TaskError(
                    f"trainer.proxy.port {p.port} cannot be served ({err.strerror}); fix: free the port in the pod "
                    "or choose another trainer.proxy.port"
                ) from None
            # Off a pod a busy port must not stop training (a second run on one machine): any free port.
            port = self.server.start(host, 0)
            self.log(f"proxy: port {p.port} unavailable ({err.strerror}); serving on port {port}")
        self.log(f"proxy: http://{host}:{port}/v1 (sessions: POST /rl/sessions)")
        if t.eval is not None:
            self.eval_server = ProxyServer(
                generate=greedy(self.lockstep.lead), renderer=renderer, model_name=name, limits=limits
            )
            self.eval_server.start("127.0.0.1", 0)

    def _admit(self, bound: int) -> Callable[[], float | None]:
        """Refuse a new session while the open ones would pass ``bound``: at most what the steps in
        flight can train (maxStaleness + 1 steps of groupsPerStep x groupSize runs)."""

        def admit() -> float | None:
            assert self.server is not None
            return 1.0 if self.server.stats.snapshot()["sessions_open"] >= bound else None

        return admit

    def follow(self) -> None:
        """Ranks other than 0: take part in rank 0's generate calls until it is done."""
        if self.lockstep is not None:
            self.lockstep.follow()

    def release(self) -> None:
        """Rank 0: the other ranks leave :meth:`follow`."""
        if self.lockstep is not None:
            self.lockstep.stop()

    def stop_rewards(self) -> None:
        """SIGTERM (from its handler): reward calls in progress end within the grace."""
        if self.reward_pool is not None:
            self.reward_pool.stop()

    def close(self) -> None:
        for server in (self.server, self.eval_server):
            if server is not None:
                server.close()
        self.server = self.eval_server = None
        if self.reward_pool is not None:
            self.reward_pool.close()  # every worker process ends with the trainer

    # -- agent rollouts ---------------------------------------------------------------------
    def play_agent_step(self, step: int) -> Rollouts:
        """Rank 0, synchronous: the step's groups, every run on one event loop; with dynamic
        sampling, more groups (rows of the cursor's replacement stream) as the task path plays."""
        t = self.cfg.trainer
        first = self.play_agent_groups(step, range(t.groups_per_step))
        if not objective(t).dynamic_sampling:
            return first

        def more(ids: Sequence[int], rnd: int) -> Rollouts:
            if self.progress is not None:
                self.progress.add_episodes(len(ids) * t.group_size)
            return self.play_agent_groups(step, ids)

        return fill_informative(first, more, t.groups_per_step, step, log=self.log)

    def play_agent_groups(self, step: int, ids: Sequence[int]) -> Rollouts:
        assert self.agent is not None and self.server is not None
        t = self.cfg.trainer
        return play_agent_groups(
            self.agent,
            [(g, self.row(step, g)) for g in ids],
            server=self.server,
            group_size=t.group_size,
            seed=t.seed,
            step=step,
            timeout_s=t.episode_timeout_seconds,
            reward_runner=self.reward_runner,
            log=self.log,
            max_new_tokens=t.max_new_tokens,
            on_done=self.progress.episodes_finished if self.progress is not None else None,
        )

    def play_agent_group(self, step: int, g: int) -> Rollouts:
        """Rank 0, asynchronous: group ``g`` of ``step`` (the rollout controller's ``play``)."""
        assert self.agent is not None and self.server is not None
        t = self.cfg.trainer
        return play_agent_group(
            self.agent,
            self.row(step, g),
            server=self.server,
            group_size=t.group_size,
            seed=t.seed,
            step=step,
            group=g,
            timeout_s=t.episode_timeout_seconds,
            reward_runner=self.reward_runner,
            log=self.log,
            max_new_tokens=t.max_new_tokens,
        )

    # -- evaluation -------------------------------------------------------------------------
    def eval_due(self, step: int) -> bool:
        """``step`` (1-based, just trained) is an evaluation step: every everySteps, and the last."""
        e = self.cfg.trainer.eval
        return e is not None and (step % e.every_steps == 0 or step == self.cfg.trainer.steps)

    def evaluate(self, step: int, generate: Generate) -> float:
        """Rank 0: the mean reward of one greedy run per evaluation row (the first ``samples``
        rows; a failed run scores 0). ``generate``: the trainer's (dataset task, no agent)."""
        t = self.cfg.trainer
        assert t.eval is not None and self.eval_rows is not None
        rows = [dict(self.eval_rows[i]) for i in range(min(t.eval.samples, len(self.eval_rows)))]
        seeds = [seed_of(t.seed, EVAL_SALT, step, i) for i in range(len(rows))]
        if self.agent is not None:
            assert self.eval_server is not None
            jobs = [
                Job(row=r, seed=s, where=f"eval at step {step}, row {i}")
                for i, (r, s) in enumerate(zip(rows, seeds, strict=True))
            ]
            runs = run_agents(
                self.agent,
                jobs,
                server=self.eval_server,
                timeout_s=t.episode_timeout_seconds,
                reward_runner=self.eval_reward_runner,
                log=self.log,
            )
            rewards = [r.reward if r.error is None else 0.0 for r in runs]
        else:
            rewards = self._eval_dataset(rows, step, generate)
        return sum(rewards) / max(len(rewards), 1)

    def _eval_dataset(self, rows: list[dict[str, Any]], step: int, generate: Generate) -> list[float]:
        """One greedy reply per row, scored by trainer.reward: the dataset task's own episodes,
        all rows in one generate call."""
        from treetrain.rl.dataset import DataCursor

        t = self.cfg.trainer
        assert t.eval is not None
        n = len(rows)
        settings = t.model_copy(update={"dataset": t.eval.dataset})
        cursor = DataCursor(n, n, shuffle=False, seed=0)  # group g of step 0 is row g
        task = self._dataset_task(settings, rows, cursor, self.eval_reward_runner)
        out = play_episodes(
            task, greedy(generate), settings, 0, list(range(n)), turn_seed=lambda turn: seed_of(t.seed, EVAL_SALT, step)
        )
        return out.rewards

    def figures(self) -> tuple[dict[str, Any] | None, dict[str, int] | None]:
        """What the metrics export: the proxy's counters and the reward runner's failures."""
        proxy = self.server.stats.snapshot() if self.server is not None else None
        runners = {id(r): r for r in (self.reward_runner, self.eval_reward_runner) if r is not None}.values()
        failures: dict[str, int] | None = None
        for r in runners:  # training and evaluation rewards fail alike: one count
            failures = {k: (failures or {}).get(k, 0) + v for k, v in r.failures.items()}
        return proxy, failures


def check_sessions(cfg: TrainConfig) -> None:
    """Every rank, before the model loads: the proxy must hold the runs in flight."""
    from treetrain.config.schema import max_staleness

    t, r, servers = cfg.trainer, cfg.trainer.rollout, cfg.rollout.servers
    local = r.kind == "local" or (r.kind == "auto" and not servers)
    bound = ((0 if local else max_staleness(r, servers)) + 1) * t.groups_per_step * t.group_size
    if bound > t.proxy.max_sessions:
        raise TaskError(
            f"trainer.proxy.maxSessions ({t.proxy.max_sessions}) is below the agent runs in flight, (maxStaleness + 1) "
            f"x groupsPerStep x groupSize = {bound}; fix: raise trainer.proxy.maxSessions to {bound} or more"
        )


def proxy_limits(t: TrainerSettings, *, local: bool = False) -> Any:
    """The proxy's bounds from the config: trainer.proxy, maxNewTokens and maxEpisodeTokens;
    ``local``: its sampler's batches are bounded in tokens (local rollout's KV cache)."""
    from treetrain.proxy.sampler import LOCAL_BATCH_TOKENS
    from treetrain.proxy.sessions import ProxyLimits

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


def write_data_state(path: Path, state: dict[str, Any] | None) -> None:
    if state is not None:
        (path / DATA_STATE).write_text(json.dumps(state))


def read_data_state(path: Path) -> dict[str, Any] | None:
    """The data cursor's state saved in checkpoint ``path`` (None: a run without a dataset)."""
    file = path / DATA_STATE
    if not file.is_file():
        return None
    try:
        state: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointUnreadableError(f"{file} cannot be read ({err}); it holds the position in the data") from None
    return state
