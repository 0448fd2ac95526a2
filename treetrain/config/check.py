"""Rules that span config sections: engine support, colocation, algorithm and roles, the
micro-batch alignment, the task. Each check reads the sections it needs and is skipped
when one of them failed schema validation (its problems are already reported), so one run
still lists every problem it can find.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from treetrain.alloc import Allocation, AllocationError, registry
from treetrain.config import catalog
from treetrain.config.algorithms import objective
from treetrain.config.backends import check_training_backend
from treetrain.config.errors import EngineConfigError
from treetrain.config.lora import lora_problems
from treetrain.config.schema import (
    BUILTIN_REWARDS,
    IMPORT_STRING_FORM,
    ActorSettings,
    CheckpointSettings,
    ModelSettings,
    RoleSettings,
    RolloutServers,
    TrainerSettings,
)
from treetrain.config.tasks import BUILTIN_TASKS
from treetrain.tree.pack import capacity_problem

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


def problems(s: Sections) -> list[Problem]:
    found: list[Problem] = []
    for check in CHECKS:
        found += check(s)
    return found


def _allocation(path: str, backend: str) -> Allocation | Problem:
    try:
        return check_training_backend(backend)
    except (AllocationError, EngineConfigError) as err:
        return (path, str(err))


def _actor_allocation(s: Sections) -> Allocation | None:
    found = _allocation("actor.backend", s.actor.backend) if s.fine("actor.backend") else None
    return found if isinstance(found, Allocation) else None


def check_model(s: Sections) -> list[Problem]:
    if s.model is None or not s.fine("model.path"):
        return []
    try:
        catalog.check_path(s.model.path)
    except EngineConfigError as err:
        return [("model.path", str(err))]
    return []


def check_actor(s: Sections) -> list[Problem]:
    if not s.fine("actor.backend"):
        return []
    found = _allocation("actor.backend", s.actor.backend)
    if not isinstance(found, Allocation):
        return [found]
    if not s.fine("actor.treeTraining"):
        return []
    tree = s.actor.tree_training
    names = ("blockSize", "t*c" if found.dims.cp > 1 else "t")
    why = capacity_problem(tree.max_tokens_per_mb, tree.block_size, found.alignment, names=names)
    return [("actor.treeTraining.maxTokensPerMicrobatch", f"{tree.max_tokens_per_mb} {why}")] if why else []


def check_lora(s: Sections) -> list[Problem]:
    if s.actor.lora is None or not s.fine("actor.lora"):
        return []
    return lora_problems(s.actor.lora, _actor_allocation(s))


def check_roles(s: Sections) -> list[Problem]:
    found: list[Problem] = []
    actor = _actor_allocation(s)
    for role in ("critic", "ref"):
        settings: RoleSettings | None = getattr(s, role)
        if settings is None or not s.fine(role):
            continue
        if not settings.colocated:
            found.append(
                (
                    f"{role}.colocated",
                    f"false is not supported yet; the {role} runs in the actor's processes "
                    "(leave its backend empty or give it the actor's world size)",
                )
            )
            continue
        if not settings.backend:
            continue
        mine = _allocation(f"{role}.backend", settings.backend)
        if not isinstance(mine, Allocation):
            found.append(mine)
        elif actor is not None and mine.world_size != actor.world_size:
            found.append(
                (
                    f"{role}.backend",
                    f"a colocated {role} runs in the actor's processes, so its world size must be the actor's "
                    f"({mine.world_size} != {actor.world_size}); use the same world size or leave backend empty",
                )
            )
    return found


def check_algorithm(s: Sections) -> list[Problem]:
    t = s.trainer
    keys = ("trainer.algorithm", "trainer.advantage", "trainer.normalizeAdvantages", "trainer.dynamicSampling")
    if not s.fine(*keys, "trainer.overlong", "trainer.loss", "trainer.groupSize"):
        return []
    obj = objective(t)
    found: list[Problem] = []
    has_critic = "critic" in s.present
    where = "trainer.advantage" if t.advantage is not None else "trainer.algorithm"
    if obj.advantage == "critic" and not has_critic:
        found.append(
            (where, f"{t.advantage or t.algorithm} needs a critic: add `critic: {{}}` (colocated with the actor)")
        )
    if obj.advantage != "critic" and has_critic:
        found.append(
            (
                "critic",
                f"{t.algorithm} ({obj.advantage} advantages) uses no critic; set trainer.algorithm: ppo or remove critic",
            )
        )
    if t.loss.kl_coef > 0 and "ref" not in s.present:
        found.append(("trainer.loss.klCoef", "> 0 needs a reference model: add `ref: {}`"))
    if t.group_size < 2 and (obj.advantage == "rloo" or obj.dynamic_sampling):
        what = (
            "rloo advantages compare each sample with the others of its group"
            if obj.advantage == "rloo"
            else ("dynamic sampling keeps groups whose rewards differ")
        )
        found.append(("trainer.groupSize", f"1 is too small: {what}; set groupSize 2 or more"))
    if t.loss.aggregation_length is not None and obj.aggregation != "constant-length":
        found.append(
            (
                "trainer.loss.aggregationLength",
                f"applies to constant-length aggregation only (this run's is {obj.aggregation}); remove it or set "
                "trainer.loss.aggregation: constant-length",
            )
        )
    actor = _actor_allocation(s)
    if obj.per_sample and actor is not None and actor.dims.cp > 1:
        what = "ratioLevel: sequence" if obj.ratio_level == "sequence" else f"behavWeightMode: {obj.behav_weight_mode}"
        found.append(
            (
                "trainer.loss.ratioLevel" if obj.ratio_level == "sequence" else "trainer.loss.behavWeightMode",
                f"{what} reduces over each sample's tokens, which context parallelism (c{actor.dims.cp} in "
                f"{s.actor.backend}) splits across ranks; use a backend without c, or a token-level option",
            )
        )
    return found


def check_rollout(s: Sections) -> list[Problem]:
    if not s.fine("trainer.rollout", "rollout", "checkpoint.dir"):
        return []
    kind = s.trainer.rollout.kind
    if kind == "local" and s.rollout.servers:
        servers = registry.either(("auto", *registry.names("inference")))
        return [("trainer.rollout.kind", f"local rollout ignores rollout.servers; use {servers}")]
    remote = kind in registry.names("inference") or (kind == "auto" and bool(s.rollout.servers))
    if kind in registry.names("inference") and not s.rollout.servers:
        return [("rollout.servers", f"trainer.rollout.kind {kind} needs servers: add rollout.servers: [{{url: ...}}]")]
    if remote and s.rollout.weight_sync.method == "disk" and not s.checkpoint.dir:
        return [
            (
                "checkpoint.dir",
                "disk weight sync saves the weights in a directory the servers also mount; set it, "
                "or use rollout.weightSync.method: distributed",
            )
        ]
    return []


def check_staleness(s: Sections) -> list[Problem]:
    """Asynchronous rollout samples on servers while the trainer trains; local rollout samples
    with the trainer's own model, so it has nothing to overlap and takes only 0."""
    if not s.fine("trainer.rollout", "rollout"):
        return []
    r = s.trainer.rollout
    local = r.kind == "local" or (r.kind == "auto" and not s.rollout.servers)
    if local and r.max_staleness:
        return [
            (
                "trainer.rollout.maxStaleness",
                f"{r.max_staleness} needs rollout servers (local rollout samples with the trainer's own model, so "
                "rollout cannot overlap training); fix: set it to 0, or add rollout.servers",
            )
        ]
    return []


