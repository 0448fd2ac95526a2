"""The RL loop: rollouts -> advantages -> tree-packed training -> weight sync, per step.

The trainer is a composition: engines from :func:`treetrain.engines.build_engine`, rollouts
and batches from :mod:`treetrain.rl.collect`, a rollout client from :mod:`treetrain.rl.rollout`,
the weight sync from :mod:`treetrain.trainer.weight_sync`, checkpoints from
:mod:`treetrain.trainer.checkpoints`. Every rank runs the same loop on the
same batch: rank 0's rollouts are broadcast, every rank packs the batch identically and
trains its share of the trees.

A step reads collect -> train -> sync. With ``trainer.rollout.maxStaleness`` 0 (local rollout's
only value) collect plays the step's episodes then and there; with N >= 1 (remote servers) rank
0's :class:`treetrain.rl.controller.RolloutController` plays the next steps' groups in threads
while the trainer trains, and collect takes the finished ones.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from treetrain.alloc.precision import resolve_dtype
from treetrain.config import Launch, RoleSettings, TrainConfig, check_training_backend
from treetrain.config.algorithms import objective
from treetrain.config.schema import max_staleness
from treetrain.engines import build_engine, builtin
from treetrain.engines.base import Engine, EngineConfigError, TrainBatch
from treetrain.engines.errors import CheckpointUnreadableError
from treetrain.metrics import StepFigures, TrainerMetrics
from treetrain.rl.advantages import informative_groups
from treetrain.rl.collect import Rollouts, collect_rollouts, make_batch, play_episodes, turn_seed_of
from treetrain.rl.controller import RolloutController
from treetrain.rl.limits import TaskClock, TaskInterrupted
from treetrain.rl.losses import PPOLoss, ValueLoss
from treetrain.rl.progress import RolloutProgress, RolloutStopped
from treetrain.rl.rollout import Generation, LocalRollout, RolloutClient, SamplingParams, remote_client
from treetrain.rl.task import Task, TaskError
from treetrain.trainer.checkpoints import Checkpoints, no_space, space_message, tree_bytes
from treetrain.trainer.compare import Comparison, compare_tree_vs_flat
from treetrain.trainer.samples import SampleLog
from treetrain.trainer.sources import Sources, read_data_state, write_data_state
from treetrain.trainer.step_log import StepSinks, check_sinks, health_parts, record_figures, rollout_signals
from treetrain.trainer.ticker import Ticker
from treetrain.trainer.weight_sync import WeightSync


@dataclass(slots=True)
class StepRecord:
    step: int
    reward: float
    loss: float
    tree_token_ratio: float
    original_tokens: int
    seconds: float
    rollout_seconds: float
    train_seconds: float
    grad_norm: float
    stats: dict[str, float] = field(default_factory=dict)
    # Synchronous: the rollout part, and the training and weight sync; asynchronous: the time the
    # trainer waited in take(), and the time no group was playing.
    trainer_idle_seconds: float = 0.0
    rollout_idle_seconds: float = 0.0
    # The step's replies and groups: each trained sample's reply tokens, the groups trained, those
    # whose rewards were all equal (no learning signal), and those dynamic sampling dropped.
    response_lengths: tuple[int, ...] = ()
    groups: int = 0
    zero_signal_groups: int = 0
    dropped_groups: int = 0

    @property
    def train_tokens_per_second(self) -> float:
        """Original (unpacked) tokens per second of the training part: what packing speeds up."""
        return self.original_tokens / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def step_tokens_per_second(self) -> float:
        """Original tokens per second of the whole step (rollout, training, weight sync)."""
        return self.original_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Summary:
    records: list[StepRecord]
    seconds: float
    start_step: int
    comparison: Comparison | None = None
    metrics_port: int | None = None
    interrupted: bool = False  # SIGTERM: stopped early after a checkpoint
    finished_before: bool = False  # the checkpoint already held trainer.steps: nothing trained


class Trainer:
    sinks: StepSinks | None = None  # rank 0's step log, TensorBoard, W&B (opened by run())

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        launch: Launch | None = None,
        resume: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.launch = launch or Launch()
        self.resume_required = resume
        self._threads = torch.get_num_threads()
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        self._log = log or (lambda line: print(line, flush=True))
        self.main = True  # until the actor's layout says otherwise
        try:
            self._build(cfg)
        except BaseException:
            torch.set_num_threads(self._threads)  # a failed start leaves the process as it was
            raise

    def _build(self, cfg: TrainConfig) -> None:
        t = cfg.trainer
        # The checkpoint directory first: one that cannot hold checkpoints (below a file, not
        # writable, a damaged ``latest``) fails before the model loads, not after a step.
        self.checkpoints = Checkpoints(cfg.checkpoint.dir, keep=t.keep_checkpoints)
        self.checkpoints.prepare()
        builtin.local_dir(cfg.model.path, self.log)  # a packaged built-in model: converted once, with progress
        # The task (or dataset, reward, agent) before the model: one that cannot load fails before
        # minutes of weight loading.
        self.sources = Sources(cfg, lambda: builtin.load_tokenizer(cfg.model.path), self.log)
        self.task: Task = self.sources.task
        root = str(self.checkpoints.root) if self.checkpoints.root is not None else None
        self.samples = SampleLog(t.log_samples, root, lambda: builtin.load_tokenizer(cfg.model.path), self.log)
        # The task's own code runs under a per-episode budget, and SIGTERM stops it (treetrain.rl.limits).
        self.task_clock = TaskClock(self.sources.describe(), t.episode_timeout_seconds)  # named as the run is
        # What the step's rollout has done (the ticker prints it), and SIGTERM's stop request.
        self.progress = RolloutProgress()
        self.sources.progress = self.progress
        self._sigterm = False
        tree = cfg.actor.tree_training
        # The Allocation config validation parsed (check_training_backend caches it): parsed once per pod.
        actor = check_training_backend(cfg.actor.backend)
        self.actor: Engine = build_engine(cfg.model, actor, role="actor", tree=tree, optimizer=t.optimizer)
        self.layout = self.actor.layout
        self.main = self.layout.is_main
        self.progress.should_stop = self._stop_agreed
        self.ticker = Ticker(self._log, t.progress_seconds, self.progress, t.steps)
        vocab = self.actor.vocab_size
        if self.task.vocab_size > vocab:
            raise EngineConfigError(
                f"task {t.task} uses token ids up to {self.task.vocab_size - 1}, but the model's vocabulary has {vocab}"
            )
        # The reference model only feeds the KL term: without it, it is not built at all.
        use_ref = cfg.ref is not None and t.loss.kl_coef > 0
        # Tested on cfg.ref itself, so the type checker sees it is set where it is used.
        self.ref = self._colocated(cfg.ref, "ref", optimize=False) if cfg.ref is not None and use_ref else None
        if cfg.ref is not None and not use_ref:
            self.log("ref: configured but trainer.loss.klCoef is 0, so no reference model is built")
        self.critic = self._colocated(cfg.critic, "critic", optimize=True) if cfg.critic is not None else None
        self.loss = PPOLoss(t.loss, objective(t))  # the algorithm's preset resolved
        self.value_loss = ValueLoss(t.value_loss)
        self.client = self._rollout_client()
        if self.client is not None:
            self.client.vocab_size = vocab  # servers' answers are checked against the trained model
        self.weights = WeightSync(
            actor=self.actor, client=self.client, checkpoints=self.checkpoints, settings=cfg.rollout, log=self.log
        )
        # Asynchronous rollout (maxStaleness >= 1 needs servers): rank 0's controller, made by run().
        self.max_staleness = max_staleness(t.rollout, cfg.rollout.servers) if self.remote else 0
        if self.remote and self.client is not None and self.max_staleness == 0:
            # Synchronous: SIGTERM abandons the step's requests (rank 0 alone waits on servers; its
            # RolloutStopped reaches the other ranks through the generations' broadcast).
            self.client.stop = lambda: self._sigterm
        self.controller: RolloutController | None = None
        self.rollout_state: dict[str, Any] | None = None  # the controller's, read from the resumed checkpoint
        self._marks: dict[str, float] = {}  # rollout counters at the previous step: steps report increments
        self._waited = 0.0  # seconds rank 0 waited in the controller's take()
        self.metrics = TrainerMetrics()
        self.metrics_port: int | None = None
        self.batches: list[TrainBatch] = []  # the last few, for the tree vs flat comparison

    def _colocated(self, settings: RoleSettings, role: str, *, optimize: bool) -> Engine:
        """A critic/ref in the actor's processes, in its own layout when its backend differs."""
        cfg = self.cfg
        backend = check_training_backend(settings.backend or cfg.actor.backend)
        optimizer = cfg.trainer.optimizer if optimize else None
        return build_engine(cfg.model, backend, role=role, tree=cfg.actor.tree_training, optimizer=optimizer)

    def log(self, line: str) -> None:
        if self.main:
            self._log(line)

    # -- setup -----------------------------------------------------------------------------
    def _rollout_client(self) -> RolloutClient | None:
        r, servers = self.cfg.trainer.rollout, self.cfg.rollout.servers
        if r.kind == "local" or (r.kind == "auto" and not servers):
            return LocalRollout(self.actor.sampling_model(), self.layout.device, progress=self.progress)
        if not self.main:
            return None  # only rank 0 talks to the servers; the others get its results
        # A server's own kind wins; trainer.rollout.kind names the ones left to auto.
        pairs = [(s.url, r.kind if s.kind == "auto" else s.kind) for s in servers]
        client = remote_client(
            pairs,
            timeout_s=r.timeout_seconds,
            retries=r.retries,
            model=r.model,
            ready_timeout_s=r.ready_timeout_seconds,
        )
        client.wait_ready(r.ready_timeout_seconds)
        return client

    @property
    def remote(self) -> bool:
        return not isinstance(self.client, LocalRollout)

    def _serve_metrics(self) -> None:
        m = self.cfg.trainer.metrics
        if not (self.main and m.enabled):
            return
        addr = m.addr or ("0.0.0.0" if self.launch.in_pod else "127.0.0.1")  # Prometheus scrapes the pod IP
        try:
            self.metrics_port = self.metrics.serve(m.port, addr)
        except OSError as err:
            # A busy port must not stop training (say, a second run on one machine): any free port.
            self.metrics_port = self.metrics.serve(0, addr)
            self.log(f"metrics: port {m.port} unavailable ({err.strerror}); serving on port {self.metrics_port}")
        self.log(f"metrics: http://{addr}:{self.metrics_port}/metrics")

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Every rank writes its part into a partial directory; rank 0 publishes it whole. A disk
        that fills on any rank stops every rank with one line (exit 2); the partial directory is
        removed and ``latest`` still names the last good checkpoint."""
        began = time.perf_counter()
        self.ticker.enter("checkpoint")
        if self.main:
            self.checkpoints.clear_partial(step)
        self._barrier()
        path = self.checkpoints.partial_dir(step)
        failed = ""
        try:
            self._write(path, step)
        except Exception as err:
            assert self.checkpoints.root is not None
            if not no_space(err, self.checkpoints.root):
                raise
            failed = "no space"
        if self.layout.world_size > 1:  # every rank commits, or every rank stops: no one waits in a barrier
            seen: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(seen, failed)
            failed = next((f for f in seen if f), "")
        if failed:
            self._give_up_save(path, step)
        self._barrier()
        if self.main:
            try:
                final = self.checkpoints.commit(step)
            except OSError as err:  # the rename or ``latest`` (rank 0 alone: torchrun stops the others)
                root = self.checkpoints.root
                assert root is not None
                if not no_space(err, root):
                    raise
                written = tree_bytes(path)
                self.checkpoints.clear_partial(step)
                raise EngineConfigError(space_message(root, step, written, self.checkpoints.latest())) from None
            self.log(f"checkpoint: step {step} saved to {final} in {time.perf_counter() - began:.1f}s")
        self._barrier()

    def _write(self, path: Path, step: int) -> None:
        """This rank's part of checkpoint ``step``."""
        extra = {"step": step}
        self.actor.save(path, extra)
        if self.critic is not None:
            self.critic.save(path, extra)
        if self.main and self.controller is not None:
            # Finished untrained groups and what each step has consumed: a resumed run neither
            # loses nor repeats a group.
            (path / ROLLOUT_STATE).write_text(json.dumps(self.controller.state()))
        if self.main:
            write_data_state(path, self.sources.data_state(step))  # a resumed run trains the next rows

    def _give_up_save(self, path: Path, step: int) -> None:
        """A save that ran out of space: its partial directory goes (it holds the space), and the
        run stops with one line saying how much a checkpoint needs."""
        assert self.checkpoints.root is not None
        written = tree_bytes(path)
        self._barrier()
        if self.main:
            self.checkpoints.clear_partial(step)
        self._barrier()
        raise EngineConfigError(space_message(self.checkpoints.root, step, written, self.checkpoints.latest()))

    def _restore(self) -> int:
        """Resume from the newest checkpoint that every rank can read; an unreadable one (torn by
        a crash or a full disk) is reported and the next older one is tried."""
        if self.checkpoints.pointer_is_stale():
            self.log(
                f"checkpoint: {self.checkpoints.root}/latest names a missing directory; using the newest complete one"
            )
        candidates = self.checkpoints.candidates()
        for path in candidates:
            problem = self._load(path)
            if problem is None:
                step = int(path.name.removeprefix("step-"))
                self.log(f"resumed from {path} (step {step})")
                self.checkpoints.resumed_from = path  # kept by every prune of this run
                self.rollout_state = read_rollout_state(path) if self.main else None
                self.sources.resume(read_data_state(path))
                return step
            self.checkpoints.unreadable.add(path)  # the next save prunes it first
            self.log(f"checkpoint: {problem}; trying an older one")
        where = self.checkpoints.root or "(no checkpoint.dir set)"
        if candidates:
            raise EngineConfigError(
                f"no readable checkpoint in {where} ({len(candidates)} tried); fix: move them away to start over "
                "from step 0, or give this run a new checkpoint.dir"
            )
        if self.resume_required:
            raise FileNotFoundError(f"--resume: no checkpoint in {where}")
        if self.launch.restart > 0:
            self.log(f"restart {self.launch.restart}: no checkpoint in {where} yet; starting from step 0")
        return 0

    def _load(self, path: Path) -> str | None:
        """Load ``path`` into every engine; the reason it could not be read (on any rank), or None."""
        problem = fatal = ""  # fatal: a checkpoint no older one makes right (another model, a foreign file)
        try:
            self.actor.load(path)
            if self.critic is not None:
                self.critic.load(path)
        except CheckpointUnreadableError as err:
            problem = str(err)
        except (EngineConfigError, FileNotFoundError) as err:
            if self.layout.world_size == 1:
                raise
            fatal = str(err)
        if self.layout.world_size > 1:  # every rank must resume from the same step, or stop with the same line
            found: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(found, (problem, fatal))
            fatal = next((f for _, f in found if f), "")
            if fatal:
                raise EngineConfigError(fatal)
            problem = next((p for p, _ in found if p), "")
        return problem or None

    def _barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier()

    # -- one step --------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        out: list[Any] = [None]
        if self.client is not None and (self.main or not self.remote):
            try:
                out = [self.client.generate(prompts, params, seed=seed)]
            except Exception as err:
                # Local rollout stops on every rank at the same token; any other error is rank 0's
                # to tell, so no rank waits in the broadcast for a result that never comes.
                if self.layout.world_size == 1 or (isinstance(err, RolloutStopped) and not self.remote):
                    raise
                out = [err]
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)  # every rank trains on rank 0's rollouts
        if isinstance(out[0], BaseException):
            raise out[0]
        gens: list[Generation] = out[0]
        return gens

    def collect(self, step: int) -> Rollouts:
        self.weights.resend_if_restarted()
        self._start_sources()  # train_step called without run(): the agent proxy now
        if self.max_staleness >= 1:
            return self._take(step)
        if self.sources.agent is not None:
            rollouts: Rollouts = self._on_rank0(lambda: self.sources.play_agent_step(step))
        else:
            rollouts = collect_rollouts(
                self.task,
                self._generate,
                self.cfg.trainer,
                step,
                clock=self.task_clock,
                log=self.log,
                progress=self.progress,
            )
        if self.client is not None:
            self.client.forget()  # local rollout's KV cache: training needs the memory
        return rollouts

    def _take(self, step: int) -> Rollouts:
        """Asynchronous rollout: rank 0 takes the step's groups from the controller (waiting only
        for those not finished yet) and broadcasts them, as the synchronous loop broadcasts its
        generations; an error reaches every rank, so none waits in the broadcast."""
        out: list[Any] = [None]
        if self.main:
            if self.controller is None:  # train_step called without run(): start at this step
                self._start_rollout(step)
            assert self.controller is not None
            began = time.perf_counter()
            try:
                out = [self.controller.take(step)]
            except Exception as err:
                out = [err]
            self._waited += time.perf_counter() - began
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], BaseException):
            raise out[0]
        rollouts: Rollouts = out[0]
        return rollouts

    def _play_group(self, step: int, g: int, clock: TaskClock) -> Rollouts:
        """Group ``g`` of ``step``, in a controller thread on rank 0: its episodes played turn by
        turn as the synchronous loop plays them, each turn's replies in one request batch."""
        t, client = self.cfg.trainer, self.client
        assert client is not None
        if self.sources.agent is not None:
            return self.sources.play_agent_group(step, g)

        def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
            return client.generate(prompts, params, seed=seed)

        return play_episodes(
            self.task,
            generate,
            t,
            step,
            [g] * t.group_size,
            turn_seed=lambda turn: turn_seed_of(t.seed, step, g, turn),
            clock=clock,
            version=lambda: client.gate.version,
        )

    def _on_rank0(self, play: Callable[[], Any]) -> Any:
        """``play()`` on rank 0, through the agent proxy, while the other ranks take part in its
        generate calls (local rollout); its result (or error) reaches every rank."""
        out: list[Any] = [None]
        if self.main:
            try:
                out = [play()]
            except Exception as err:
                out = [err]
            finally:
                self.sources.release()
            if self.progress.stopped or self.progress.stop_requested:
                # The agents' calls failed because generation stopped (SIGTERM): not their fault.
                out = [RolloutStopped("the agents' runs were stopped by SIGTERM")]
        else:
            self.sources.follow()
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def _evaluate(self, step: int) -> float | None:
        """``trainer.eval``: the mean greedy reward on the evaluation rows (rank 0's figure)."""
        if not self.sources.eval_due(step):
            return None
        if self.sources.agent is not None:
            reward: float = self._on_rank0(lambda: self.sources.evaluate(step, self._generate))
        else:  # the dataset task: every rank takes part in the generate call
            reward = self.sources.evaluate(step, self._generate)
        if self.client is not None:
            self.client.forget()
        return reward

    def _start_rollout(self, start: int) -> None:
        """Asynchronous rollout: rank 0 starts the controller at the weights the servers hold."""
        if self.max_staleness < 1 or not self.main:
            return
        t = self.cfg.trainer
        informative = (
            (lambda r: bool(informative_groups(r.rewards, r.groups))) if objective(t).dynamic_sampling else None
        )
        self.controller = RolloutController(
            self._play_group,
            task=t.task,
            episode_timeout_s=t.episode_timeout_seconds,
            groups_per_step=t.groups_per_step,
            max_staleness=self.max_staleness,
            steps=t.steps,
            start_step=start,
            version=start,
            keep=informative,
            state=self.rollout_state,
            log=self.log,
        )

    def _start_sources(self) -> None:
        """Agent runs: rank 0's proxy, on the rollout client (local rollout: every rank's model)."""
        client = self.client
        if self.sources.agent is None or self.sources.lockstep is not None or client is None:
            return

        def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
            return client.generate(prompts, params, seed=seed)

        self.sources.start(
            generate,
            world_size=1 if self.remote else self.layout.world_size,
            main=self.main,
            in_pod=self.launch.in_pod,
            max_staleness=self.max_staleness,
        )

    def _stop_rollout(self) -> None:
        if self.controller is not None:
            self.controller.stop(timeout_s=STOP_JOIN_S)

    def _rollout_figures(self, step: int, rollouts: Rollouts, collect_s: float, rest_s: float) -> dict[str, Any]:
        """What the step's rollout side reports (rank 0; the metrics' increments since the last
        step): staleness per sample, the buffer, idle seconds, dropped groups, resubmissions."""
        c, marks = self.controller, self._marks

        def since(name: str, now: float) -> float:
            before, marks[name] = marks.get(name, 0.0), now
            return now - before

        resubmitted = since("resubmitted", float(getattr(self.client, "resubmitted", 0)))
        if c is None:  # synchronous: the trainer waits through the rollout, the servers through the rest
            return {
                "staleness": (0,) * len(rollouts.samples),
                "trainer_idle_seconds": collect_s,
                "rollout_idle_seconds": rest_s,
                "dropped_filtered": rollouts.dropped_groups,
                "dropped_failed": 0,
                "resubmitted": int(resubmitted),
                "buffer_groups": 0,
            }
        return {
            "staleness": tuple(step - s.version for s in rollouts.samples),
            "trainer_idle_seconds": since("waited", self._waited),
            "rollout_idle_seconds": since("rollout_idle", c.idle_seconds()),
            "dropped_filtered": int(since("filtered", c.dropped["filtered"])),
            "dropped_failed": int(since("failed", c.dropped["failed"])),
            "resubmitted": int(resubmitted),
            "buffer_groups": c.buffered(),
        }

    def train_step(self, step: int) -> StepRecord:
        t0 = time.perf_counter()
        t = self.cfg.trainer
        self.ticker.begin_step(step + 1, t.groups_per_step * t.group_size)
        rollouts = self.collect(step)
        if self.main:
            self.samples.write(step + 1, rollouts)
        self.ticker.enter("training")
        if not rollouts.samples:
            raise TaskError(f"step {step + 1}: no sample to train (every agent run failed; see the lines above)")
        tc = time.perf_counter()
        batch = make_batch(rollouts, self.cfg.trainer)
        t1 = time.perf_counter()
        if self.ref is not None:
            batch.tensors["ref_logprobs"] = self.ref.forward(batch.sequences)
        extra: dict[str, float] = {}
        if rollouts.capped_turns or rollouts.capped_tokens:
            extra["episodes_capped_turns"] = rollouts.capped_turns
            extra["episodes_capped_tokens"] = rollouts.capped_tokens
        if self.critic is not None:
            extra["value_loss"] = self._train_critic(batch)
        epochs = self.cfg.trainer.ppo_epochs
        if epochs > 1:
            # Several updates on one batch: the ratio needs the policy that generated it (before
            # the first update), recomputed once; one update alone uses the current log-probs.
            batch.tensors["old_logprobs"] = self.actor.forward(batch.sequences)
        for _ in range(epochs):
            stats = self.actor.forward_backward(batch, self.loss)
            norm = self.actor.step()
        t2 = time.perf_counter()
        self.ticker.enter("weight sync")
        self.weights.sync(step + 1)
        if self.controller is not None:
            self.controller.set_version(step + 1)  # after the sync: admission never runs ahead of the servers
        rollout = self._rollout_figures(step, rollouts, tc - t0, time.perf_counter() - tc) if self.main else {}
        if self.controller is not None and rollout["staleness"]:
            extra["staleness_max"] = float(max(rollout["staleness"]))
            extra["staleness_mean"] = sum(rollout["staleness"]) / len(rollout["staleness"])
        self.batches = [*self.batches, batch][-self.cfg.trainer.compare_batches :]
        self.ticker.enter("evaluation")
        try:
            eval_reward = self._evaluate(step + 1)
        except TaskInterrupted:
            # SIGTERM during the evaluation: the step is trained and kept; its evaluation is not.
            eval_reward = None
            self.log(f"step {step + 1}: evaluation skipped (SIGTERM)")
        if eval_reward is not None:
            extra["eval_reward"] = eval_reward
        record = StepRecord(
            step=step + 1,
            reward=rollouts.mean_reward,
            loss=stats.loss,
            tree_token_ratio=stats.tree_token_ratio,
            original_tokens=stats.original_tokens,
            seconds=time.perf_counter() - t0,
            rollout_seconds=t1 - t0,
            train_seconds=t2 - t1,
            grad_norm=norm,
            stats={**stats.stats, **extra},
            trainer_idle_seconds=rollout.get("trainer_idle_seconds", 0.0),
            rollout_idle_seconds=rollout.get("rollout_idle_seconds", 0.0),
            dropped_groups=rollout.get("dropped_filtered", rollouts.dropped_groups),
            **rollout_signals(rollouts),
        )
        if self.main:
            self.metrics.observe_step(
                StepFigures(
                    tree_token_ratio=stats.tree_token_ratio,
                    original_tokens=stats.original_tokens,
                    tree_tokens=stats.tree_tokens,
                    padded_tokens=stats.padded_tokens,
                    seconds=record.seconds,
                    train_seconds=record.train_seconds,
                    loss=stats.loss,
                    reward=record.reward,
                    mismatch_mean=stats.stats.get("behav_mismatch"),
                    mismatch_max=stats.stats.get("behav_mismatch_max"),
                    capped_turns=rollouts.capped_turns,
                    capped_tokens=rollouts.capped_tokens,
                    weight_version=step + 1,
                    entropy=stats.stats.get("entropy"),
                    kl=stats.stats.get("kl"),
                    clip_fraction=stats.stats.get("clip_fraction"),
                    ratio_mean=stats.stats.get("ratio"),
                    ratio_max=stats.stats.get("ratio_max"),
                    grad_norm=norm,
                    response_lengths=record.response_lengths,
                    zero_signal_groups=record.zero_signal_groups,
                    **rollout,
                )
            )
            self.metrics.observe_agents(*self.sources.figures())
            if eval_reward is not None:
                self.metrics.observe_eval(eval_reward)
        return record

    def _train_critic(self, batch: TrainBatch) -> float:
        """PPO: values of the batch, advantages = return - value, then one critic update."""
        assert self.critic is not None
        values = self.critic.forward(batch.sequences)
        batch.tensors["old_values"] = values
        returns = batch.tensors["returns"]
        batch.tensors["advantages"] = [r - v for r, v in zip(returns, values, strict=True)]
        stats = self.critic.forward_backward(batch, self.value_loss)
        self.critic.step()
        return stats.loss

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> Summary:
        t = self.cfg.trainer
        start = self._restore()
        if start >= t.steps:
            # A finished run started again (an example run twice, a pod restarted after the end).
            self.log(
                f"nothing to train: {self.checkpoints.latest()} holds step {start} and trainer.steps is {t.steps}, "
                "so this run is finished; fix: raise trainer.steps (--steps) to train on, or give checkpoint.dir "
                "(--checkpoint-dir) a new directory to start over"
            )
            return Summary(records=[], seconds=0.0, start_step=start, finished_before=True)
        check_sinks(t.metrics)  # on every rank: a sink's missing package stops them all, before any step
        if self.main:
            self.sinks = StepSinks.open(t.metrics, self.cfg.checkpoint.dir, start=start, log=self.log)
        if start > 0:
            self.weights.sync(start)  # the servers still serve the initial weights: send the resumed ones
        self._serve_metrics()
        self._start_sources()
        self._start_rollout(start)
        begin = time.perf_counter()
        records = []
        self.log(self.header())
        if self.main:
            self.ticker.start()
        interrupted = False
        last_saved = start  # the step the newest checkpoint holds (resumed from, or written)
        with self._stop_on_sigterm():
            for step in range(start, t.steps):
                try:
                    rec = self.train_step(step)
                except TaskInterrupted as err:
                    # SIGTERM during the rollout: that step's rollouts are dropped. The weights are
                    # still those of the last step trained (rollouts do not change them), so keep
                    # that one. Ranks that stopped generating together (local rollout checks the
                    # stop at the same token on every rank) can save; ranks of a gang stopped by
                    # the task's own code may be at different points, where a save's barriers
                    # would deadlock, so only one process saves then.
                    agreed = isinstance(err, RolloutStopped) or self.layout.world_size == 1
                    if self.checkpoints.root is not None and step > last_saved and agreed:
                        self.save(step)
                    self.log(f"SIGTERM: step {step + 1} abandoned during its rollout ({err}); {self._kept()}")
                    interrupted = True
                    break
                finally:
                    self.ticker.end_step()
                records.append(rec)
                self.log(format_record(rec, t.steps))
                if self.sinks is not None:
                    self.sinks.write(rec.step, record_figures(rec))
                saved = False
                if self.checkpoints.root is not None and (
                    rec.step % self.cfg.checkpoint.interval_steps == 0 or rec.step == t.steps
                ):
                    self.save(rec.step)
                    saved = True
                    last_saved = rec.step
                if rec.step < t.steps and self._stop_requested():
                    # Kubernetes sends SIGTERM before it kills a pod: keep the step just trained
                    # (and, asynchronous, the groups finished for the next steps).
                    self._stop_rollout()
                    if self.checkpoints.root is not None and not saved:
                        self.save(rec.step)
                    self.log(f"SIGTERM: stopped after step {rec.step}; {self._kept()}")
                    interrupted = True
                    break
        self._stop_rollout()
        return Summary(
            records=records,
            seconds=time.perf_counter() - begin,
            start_step=start,
            metrics_port=self.metrics_port,
            interrupted=interrupted,
        )

    def header(self) -> str:
        """The run's first line: what trains on what, the step's shape, the layout."""
        t, tree = self.cfg.trainer, self.cfg.actor.tree_training
        return (
            f"training {self.cfg.model.path} on {self.sources.describe()}: {t.steps} steps, "
            f"{t.groups_per_step} groups x {t.group_size} samples, up to {self.task.max_new_tokens} new tokens "
            f"per reply, {self.cfg.actor.backend} ({self._dtype()}), tree packing "
            f"{'on' if tree.enabled else 'off'} (max {tree.max_tokens_per_mb} tokens/micro-batch, attention "
            f"{self.actor.attention}), rollout {self.client.kind if self.client else 'remote'}"
        )

    def _dtype(self) -> str:
        """``model.dtype`` as it runs (``auto`` resolved), and what recompute does."""
        dtype = resolve_dtype(self.cfg.model.dtype, cuda=self.layout.device.type == "cuda")
        return dtype + (", recompute" if self.cfg.model.gradient_checkpointing else "")

    def _kept(self) -> str:
        """What a stopped run leaves to resume from, for its last line."""
        if self.checkpoints.root is None:
            return "no checkpoint.dir set, so nothing is kept"
        latest = self.checkpoints.latest()
        return f"checkpoint: {latest} (resume with --resume)" if latest else "no step finished yet: nothing to keep"

    @contextlib.contextmanager
    def _stop_on_sigterm(self) -> Iterator[None]:
        """Turn SIGTERM into a request to stop (main thread only): generation in progress stops
        within a few tokens (the step is abandoned, the last one trained kept), a step in training
        finishes and is saved. Said at once, by the ticker."""
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if not self._sigterm:
                self.ticker.say(self._sigterm_line())
            self._sigterm = True
            self.progress.request_stop()  # local generation stops at its next check
            self.task_clock.stop_soon()  # a task call that hangs is stopped, not waited for
            self.sources.stop_rewards()  # so is a reward call (its worker process is killed)
            if self.controller is not None:
                self.controller.halt()  # groups of later steps wait for the resumed run

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _sigterm_line(self) -> str:
        step, phase = self.ticker.step, self.ticker.phase
        if step is None:
            return "SIGTERM received: stopping"
        if phase in ("rollout", "evaluation"):
            return f"SIGTERM received: stopping now; step {step}'s {phase} is abandoned, the last step trained is kept"
        return f"SIGTERM received: stopping after step {step} ({phase} in progress), which is kept"

    def _stop_requested(self) -> bool:
        """Every rank must stop at the same point: any rank's SIGTERM stops them all."""
        flag = torch.tensor([1.0 if self._sigterm else 0.0], device=self.layout.device)
        if self.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # host sync: once per step, and every few tokens of local rollout

    def _stop_agreed(self) -> bool:
        """Local generation's stop check: SIGTERM on any rank, seen by every rank at once."""
        if self.layout.world_size == 1:
            return self._sigterm
        return self._stop_requested()

    def compare(self) -> Comparison | None:
        """The last batches trained tree vs flat (``trainer.compareFlat``); None when SIGTERM
        skipped it (training is over by then: nothing is lost)."""
        with self._stop_on_sigterm():
            return compare_tree_vs_flat(
                self.actor,
                self.loss,
                self.batches,
                rounds=self.cfg.trainer.compare_rounds,
                stop=self._stop_requested,
            )

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
        self.ticker.close()
        self._stop_rollout()
        self.sources.close()
        self.metrics.close()
        self.weights.close()
        if self.client is not None:
            self.client.close()
        torch.set_num_threads(self._threads)


