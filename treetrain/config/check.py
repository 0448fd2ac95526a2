"""Rules that span config sections: engine support, colocation, algorithm and roles, the
micro-batch alignment, asynchronous rollout; what makes the episodes (task, dataset, agent,
reward) is checked in :mod:`treetrain.config.check_episodes`. Each check reads the sections it
needs (:class:`~treetrain.config.rules.Sections`) and is skipped when one of them failed schema
validation (its problems are already reported), so one run still lists every problem it can find.
"""

from __future__ import annotations

from collections.abc import Callable

from treetrain.alloc import Allocation, AllocationError, registry
from treetrain.config import catalog
from treetrain.config.algorithms import objective
from treetrain.config.backends import check_training_backend
from treetrain.config.check_episodes import (
    check_data,
    check_reply_length,
    check_reward,
    check_task,
    check_text_model,
)
from treetrain.config.errors import EngineConfigError
from treetrain.config.lora import lora_problems
from treetrain.config.rules import Problem, Sections
from treetrain.config.schema import RoleSettings
from treetrain.tree.pack import capacity_problem


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