def check_task(s: Sections) -> list[Problem]:
    t = s.trainer
    if not s.fine("trainer.task", "trainer.taskArgs"):
        return []
    spec = t.task
    if not spec.startswith("builtin:"):
        module, sep, attr = spec.partition(":")
        if not (sep and module and attr):
            return [("trainer.task", f"{spec!r} must be builtin:NAME or package.module:function")]
        return []  # a user module: imported in the trainer, which has the user's image
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_TASKS:
        known = ", ".join("builtin:" + n for n in BUILTIN_TASKS)
        return [("trainer.task", f"unknown built-in task {spec!r}; built-in: {known}")]
    task = BUILTIN_TASKS[name]
    found: list[Problem] = []
    for key in t.task_args:
        snake = "".join("_" + c.lower() if c.isupper() else c for c in key)
        if snake not in task.args:
            valid = sorted(_camel(p) for p in task.args)
            found.append((f"trainer.taskArgs.{key}", f"{spec} takes no argument {key!r}; valid: {', '.join(valid)}"))
    found += _task_arg_types(spec, task.args, t.task_args)
    needs_text = task.needs_tokenizer
    if needs_text and s.model is not None and s.fine("model.path") and catalog.random_config(s.model.path) is not None:
        found.append(
            (
                "trainer.task",
                f"{spec} works on text and needs a model with a tokenizer (e.g. model.path: builtin:smollm2-135m); "
                f"{s.model.path} has none: use builtin:parity with it",
            )
        )
    return found