ROLLOUT_STATE = "rollout.json"  # the rollout controller's state, beside the engines' files
STOP_JOIN_S = 5.0  # SIGTERM or the end: how long the rollout threads get to finish


def read_rollout_state(path: Path) -> dict[str, Any] | None:
    """The rollout controller's state saved in checkpoint ``path`` (None: a synchronous run's)."""
    file = path / ROLLOUT_STATE
    if not file.is_file():
        return None
    try:
        state: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointUnreadableError(f"{file} cannot be read ({err}); it holds the rollout buffer") from None
    return state


def format_record(rec: StepRecord, total: int) -> str:
    width = len(str(total))
    return (
        f"step {rec.step:>{width}}/{total} | reward {rec.reward:.3f} | loss {rec.loss:+.4f} | {health_parts(rec)} | "
        f"tree_token_ratio {rec.tree_token_ratio:.3f} | train {rec.train_tokens_per_second:,.0f} tokens/s | "
        f"step {rec.seconds:.2f}s (rollout {rec.rollout_seconds:.2f}s, train {rec.train_seconds:.2f}s)"
        + (
            f" | logprob mismatch {rec.stats['behav_mismatch']:.2e} (max {rec.stats['behav_mismatch_max']:.2e})"
            if "behav_mismatch_max" in rec.stats
            else ""
        )
        + (
            f" | episodes capped: {rec.stats['episodes_capped_turns']:.0f} at trainer.maxTurns, "
            f"{rec.stats['episodes_capped_tokens']:.0f} at trainer.maxEpisodeTokens"
            if "episodes_capped_turns" in rec.stats
            else ""
        )
        + (
            f" | staleness max {rec.stats['staleness_max']:.0f} mean {rec.stats['staleness_mean']:.2f}"
            if "staleness_max" in rec.stats
            else ""
        )
        + (f" | eval reward {rec.stats['eval_reward']:.3f}" if "eval_reward" in rec.stats else "")
    )


