"""The RL loop: rollouts -> advantages -> tree-packed training -> weight sync, per step.

Every rank runs the same loop on the same batch: rank 0's rollouts are broadcast, every
rank packs the batch identically and trains its share of the trees.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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

from treetrain.engines import builtin
from treetrain.engines.base import EngineConfigError, TrainBatch
from treetrain.engines.fsdp import FSDPEngine, hf_config
from treetrain.engines.parallel import ParallelLayout, init_distributed
from treetrain.metrics import StepFigures, TrainerMetrics
from treetrain.rl.losses import group_advantages
from treetrain.rl.rollout import (
    Generation,
    LocalRollout,
    RolloutClient,
    SamplingParams,
    SGLangRollout,
    VLLMRollout,
    detect_kind,
)
from treetrain.rl.task import Task, load_task
from treetrain.trainer.config import RoleSettings, TrainConfig

LATEST = "latest"


@dataclass(slots=True)
class Sample:
    episode: int
    tokens: list[int]
    prompt_len: int
    behav_logprobs: list[float]


@dataclass(slots=True)
class Rollouts:
    samples: list[Sample]
    rewards: list[float]  # per episode: mean reward over its turns
    groups: list[int]  # per episode: its GRPO group


@dataclass(slots=True)
class StepRecord:
    step: int
    reward: float
    loss: float
    tree_token_ratio: float
    tokens_per_second: float
    seconds: float
    rollout_seconds: float
    train_seconds: float
    grad_norm: float
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Comparison:
    batches: int
    tree_seconds: float
    flat_seconds: float
    tree_token_ratio: float

    @property
    def speedup(self) -> float:
        return self.flat_seconds / self.tree_seconds if self.tree_seconds > 0 else 0.0


@dataclass(slots=True)
class Summary:
    records: list[StepRecord]
    seconds: float
    start_step: int
    comparison: Comparison | None = None
    metrics_port: int | None = None
    interrupted: bool = False  # SIGTERM: stopped early after a checkpoint


def _seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (hash() of ints is stable, but spell it out)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2))) & ((1 << 63) - 1)
    return x


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.resume_required = resume
        self._threads = torch.get_num_threads()
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        try:
            self._build(cfg, log)
        except BaseException:
            torch.set_num_threads(self._threads)  # a failed start leaves the process as it was
            raise

    def _build(self, cfg: TrainConfig, log: Callable[[str], None] | None) -> None:
        self.layout: ParallelLayout = init_distributed(cfg.actor.backend)
        self.main = self.layout.is_main
        self._log = log or (lambda line: print(line, flush=True))
        t = cfg.trainer
        builtin.local_dir(cfg.model.path, self.log)  # a packaged built-in model: converted once, with progress
        vocab = hf_config(cfg.model).vocab_size
        self.task: Task = load_task(t.task, t.task_args, lambda: builtin.load_tokenizer(cfg.model.path))
        if self.task.vocab_size > vocab:
            raise EngineConfigError(
                f"task {t.task} uses token ids up to {self.task.vocab_size - 1}, but the model's vocabulary has {vocab}"
            )
        tree = cfg.actor.tree_training
        self.actor = FSDPEngine(cfg.model, self.layout, tree, t.optimizer, role="actor")
        # The reference model only feeds the KL term: without it, it is not built at all.
        use_ref = cfg.ref is not None and t.loss.kl_coef > 0
        self.ref = FSDPEngine(cfg.model, self._layout_of(cfg.ref), tree, None, role="ref") if use_ref else None
        if cfg.ref is not None and not use_ref:
            self.log("ref: configured but trainer.loss.klCoef is 0, so no reference model is built")
        self.critic = (
            FSDPEngine(cfg.model, self._layout_of(cfg.critic), tree, t.optimizer, role="critic")
            if cfg.critic is not None
            else None
        )
        self.loss = t.loss.build()
        self.value_loss = t.value_loss.build()
        self.client = self._rollout_client()
        self.metrics = TrainerMetrics()
        self.metrics_port: int | None = None
        self.batches: list[TrainBatch] = []  # the last few, for the tree vs flat comparison

    def _layout_of(self, settings: RoleSettings | None) -> ParallelLayout:
        """A colocated critic/ref: the actor's processes, in its own layout when its backend differs."""
        if settings is None or not settings.backend or settings.backend == self.cfg.actor.backend:
            return self.layout
        return init_distributed(settings.backend)

    def log(self, line: str) -> None:
        if self.main:
            self._log(line)

    # -- setup -----------------------------------------------------------------------------
    def _rollout_client(self) -> RolloutClient | None:
        r, eps = self.cfg.trainer.rollout, self.cfg.rollout.endpoints
        kind = r.kind
        if kind == "auto":
            backend_kind = self.cfg.rollout.backend.partition(":")[0]
            kind = backend_kind if backend_kind in ("sglang", "vllm") else ("local" if not eps else "")
        if kind == "local":
            return LocalRollout(self.actor.model, self.layout.device)
        if not self.main:
            return None  # only rank 0 talks to the servers; the others get its results
        kind = kind or detect_kind(eps)
        common: dict[str, Any] = {"endpoints": list(eps), "timeout_s": r.timeout_seconds, "retries": r.retries}
        client: RolloutClient = SGLangRollout(**common) if kind == "sglang" else VLLMRollout(model=r.model, **common)
        client.wait_ready(r.ready_timeout_seconds)
        return client

    @property
    def remote(self) -> bool:
        return not isinstance(self.client, LocalRollout)

    def _serve_metrics(self) -> None:
        m = self.cfg.trainer.metrics
        if not (self.main and m.enabled):
            return
        try:
            self.metrics_port = self.metrics.serve(m.port, m.addr)
        except OSError as err:
            # A busy port must not stop training (say, a second run on one machine): any free port.
            self.metrics_port = self.metrics.serve(0, m.addr)
            self.log(f"metrics: port {m.port} unavailable ({err.strerror}); serving on port {self.metrics_port}")
        addr = m.addr or ("0.0.0.0" if os.environ.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1")
        self.log(f"metrics: http://{addr}:{self.metrics_port}/metrics")

    # -- checkpoints -----------------------------------------------------------------------
    def _ckpt_root(self) -> Path | None:
        d = self.cfg.checkpoint.dir
        return Path(d) if d else None

    def latest_checkpoint(self) -> Path | None:
        root = self._ckpt_root()
        if root is None or not (root / LATEST).is_file():
            return None
        path = root / (root / LATEST).read_text().strip()
        return path if path.is_dir() else None

    def save(self, step: int) -> Path:
        root = self._ckpt_root()
        assert root is not None
        path = root / f"step-{step:08d}"
        extra = {"step": step}
        self.actor.save(path, extra)
        if self.critic is not None:
            self.critic.save(path, extra)
        self._barrier()
        if self.main:
            tmp = root / (LATEST + ".tmp")
            tmp.write_text(path.name + "\n")
            tmp.replace(root / LATEST)  # atomic: a crash never leaves a half-written pointer
            _prune(root, "step-", keep=self.cfg.trainer.keep_checkpoints)
        self._barrier()
        return path

    def _restore(self) -> int:
        restart = int(os.environ.get("TREETRAIN_RESTART", "0") or 0)
        path = self.latest_checkpoint()
        if path is None:
            if self.resume_required or restart > 0:
                where = self._ckpt_root() or "(no checkpoint.dir set)"
                if self.resume_required:
                    raise FileNotFoundError(f"--resume: no checkpoint in {where}")
                self.log(f"restart {restart}: no checkpoint in {where} yet; starting from step 0")
            return 0
        extra = self.actor.load(path)
        if self.critic is not None:
            self.critic.load(path)
        self.log(f"resumed from {path} (step {extra['step']})")
        return int(extra["step"])

    def _barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier()

    # -- one step --------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        out: list[Any] = [None]
        if self.client is not None and (self.main or not self.remote):
            out = [self.client.generate(prompts, params, seed=seed)]
        if self.layout.world_size > 1:
            dist.broadcast_object_list(out, src=0)  # every rank trains on rank 0's rollouts
        gens: list[Generation] = out[0]
        return gens

    def collect(self, step: int) -> Rollouts:
        t = self.cfg.trainer
        r = t.rollout
        params = SamplingParams(
            max_new_tokens=self.task.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            stop_token_ids=tuple(getattr(self.task, "stop_token_ids", ())),
        )
        episodes, groups = [], []
        for g in range(t.groups_per_step):
            for _ in range(t.group_size):  # one group: the same episode seed, different samples
                episodes.append(self.task.episode(_seed(t.seed, step, g)))
                groups.append(g)
        history = [ep.prompt() for ep in episodes]
        totals = [0.0] * len(episodes)
        turns = [0] * len(episodes)
        active = list(range(len(episodes)))
        samples: list[Sample] = []
        turn = 0
        while active:
            gens = self._generate([history[i] for i in active], params, _seed(t.seed, step, 1_000_003, turn))
            still = []
            for i, gen in zip(active, gens, strict=True):
                tokens = history[i] + gen.tokens
                samples.append(
                    Sample(episode=i, tokens=tokens, prompt_len=len(history[i]), behav_logprobs=gen.logprobs)
                )
                nxt, reward = episodes[i].respond(list(gen.tokens))
                totals[i] += reward
                turns[i] += 1
                if nxt is not None:
                    history[i] = tokens + list(nxt)
                    still.append(i)
            active = still
            turn += 1
        if self.client is not None:
            self.client.forget()  # local rollout's KV cache: training needs the memory
        rewards = [total / max(n, 1) for total, n in zip(totals, turns, strict=True)]
        return Rollouts(samples=samples, rewards=rewards, groups=groups)

    def make_batch(self, rollouts: Rollouts) -> TrainBatch:
        t = self.cfg.trainer
        if t.algorithm == "grpo":
            adv = group_advantages(rollouts.rewards, rollouts.groups, normalize_std=t.normalize_advantages)
        else:
            adv = rollouts.rewards  # PPO: returns; advantages come from the critic below
        seqs, masks, advs, behav, returns = [], [], [], [], []
        for s in rollouts.samples:
            n = len(s.tokens) - 1
            mask = torch.zeros(n)
            mask[s.prompt_len - 1 :] = 1.0  # position i predicts token i + 1: the response tokens
            b = torch.zeros(n)
            b[s.prompt_len - 1 :] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
            seqs.append(s.tokens)
            masks.append(mask)
            advs.append(torch.full((n,), float(adv[s.episode])))
            returns.append(torch.full((n,), float(rollouts.rewards[s.episode])))
            behav.append(b)
        tensors: dict[str, list[torch.Tensor]] = {"advantages": advs, "behav_logprobs": behav}
        if t.algorithm == "ppo":
            tensors["returns"] = returns
        return TrainBatch(sequences=seqs, loss_mask=masks, tensors=tensors)

    def train_step(self, step: int) -> StepRecord:
        t0 = time.perf_counter()
        rollouts = self.collect(step)
        batch = self.make_batch(rollouts)
        t1 = time.perf_counter()
        if self.ref is not None:
            batch.tensors["ref_logprobs"] = self.ref.forward(batch.sequences)
        extra: dict[str, float] = {}
        if self.critic is not None:
            values = self.critic.forward(batch.sequences)
            batch.tensors["old_values"] = values
            rets = batch.tensors["returns"]
            batch.tensors["advantages"] = [(r - v) for r, v in zip(rets, values, strict=True)]
            cstats = self.critic.forward_backward(batch, self.value_loss)
            self.critic.step()
            extra["value_loss"] = cstats.loss
        epochs = self.cfg.trainer.ppo_epochs
        if epochs > 1:
            # Several updates on one batch: the ratio needs the policy that generated it (before
            # the first update), recomputed once; one update alone uses the current log-probs.
            batch.tensors["old_logprobs"] = self.actor.forward(batch.sequences)
        for _ in range(epochs):
            stats = self.actor.forward_backward(batch, self.loss)
            norm = self.actor.step()
        t2 = time.perf_counter()
        if self.remote:
            self._sync_weights(step + 1)
        seconds = time.perf_counter() - t0
        self.batches = [*self.batches, batch][-self.cfg.trainer.compare_batches :]
        reward = sum(rollouts.rewards) / max(len(rollouts.rewards), 1)
        fig = StepFigures(
            tree_token_ratio=stats.tree_token_ratio,
            original_tokens=stats.original_tokens,
            tree_tokens=stats.tree_tokens,
            padded_tokens=stats.padded_tokens,
            seconds=seconds,
            loss=stats.loss,
            reward=reward,
        )
        if self.main:
            self.metrics.observe_step(fig)
        return StepRecord(
            step=step + 1,
            reward=reward,
            loss=stats.loss,
            tree_token_ratio=stats.tree_token_ratio,
            tokens_per_second=stats.original_tokens / (t2 - t1) if t2 > t1 else 0.0,
            seconds=seconds,
            rollout_seconds=t1 - t0,
            train_seconds=t2 - t1,
            grad_norm=norm,
            stats={**stats.stats, **extra},
        )

    def _sync_weights(self, version: int) -> None:
        root = self._ckpt_root()
        if root is None:
            raise EngineConfigError("remote rollout needs checkpoint.dir (a path the rollout servers also mount)")
        path = root / "weights" / f"v{version:08d}"
        self.actor.export_hf(path)
        if self.main:
            assert self.client is not None
            self.client.update_weights(str(path), version)
            _prune(path.parent, "v", keep=1)  # every server has loaded this version: older ones go
        self._barrier()

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> Summary:
        t = self.cfg.trainer
        start = self._restore()
        self._serve_metrics()
        begin = time.perf_counter()
        records = []
        tree = self.cfg.actor.tree_training
        self.log(
            f"training {self.cfg.model.path} on {t.task}: {t.steps} steps, {t.groups_per_step} groups x "
            f"{t.group_size} samples, {self.cfg.actor.backend}, tree packing {'on' if tree.enabled else 'off'} "
            f"(max {tree.max_tokens_per_mb} tokens/micro-batch, attention {self.actor.attention}), "
            f"rollout {self.client.kind if self.client else 'remote'}"
        )
        interrupted = False
        with self._stop_on_sigterm():
            for step in range(start, t.steps):
                rec = self.train_step(step)
                records.append(rec)
                self.log(format_record(rec, t.steps))
                interval = self.cfg.checkpoint.interval_steps
                saved = False
                if self._ckpt_root() is not None and (rec.step % interval == 0 or rec.step == t.steps):
                    self.save(rec.step)
                    saved = True
                if rec.step < t.steps and self._stop_requested():
                    # Kubernetes sends SIGTERM before it kills a pod: keep the step just trained.
                    if self._ckpt_root() is not None and not saved:
                        self.save(rec.step)
                    self.log(f"SIGTERM: stopped after step {rec.step} (checkpoint: {self.latest_checkpoint()})")
                    interrupted = True
                    break
        seconds = time.perf_counter() - begin  # the training steps only, not the comparison below
        run_compare = t.compare_flat and self.batches and not interrupted
        comparison = self.compare(t.compare_rounds) if run_compare else None
        return Summary(
            records=records,
            seconds=seconds,
            start_step=start,
            comparison=comparison,
            metrics_port=self.metrics_port,
            interrupted=interrupted,
        )

    @contextlib.contextmanager
    def _stop_on_sigterm(self) -> Iterator[None]:
        """Turn SIGTERM into a request to stop after the current step (main thread only)."""
        self._sigterm = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            self._sigterm = True

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _stop_requested(self) -> bool:
        """Every rank must stop at the same step: any rank's SIGTERM stops them all."""
        flag = torch.tensor([1.0 if self._sigterm else 0.0], device=self.layout.device)
        if self.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # host sync: once per step

    def compare(self, repeat: int) -> Comparison:
        """Train the same batches tree-packed and flat (gradients thrown away).

        One burn-in pass per mode (the flat micro-batches have shapes training never ran:
        without it their first allocations inflate the speedup by a third on a CPU), then
        ``repeat`` measured rounds that alternate the modes, so a load change on a shared
        machine hits both; the best round of each counts. On a CPU every op has finished when
        the call returns (on a GPU: synchronize first).
        """
        times = {True: float("inf"), False: float("inf")}
        for mode in (True, False):
            self.actor.forward_backward(self.batches[0], self.loss, tree=mode)  # burn-in
            self.actor.zero_grad()
        for _ in range(repeat):
            for mode in (True, False):
                _sync()
                t0 = time.perf_counter()
                for b in self.batches:
                    self.actor.forward_backward(b, self.loss, tree=mode)
                _sync()
                times[mode] = min(times[mode], time.perf_counter() - t0)
                self.actor.zero_grad()
        packed = [self.actor.pack(b.sequences, tree=True).stats for b in self.batches]
        ratio = sum(s.tree_tokens for s in packed) / max(sum(s.original_tokens for s in packed), 1)
        return Comparison(
            batches=len(self.batches), tree_seconds=times[True], flat_seconds=times[False], tree_token_ratio=ratio
        )

    def close(self) -> None:
        self.metrics.close()
        if self.client is not None:
            self.client.close()
        torch.set_num_threads(self._threads)


def _prune(root: Path, prefix: str, *, keep: int) -> None:
    """Delete all but the newest ``keep`` directories ``root/<prefix><zero-padded number>``."""
    found = sorted(p for p in root.glob(prefix + "*") if p.is_dir() and p.name[len(prefix) :].isdigit())
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def format_record(rec: StepRecord, total: int) -> str:
    width = len(str(total))
    return (
        f"step {rec.step:>{width}}/{total} | reward {rec.reward:.3f} | loss {rec.loss:+.4f} | "
        f"tree_token_ratio {rec.tree_token_ratio:.3f} | {rec.tokens_per_second:,.0f} tokens/s | "
        f"step {rec.seconds:.2f}s (rollout {rec.rollout_seconds:.2f}s, train {rec.train_seconds:.2f}s)"
    )


def format_summary(summary: Summary) -> list[str]:
    lines = []
    done = len(summary.records)
    if summary.records:
        last = summary.records[-1]
        lines.append(
            f"done: {done} steps in {summary.seconds:.1f}s; last step reward {last.reward:.3f}, "
            f"tree_token_ratio {last.tree_token_ratio:.3f}"
        )
    c = summary.comparison
    if c is not None:
        which = "the last batch" if c.batches == 1 else f"the last {c.batches} batches"
        lines.append(
            f"tree_token_ratio {c.tree_token_ratio:.3f} over {which} ({1 / c.tree_token_ratio:.2f}x fewer tokens)"
        )
        lines.append(
            f"speedup tree vs flat on {which} (forward+backward): {c.speedup:.2f}x "
            f"(flat {c.flat_seconds:.2f}s, tree {c.tree_seconds:.2f}s)"
        )
    return lines


def run_training(cfg: TrainConfig, *, resume: bool = False, out: Any = None) -> Summary:
    """Build, run and close a trainer (what ``treetrain train`` calls)."""
    stream = out or sys.stdout

    def log(line: str) -> None:
        print(line, file=stream, flush=True)

    trainer = Trainer(cfg, resume=resume, log=log)
    try:
        summary = trainer.run()
        for line in format_summary(summary):
            trainer.log(line)
        return summary
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