def _task_arg_types(spec: str, hints: Mapping[str, Any], args: dict[str, Any]) -> list[Problem]:
    """A built-in task's arguments have the types its signature says (``turns: "2"`` would pass
    here and fail in the trainer, once the pods are up): ints are ints (not bools), floats take
    ints too, strings are strings, tuples of ints are lists of ints."""
    found: list[Problem] = []
    for key, value in args.items():
        snake = "".join("_" + c.lower() if c.isupper() else c for c in key)
        want = hints.get(snake)
        if want is None or _has_type(want, value):
            continue
        words = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        what = words.get(want, "a list of integers" if typing.get_origin(want) is tuple else str(want))
        found.append((f"trainer.taskArgs.{key}", f"{spec} takes {what} for {key}, got {value!r}"))
    return found


def _has_type(want: Any, value: Any) -> bool:
    if want is bool:
        return isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if want is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if want is str:
        return isinstance(value, str)
    if typing.get_origin(want) is tuple:
        (item, *_) = typing.get_args(want) or (Any,)
        return isinstance(value, list | tuple) and all(item is Any or _has_type(item, v) for v in value)
    return True  # Any, a tokenizer, ...: the task checks it


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def import_string_problem(spec: str) -> str | None:
    """Why ``spec`` is not of the form package.module:function (None: it is). Only the form:
    the module is imported by the trainer, whose image has the user's code."""
    module, sep, attr = spec.partition(":")
    parts = module.split(".")
    if sep and attr.isidentifier() and all(p.isidentifier() for p in parts):
        return None
    return f"{spec!r} must be of the form {IMPORT_STRING_FORM}"


def check_data(s: Sections) -> list[Problem]:
    """A dataset run: an agent, or a reward scoring one reply per row; never with a task of its own."""
    keys = ("trainer.agent", "trainer.dataset", "trainer.reward", "trainer.eval")
    if not s.fine(*keys):
        return []
    t = s.trainer
    found: list[Problem] = []
    if t.agent is not None:
        why = import_string_problem(t.agent)
        if why:
            found.append(("trainer.agent", f"{why}: an async function run(client, row)"))
        if t.dataset is None:
            found.append(
                ("trainer.agent", "needs trainer.dataset (the rows each agent run gets): add dataset: {path: FILE}")
            )
    if t.dataset is not None and t.agent is None and t.reward is None:
        found.append(
            (
                "trainer.reward",
                "a dataset run without an agent needs a reward to score each reply: set reward: builtin:math, "
                f"builtin:exact, builtin:regex or {IMPORT_STRING_FORM}",
            )
        )
    if t.reward is not None and t.dataset is None:
        found.append(
            (
                "trainer.reward",
                "scores replies against dataset rows, so it needs trainer.dataset: add dataset: {path: FILE}",
            )
        )
    if t.dataset is not None and s.fine("trainer.task") and "task" in t.model_fields_set:
        found.append(
            (
                "trainer.task",
                f"{t.task} and trainer.dataset both make the episodes; remove task (a dataset run has no task) or "
                "remove dataset",
            )
        )
    if t.dataset is not None and s.fine("trainer.taskArgs") and t.task_args:
        found.append(("trainer.taskArgs", "applies to trainer.task only, and a dataset run has no task; remove it"))
    if t.eval is not None and t.agent is None and t.reward is None:
        found.append(("trainer.eval", "scores replies, so it needs trainer.agent or trainer.reward; set one"))
    return found