def format_summary(summary: Summary) -> list[str]:
    """The ``done:`` line, printed as soon as the last step is trained."""
    if not summary.records:
        return []
    last = summary.records[-1]
    return [
        f"done: {len(summary.records)} steps in {summary.seconds:.1f}s; last step reward {last.reward:.3f}, "
        f"tree_token_ratio {last.tree_token_ratio:.3f}"
    ]


def format_comparison(c: Comparison) -> list[str]:
    which = "the last batch" if c.batches == 1 else f"the last {c.batches} batches"
    return [
        f"tree_token_ratio {c.tree_token_ratio:.3f} over {which} ({1 / c.tree_token_ratio:.2f}x fewer tokens)",
        f"speedup tree vs flat on {which} (forward+backward): {c.speedup:.2f}x "
        f"(flat {c.flat_seconds:.2f}s, tree {c.tree_seconds:.2f}s)",
    ]


def run_training(cfg: TrainConfig, *, launch: Launch | None = None, resume: bool = False, out: Any = None) -> Summary:
    """Build, run and close a trainer, then (``trainer.compareFlat``) time tree vs flat:
    what ``treetrain train`` calls."""
    stream = out or sys.stdout

    def log(line: str) -> None:
        print(line, file=stream, flush=True)

    trainer = Trainer(cfg, launch=launch, resume=resume, log=log)
    try:
        summary = trainer.run()
        for line in format_summary(summary):
            trainer.log(line)
        if cfg.trainer.compare_flat and trainer.batches and not summary.interrupted:
            n, rounds = len(trainer.batches), cfg.trainer.compare_rounds
            kept = " and saved" if trainer.checkpoints.root is not None else ""
            trainer.log(
                f"timing tree vs flat packing on the last {n} batch{'es' if n > 1 else ''} "
                f"({rounds} round{'s' if rounds > 1 else ''}; training is done{kept}: --no-compare or "
                "trainer.compareFlat: false skips this, SIGTERM stops it)"
            )
            summary.comparison = trainer.compare()
            if summary.comparison is None:
                trainer.log("comparison skipped (SIGTERM)")
            for line in format_comparison(summary.comparison) if summary.comparison else []:
                trainer.log(line)
        return summary
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
