"""Where rank 0 writes each step's figures besides Prometheus, for a user to plot: a JSONL step
log (``steps.jsonl`` in ``checkpoint.dir``, ``trainer.metrics.stepLog``), TensorBoard event files
(``trainer.metrics.tensorboardDir``) and Weights & Biases (``trainer.metrics.wandb``).

Every sink gets the same flat ``{name: number}`` figures of a step (:func:`record_figures`). A
resumed run appends; the step log first drops the lines of steps after the one it resumed from
(steps a crashed run trained but did not checkpoint, which the resumed run trains again), so
no step number is left twice. TensorBoard and W&B come from the ``tracking`` extra: a config that
asks for one that is not installed stops the run before its first step, with one line.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from treetrain.config.trainer_settings import MetricsSettings, WandbMode
from treetrain.engines.errors import EngineConfigError
from treetrain.metrics import StepRecord, TrainerMetrics
from treetrain.rl.advantages import informative_groups
from treetrain.rl.algorithm import Update
from treetrain.rl.samples import Rollouts, reply_lengths

if TYPE_CHECKING:
    from collections.abc import Callable

STEP_LOG_FILE = "steps.jsonl"
TRACKING_INSTALL = "pip install 'treetrain[tracking]'"

# StepRecord.stats names whose step-log name says more (the rest keep their own).
STAT_NAMES = {
    "ratio": "importance_ratio_mean",
    "ratio_max": "importance_ratio_max",
    "behav_mismatch": "logprob_mismatch_mean",
    "behav_mismatch_max": "logprob_mismatch_max",
}


class SinkUnavailableError(EngineConfigError):
    """A configured sink that cannot run here (its package is missing, W&B would not start):
    a config problem, so ``treetrain train`` exits 2."""


def _missing(package: str, key: str, fix: str) -> SinkUnavailableError:
    return SinkUnavailableError(
        f"trainer.metrics.{key} is set but the {package} package is not installed; fix: {TRACKING_INSTALL}, or {fix}"
    )


def check_sinks(settings: MetricsSettings) -> None:
    """The packages of the sinks ``settings`` asks for are importable (every rank checks, so a
    gang stops together, before its first step; rank 0 alone opens them)."""
    if settings.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise _missing("tensorboard", "tensorboardDir", "unset tensorboardDir")
    if settings.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise _missing("wandb", "wandb", "remove trainer.metrics.wandb")


def rollout_signals(rollouts: Rollouts) -> dict[str, Any]:
    """The step's replies and groups, for StepRecord: each trained sample's reply length in
    tokens, the groups, and those whose rewards were all equal (no group-relative learning
    signal; the same test dynamic sampling filters with)."""
    groups = set(rollouts.groups)
    return {
        "response_lengths": tuple(reply_lengths(rollouts)),
        "groups": len(groups),
        "zero_signal_groups": len(groups - informative_groups(rollouts.rewards, rollouts.groups)),
    }


def step_record(
    step: int,
    rollouts: Rollouts,
    update: Update,
    *,
    eval_reward: float | None,
    figures: dict[str, Any],
    staleness_shown: bool,
    seconds: tuple[float, float, float],
    weight_version: int,
) -> StepRecord:
    """Step ``step``'s (1-based) one record: the update's figures and the loss's statistics, the
    step's extras (capped episodes, the critic's loss, the evaluation, staleness where the step
    line shows it), the rollout side's ``figures`` (rank 0's; none elsewhere) and ``seconds``
    (the step, its rollout part, its training part)."""
    stats, extra = update.stats, {}
    if rollouts.capped_turns or rollouts.capped_tokens:
        extra["episodes_capped_turns"] = float(rollouts.capped_turns)
        extra["episodes_capped_tokens"] = float(rollouts.capped_tokens)
    if update.value_loss is not None:
        extra["value_loss"] = update.value_loss
    staleness = figures.get("staleness")
    if staleness_shown and staleness:
        extra["staleness_max"] = float(max(staleness))
        extra["staleness_mean"] = sum(staleness) / len(staleness)
    if eval_reward is not None:
        extra["eval_reward"] = eval_reward
    total, rollout_s, train_s = seconds
    return StepRecord(
        step=step,
        reward=rollouts.mean_reward,
        loss=stats.loss,
        tree_token_ratio=stats.tree_token_ratio,
        original_tokens=stats.original_tokens,
        tree_tokens=stats.tree_tokens,
        padded_tokens=stats.padded_tokens,
        seconds=total,
        rollout_seconds=rollout_s,
        train_seconds=train_s,
        grad_norm=update.grad_norm,
        stats={**stats.stats, **extra},
        capped_turns=rollouts.capped_turns,
        capped_tokens=rollouts.capped_tokens,
        weight_version=weight_version,
        **figures,
        **rollout_signals(rollouts),
    )


def serve_metrics(
    metrics: TrainerMetrics, settings: MetricsSettings, *, in_pod: bool, log: Callable[[str], None]
) -> int | None:
    """Rank 0's ``/metrics`` (``trainer.metrics``); the port it serves on, None when off."""
    if not settings.enabled:
        return None
    addr = settings.addr or ("0.0.0.0" if in_pod else "127.0.0.1")  # Prometheus scrapes the pod IP
    try:
        port = metrics.serve(settings.port, addr)
    except OSError as err:
        # A busy port must not stop training (say, a second run on one machine): any free port.
        port = metrics.serve(0, addr)
        log(f"metrics: port {settings.port} unavailable ({err.strerror}); serving on port {port}")
    log(f"metrics: http://{addr}:{port}/metrics")
    return port