def check_reward(s: Sections) -> list[Problem]:
    if not s.fine("trainer.reward", "trainer.rewardArgs"):
        return []
    spec, args = s.trainer.reward, s.trainer.reward_args
    if spec is None:
        return [("trainer.rewardArgs", "set without trainer.reward; remove it or set reward")] if args else []
    if not spec.startswith("builtin:"):
        why = import_string_problem(spec)
        return [("trainer.reward", f"{why}, or one of {', '.join(BUILTIN_REWARDS)}")] if why else []
    if spec not in BUILTIN_REWARDS:
        return [("trainer.reward", f"unknown built-in reward {spec!r}; built-in: {', '.join(BUILTIN_REWARDS)}")]
    takes = ("pattern",) if spec == "builtin:regex" else ()
    found: list[Problem] = [
        (
            f"trainer.rewardArgs.{key}",
            f"{spec} takes no argument {key!r}; " + (f"valid: {', '.join(takes)}" if takes else "remove it"),
        )
        for key in args
        if key not in takes
    ]
    if spec == "builtin:regex":
        pattern = args.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            found.append(("trainer.rewardArgs.pattern", "builtin:regex needs rewardArgs.pattern: a regular expression"))
        else:
            try:
                re.compile(pattern)
            except re.error as err:
                found.append(("trainer.rewardArgs.pattern", f"{pattern!r} is not a valid regular expression: {err}"))
    return found


def check_reply_length(s: Sections) -> list[Problem]:
    """Dataset prompts and agent calls reply up to maxNewTokens within one conversation of at
    most maxEpisodeTokens. Only judged where it applies (or was set): a task run has its own."""
    if not s.fine("trainer.maxNewTokens", "trainer.maxEpisodeTokens", "trainer.agent", "trainer.dataset"):
        return []
    t = s.trainer
    applies = t.agent is not None or t.dataset is not None or "max_new_tokens" in t.model_fields_set
    if applies and t.max_new_tokens > t.max_episode_tokens:
        return [
            (
                "trainer.maxNewTokens",
                f"{t.max_new_tokens} is more than trainer.maxEpisodeTokens ({t.max_episode_tokens}), so no reply "
                "fits in a conversation; lower maxNewTokens or raise maxEpisodeTokens",
            )
        ]
    return []


def check_text_model(s: Sections) -> list[Problem]:
    """Dataset prompts and agents speak text: the model needs a tokenizer and chat template."""
    if not s.fine("trainer.agent", "trainer.dataset") or s.model is None or not s.fine("model.path"):
        return []
    t = s.trainer
    if (t.agent is None and t.dataset is None) or catalog.random_config(s.model.path) is None:
        return []
    what = "trainer.agent" if t.agent is not None else "trainer.dataset"
    return [
        (
            what,
            f"works on text and needs a model with a tokenizer (e.g. model.path: builtin:smollm2-135m); "
            f"{s.model.path} has none",
        )
    ]


CHECKS: tuple[Callable[[Sections], list[Problem]], ...] = (
    check_model,
    check_actor,
    check_lora,
    check_roles,
    check_algorithm,
    check_rollout,
    check_staleness,
    check_task,
    check_data,
    check_reward,
    check_reply_length,
    check_text_model,
)
