"""The RL loop: rollouts -> the algorithm's batch, passes and update -> weight sync, per step.

The trainer is a composition: engines from :func:`treetrain.engines.build_engine`, a step's
rollouts from one rollout object (:mod:`treetrain.trainer.rollout`: the episode source, the
group scheduler, rank 0's broadcast), the algorithm from the preset table
(:mod:`treetrain.rl.algorithm`), the weight sync (:mod:`treetrain.trainer.weight_sync`),
checkpoints (:mod:`treetrain.trainer.saving`), SIGTERM (:mod:`treetrain.trainer.stop`). Every
rank runs the same loop on the same batch: rank 0's rollouts reach every rank, every rank packs
the batch identically and trains its share of the trees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treetrain.config import Launch, TrainConfig, check_training_backend
from treetrain.config.schema import max_staleness
from treetrain.engines import build_engine, builtin
from treetrain.engines.base import Engine
from treetrain.engines.batch import TrainBatch
from treetrain.engines.errors import EngineConfigError
from treetrain.metrics import StepRecord, TrainerMetrics
from treetrain.rl.algorithm import Algorithm
from treetrain.rl.limits import TaskClock, TaskInterrupted
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.samples import Rollouts
from treetrain.rl.task import TaskError
from treetrain.trainer.checkpoints import Checkpoints
from treetrain.trainer.compare import Comparison, compare_tree_vs_flat
from treetrain.trainer.data import RunData
from treetrain.trainer.lines import format_record, header
from treetrain.trainer.rollout import Rollout, rollout_client
from treetrain.trainer.samples import SampleLog
from treetrain.trainer.saving import RunCheckpoints
from treetrain.trainer.step_log import StepSinks, check_sinks, record_figures, serve_metrics, step_record
from treetrain.trainer.stop import StopSignal
from treetrain.trainer.ticker import Ticker
from treetrain.trainer.weight_sync import WeightSync

__all__ = ["StepRecord", "Summary", "Trainer"]


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
        self.cfg, self.launch, self.resume_required = cfg, launch or Launch(), resume
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
        tokenizer = lambda: builtin.load_tokenizer(cfg.model.path)  # noqa: E731
        self.data = RunData(cfg, tokenizer, self.log)
        root = str(self.checkpoints.root) if self.checkpoints.root is not None else None
        self.samples = SampleLog(t.log_samples, root, tokenizer, self.log)
        # The task's own code runs under a per-episode budget, and SIGTERM stops it (treetrain.rl.limits).
        self.task_clock = TaskClock(self.data.describe(), t.episode_timeout_seconds)  # named as the run is
        self.progress = RolloutProgress()  # what the step's rollout has done (the ticker prints it)
        tree = cfg.actor.tree_training
        # The Allocation config validation parsed (check_training_backend caches it): parsed once per pod.
        backend = check_training_backend(cfg.actor.backend)
        self.actor: Engine = build_engine(
            cfg.model, backend, role="actor", tree=tree, optimizer=t.optimizer, lora=cfg.actor.lora
        )
        self.layout = self.actor.layout
        self.main = self.layout.is_main
        self.ticker = Ticker(self._log, t.progress_seconds, self.progress, t.steps)
        if self.data.vocab_size > self.actor.vocab_size:
            raise EngineConfigError(
                f"task {t.task} uses token ids up to {self.data.vocab_size - 1}, but the model's vocabulary has "
                f"{self.actor.vocab_size}"
            )
        self.algorithm = Algorithm.build(cfg, self.actor, self.log)  # the preset resolved, a ref and critic
        self.client = rollout_client(cfg, self.actor, self.progress)
        if self.client is not None:
            self.client.vocab_size = self.actor.vocab_size  # servers' answers are checked against the trained model
        self.weights = WeightSync(
            actor=self.actor,
            client=self.client,
            checkpoints=self.checkpoints,
            settings=cfg.rollout,
            log=self.log,
            lora=cfg.actor.lora,
            max_staleness=max_staleness(t.rollout, cfg.rollout.servers),
        )
        self.stop = StopSignal(self.layout, self.ticker, self._stop_soon)
        self.progress.should_stop = self.stop.generation_check
        self.rollout = Rollout(
            cfg,
            data=self.data,
            client=self.client,
            layout=self.layout,
            launch=self.launch,
            progress=self.progress,
            clock=self.task_clock,
            keep=self.algorithm.keep,
            stopping=lambda: self.stop.requested,
            log=self.log,
        )
        critic = self.algorithm.critic
        trained = [self.actor] + ([critic] if critic is not None else [])
        self.saver = RunCheckpoints(
            self.checkpoints, trained, self.layout, rollout=self.rollout, data=self.data, log=self.log
        )
        self.metrics = TrainerMetrics()
        self.metrics_port: int | None = None
        self.batches: list[TrainBatch] = []  # the last few, for the tree vs flat comparison

    def log(self, line: str) -> None:
        if self.main:
            self._log(line)

    def _stop_soon(self) -> None:
        """SIGTERM's handler: what runs stops soon (see treetrain.trainer.stop)."""
        self.rollout.stop_soon()  # local generation, and groups of later steps
        self.task_clock.stop_soon()  # a task call that hangs is stopped, not waited for
        self.data.stop_rewards()  # so is a reward call (its worker process is killed)

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> Summary:
        t = self.cfg.trainer
        start = self.saver.restore(required=self.resume_required, restart=self.launch.restart)
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
        if self.main:
            self.metrics_port = serve_metrics(self.metrics, t.metrics, in_pod=self.launch.in_pod, log=self.log)
        self.rollout.start(start)
        begin, records, interrupted = time.perf_counter(), [], False
        self.log(header(self.cfg, self.data, self.actor, self.client))
        if self.main:
            self.ticker.start()
        saving = self.checkpoints.root is not None
        last_saved = start  # the step the newest checkpoint holds (resumed from, or written)
        with self.stop.handled():
            for step in range(start, t.steps):
                try:
                    rec = self.train_step(step)
                except TaskInterrupted as err:
                    # SIGTERM during the rollout: that step's rollouts are dropped. The weights are
                    # still those of the last step trained (rollouts do not change them), so keep
                    # that one; every rank got the same error from rank 0 at the same point.
                    if saving and step > last_saved:
                        self._save(step)
                    self.log(f"SIGTERM: step {step + 1} abandoned during its rollout ({err}); {self.saver.kept()}")
                    interrupted = True
                    break
                finally:
                    self.ticker.end_step()
                records.append(rec)
                self.log(format_record(rec, t.steps))
                if self.sinks is not None:
                    self.sinks.write(rec.step, record_figures(rec))
                due = saving and (rec.step % self.cfg.checkpoint.interval_steps == 0 or rec.step == t.steps)
                if due:
                    self._save(rec.step)
                    last_saved = rec.step
                if rec.step < t.steps and self.stop.agreed():
                    # Kubernetes sends SIGTERM before it kills a pod: keep the step just trained
                    # (and, asynchronous, the groups finished for the next steps).
                    self.rollout.stop()
                    if saving and not due:
                        self._save(rec.step)
                    self.log(f"SIGTERM: stopped after step {rec.step}; {self.saver.kept()}")
                    interrupted = True
                    break
        self.rollout.stop()
        seconds = time.perf_counter() - begin
        return Summary(records, seconds, start, metrics_port=self.metrics_port, interrupted=interrupted)

    def _save(self, step: int) -> None:
        self.ticker.enter("checkpoint")
        self.saver.save(step)

    def collect(self, step: int) -> Rollouts:
        """Step ``step``'s rollouts on every rank (a server restarted since the last sync gets the
        weights again first)."""
        self.weights.resend_if_restarted()
        return self.rollout.take(step)

    def train_step(self, step: int) -> StepRecord:
        t0, t = time.perf_counter(), self.cfg.trainer
        self.ticker.begin_step(step + 1, t.groups_per_step * t.group_size)
        rollouts = self.collect(step)
        if self.main:
            self.samples.write(step + 1, rollouts)
        self.ticker.enter("training")
        if not rollouts.samples:
            raise TaskError(f"step {step + 1}: no sample to train (every agent run failed; see the lines above)")
        batch = self.algorithm.batch(rollouts)
        t1 = time.perf_counter()
        batch = self.algorithm.prepare(batch)
        update = self.algorithm.update(batch)
        t2 = time.perf_counter()
        self.ticker.enter("weight sync")
        self.weights.sync(step + 1)
        self.rollout.version_changed()  # after the sync: admission never runs ahead of the servers
        self.batches = [*self.batches, batch][-t.compare_batches :]
        self.ticker.enter("evaluation")
        try:
            eval_reward = self.rollout.evaluate(step + 1)
        except TaskInterrupted:
            # SIGTERM during the evaluation: the step is trained and kept; its evaluation is not.
            eval_reward = None
            self.log(f"step {step + 1}: evaluation skipped (SIGTERM)")
        figures = self.rollout.figures(step, rollouts) if self.main else {}
        record = step_record(
            step + 1,
            rollouts,
            update,
            eval_reward=eval_reward,
            figures=figures,
            staleness_shown=self.rollout.max_staleness >= 1,
            seconds=(time.perf_counter() - t0, t1 - t0, t2 - t1),
            weight_version=self.weights.version,
        )
        if self.main:
            self.metrics.observe_step(record)
            self.metrics.observe_sync(self.weights.last)
            self.metrics.observe_agents(self.rollout.proxy_figures(), self.data.reward_failures())
            if eval_reward is not None:
                self.metrics.observe_eval(eval_reward)
        return record

    def compare(self) -> Comparison | None:
        """The last batches trained tree vs flat (``trainer.compareFlat``); None when SIGTERM
        skipped it (training is over by then: nothing is lost)."""
        with self.stop.handled():
            rounds = self.cfg.trainer.compare_rounds
            return compare_tree_vs_flat(
                self.actor, self.algorithm.loss, self.batches, rounds=rounds, stop=self.stop.agreed
            )

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()
        self.ticker.close()
        self.rollout.close()
        self.data.close()
        self.metrics.close()
        self.weights.close()
        if self.client is not None:
            self.client.close()
        torch.set_num_threads(self._threads)