def record_figures(rec: StepRecord) -> dict[str, float]:
    """Every figure of one step as a flat mapping (what every sink writes); a figure the step
    did not measure (KL without a reference model, eval reward off evaluation steps) is absent."""
    lengths = rec.response_lengths
    figures: dict[str, float] = {
        "reward": rec.reward,
        "loss": rec.loss,
        "grad_norm": rec.grad_norm,
        "tree_token_ratio": rec.tree_token_ratio,
        "tokens": rec.original_tokens,
        "train_tokens_per_second": rec.train_tokens_per_second,
        "seconds": rec.seconds,
        "rollout_seconds": rec.rollout_seconds,
        "train_seconds": rec.train_seconds,
        "samples": len(lengths),
        "groups": rec.groups,
        "zero_signal_groups": rec.zero_signal_groups,
        "dropped_groups": rec.dropped_filtered,
    }
    if lengths:
        figures["response_length_mean"] = sum(lengths) / len(lengths)
        figures["response_length_max"] = max(lengths)
    for name, value in rec.stats.items():
        figures[STAT_NAMES.get(name, name)] = value
    return figures


class Sink(Protocol):
    def write(self, step: int, figures: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlStepLog:
    """``steps.jsonl``: one JSON object per step (``step``, ``time`` in Unix seconds, then the
    figures; a non-finite number is written as null), flushed at once, so a crash loses at most
    the step in progress."""

    def __init__(self, path: Path, *, start: int, log: Callable[[str], None]) -> None:
        self.path = path
        dropped = drop_after(path, start)
        if dropped:
            log(f"{path}: dropped {dropped} line(s) after step {start}, which this run trains again")
        self._file = path.open("a", encoding="utf-8")

    def write(self, step: int, figures: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else None) for k, v in figures.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def drop_after(path: Path, step: int) -> int:
    """Keep the lines of ``path`` for steps up to ``step`` (and none that does not parse, such
    as one torn by a crash); returns how many went. The file is replaced in one rename."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            line_step = json.loads(line)["step"]
            ok = isinstance(line_step, int) and line_step <= step
        except (ValueError, TypeError, KeyError):
            ok = False
        if ok:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class TensorBoardSink:
    """Scalars under their figure names, through torch's SummaryWriter. A resumed run purges
    the events of the steps it trains again (TensorBoard's purge_step)."""

    def __init__(self, logdir: str, *, start: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboardDir", "unset tensorboardDir") from None
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(logdir, purge_step=start + 1 if start > 0 else None)

    def write(self, step: int, figures: dict[str, float]) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a step takes seconds at least: nothing lost to a crash

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per trainer process (a resumed run is a new W&B run that starts at its step),
    written offline under ``dir`` (synced later with ``wandb sync``) or sent online. No console
    capture, no system-stats sampling: the trainer's output and CPU stay its own."""

    def __init__(self, project: str, mode: WandbMode, directory: Path, *, start: int) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "remove trainer.metrics.wandb") from None
        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True)
        try:
            self.run = wandb.init(
                project=project, mode=mode, dir=str(directory), config={"start_step": start}, settings=settings
            )
        except Exception as err:  # the client's own errors (no login, no network online) vary by version
            raise SinkUnavailableError(
                f"trainer.metrics.wandb: W&B could not start a run in mode {mode} ({err}); "
                "fix: log in (`wandb login`) for online, or use mode: offline"
            ) from None

    def write(self, step: int, figures: dict[str, float]) -> None:
        self.run.log(dict(figures), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service process has written the run's last records;
        # teardown waits for it (the trainer has no other W&B run).
        wandb.teardown()


class StepSinks:
    """The sinks ``trainer.metrics`` asks for, opened together (rank 0 only)."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    @classmethod
    def open(
        cls,
        settings: MetricsSettings,
        checkpoint_dir: str | None,
        *,
        start: int = 0,
        log: Callable[[str], None] = print,
    ) -> StepSinks:
        """``start``: the step the run resumed from (0: a fresh run). The step log needs
        ``checkpoint.dir``; without it there is none (nothing else of the run is kept either)."""
        sinks: list[Sink] = []
        try:
            if settings.tensorboard_dir:
                sinks.append(TensorBoardSink(settings.tensorboard_dir, start=start))
            if settings.wandb is not None:
                w = settings.wandb
                where = Path(w.dir or checkpoint_dir or ".")
                sinks.append(WandbSink(w.project, w.mode, where, start=start))
            if settings.step_log and checkpoint_dir:
                root = Path(checkpoint_dir)
                root.mkdir(parents=True, exist_ok=True)
                sinks.append(JsonlStepLog(root / STEP_LOG_FILE, start=start, log=log))
        except BaseException:
            cls(sinks).close()
            raise
        return cls(sinks)

    def write(self, step: int, figures: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, figures)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
