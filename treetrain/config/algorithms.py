"""Algorithm presets: ``trainer.algorithm`` picks defaults for the finer options of the one
advantage and loss code; an option the config sets explicitly wins. :func:`objective` resolves
them once, and make_batch, the loss and the rollout collector read the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.config.trainer_settings import (
    AdvantageKind,
    Aggregation,
    Algorithm,
    BehavWeightMode,
    OverlongSettings,
    RatioLevel,
    TrainerSettings,
)


@dataclass(frozen=True, slots=True)
class Preset:
    advantage: AdvantageKind
    normalize_advantages: bool
    aggregation: Aggregation = "token-mean"
    ratio_level: RatioLevel = "token"
    dynamic_sampling: bool = False
    overlong: bool = False
    clip_eps_high: float | None = None


# One row per algorithm (docs/trainer.md has the same table in words).
PRESETS: dict[Algorithm, Preset] = {
    "grpo": Preset("group", True),
    "ppo": Preset("critic", False),
    "rloo": Preset("rloo", False),
    "reinforce++": Preset("reinforce++-baseline", True),
    "dr-grpo": Preset("group", False, aggregation="constant-length"),
    "dapo": Preset("group", True, dynamic_sampling=True, overlong=True, clip_eps_high=0.28),
    "gspo": Preset("group", True, aggregation="sequence-mean", ratio_level="sequence"),
}


@dataclass(frozen=True, slots=True)
class Objective:
    """The resolved options of one run's objective (no unset values left, except
    ``aggregation_length`` and the overlong buffer, which default to the task's maxNewTokens
    and a fifth of it once the task is known)."""

    algorithm: Algorithm
    advantage: AdvantageKind
    normalize_advantages: bool
    dynamic_sampling: bool
    overlong: OverlongSettings | None  # None: no overlong penalty
    ratio_level: RatioLevel
    aggregation: Aggregation
    aggregation_length: int | None
    behav_weight_mode: BehavWeightMode
    clip_eps_high: float | None  # None: clipEps

    @property
    def per_sample(self) -> bool:
        """The loss reduces over each sample's tokens (a sequence ratio or sequence weight)."""
        return self.ratio_level == "sequence" or self.behav_weight_mode.startswith("sequence")

    def overlong_buffer(self, max_new_tokens: int) -> int:
        assert self.overlong is not None
        return self.overlong.buffer_tokens or max(1, max_new_tokens // 5)

    def aggregation_tokens(self, max_new_tokens: int) -> int:
        return self.aggregation_length or max_new_tokens


def objective(t: TrainerSettings) -> Objective:
    """``t``'s options with the algorithm's preset filling every one left unset."""
    p = PRESETS[t.algorithm]
    loss = t.loss
    overlong = t.overlong if t.overlong is not None else (OverlongSettings() if p.overlong else None)
    if overlong is not None and overlong.penalty == 0:
        overlong = None
    return Objective(
        algorithm=t.algorithm,
        advantage=t.advantage or p.advantage,
        normalize_advantages=p.normalize_advantages if t.normalize_advantages is None else t.normalize_advantages,
        dynamic_sampling=p.dynamic_sampling if t.dynamic_sampling is None else t.dynamic_sampling,
        overlong=overlong,
        ratio_level=loss.ratio_level or p.ratio_level,
        aggregation=loss.aggregation or p.aggregation,
        aggregation_length=loss.aggregation_length,
        behav_weight_mode=loss.behav_weight_mode,
        clip_eps_high=loss.clip_eps_high if loss.clip_eps_high is not None else p.clip_eps_high,
    )
