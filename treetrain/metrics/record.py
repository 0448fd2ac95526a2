"""The one record of a training step: what the step line prints, the step log and the other sinks
write, and the Prometheus registry exports, all read from the same host numbers (synced once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _stat(name: str) -> Any:
    """A read-only figure of the record: ``stats[name]``, None when the step did not measure it."""

    def get(record: StepRecord) -> float | None:
        return record.stats.get(name)

    return property(get)


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One step (``step`` 1-based). ``stats`` holds the loss's statistics (entropy, kl,
    clip_fraction, ratio, ratio_max, behav_mismatch[_max], ...) and the step's extra figures
    (value_loss, eval_reward, staleness_max/mean, episodes_capped_*); a figure the step did not
    measure is absent, not 0."""

    step: int
    reward: float
    loss: float
    tree_token_ratio: float
    original_tokens: int
    seconds: float  # the whole step: rollout, training, weight sync, evaluation
    rollout_seconds: float = 0.0
    train_seconds: float = 0.0  # the training part only
    grad_norm: float = 0.0
    tree_tokens: int = 0
    padded_tokens: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    # Episodes the step's rollouts ended at trainer.maxTurns / before trainer.maxEpisodeTokens.
    capped_turns: int = 0
    capped_tokens: int = 0
    # Rollout: per trained sample, the step less the weight version its trajectory started from;
    # the rest are what happened since the previous step (counters) or now (gauges). Synchronous:
    # the trainer idles through the rollout, the rollout side through the rest of the step.
    staleness: tuple[int, ...] = ()
    buffer_groups: int = 0
    rollout_idle_seconds: float = 0.0
    trainer_idle_seconds: float = 0.0
    dropped_filtered: int = 0  # groups dynamic sampling dropped (all rewards equal)
    dropped_failed: int = 0  # groups whose generation failed on every server
    resubmitted: int = 0
    weight_version: int = 0
    # The step's replies and groups: each trained sample's reply tokens, the groups trained, and
    # those whose rewards were all equal (no learning signal).
    response_lengths: tuple[int, ...] = ()
    groups: int = 0
    zero_signal_groups: int = 0

    # Both count original (unpacked) tokens: what the step trained, however well it packed.
    @property
    def train_tokens_per_second(self) -> float:
        return self.original_tokens / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def step_tokens_per_second(self) -> float:
        return self.original_tokens / self.seconds if self.seconds > 0 else 0.0

    # |rollout engine's log-prob - trainer's recomputed log-prob| over the response tokens, and
    # the policy and its update per response token, read from the loss's statistics (None: not
    # measured this step; kl needs a reference model). The ratio is policy / proximal policy.
    mismatch_mean = _stat("behav_mismatch")
    mismatch_max = _stat("behav_mismatch_max")
    entropy = _stat("entropy")
    kl = _stat("kl")
    clip_fraction = _stat("clip_fraction")
    ratio_mean = _stat("ratio")
    ratio_max = _stat("ratio_max")


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One weight sync: what it sent (``payload``: ``adapter``, or ``full`` for full weights, the
    merged adapter's included), its wall time (export and every server's load), the bytes each
    server received, the weight version, and the adapter version the servers then listed (None
    without adapter sync)."""

    payload: str
    seconds: float
    bytes: int
    version: int
    adapter_version: int | None = None
