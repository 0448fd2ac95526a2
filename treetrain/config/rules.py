"""What every cross-section rule reads (:mod:`treetrain.config.check` and
:mod:`treetrain.config.check_episodes`): the sections as far as they passed schema
validation, and the problem a rule reports."""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.config.schema import ActorSettings, CheckpointSettings, ModelSettings, RoleSettings, RolloutServers
from treetrain.config.trainer_settings import TrainerSettings

Problem = tuple[str, str]  # (field path, message)


@dataclass(frozen=True, slots=True)
class Sections:
    """The config as far as it passed schema validation: a section with broken keys is kept
    with those keys at their defaults, and ``broken`` names them (``"actor.treeTraining"``),
    so a rule that reads one of them is skipped instead of judging a default."""

    model: ModelSettings | None
    actor: ActorSettings
    critic: RoleSettings | None
    ref: RoleSettings | None
    checkpoint: CheckpointSettings
    rollout: RolloutServers
    trainer: TrainerSettings
    present: frozenset[str]  # top-level keys the config has
    broken: frozenset[str] = frozenset()

    def fine(self, *paths: str) -> bool:
        """None of ``paths`` (or a section above them) failed validation."""
        for path in paths:
            parts = path.split(".")
            if any(".".join(parts[: i + 1]) in self.broken for i in range(len(parts))):
                return False
        return True
