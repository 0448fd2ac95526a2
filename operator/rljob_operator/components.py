"""The components of an RLJob: every engine's backend string, parsed once into a
:class:`treetrain.alloc.Allocation`, and the pods its GPUs take. Everything after admission
reads the parsed allocation, never the string."""

from __future__ import annotations

from dataclasses import dataclass

from rljob_operator.errors import FieldError
from rljob_operator.models import RESERVED_ENGINE_NAMES
from rljob_operator.spec_reader import Engines
from rljob_operator.status_api import ComponentStatus
from treetrain.alloc import Allocation, AllocationError, PodPlan, parse, plan_pods
from treetrain.alloc.registry import prefixes


@dataclass(frozen=True)
class Component:
    """One engine of the RLJob and where its GPUs go."""

    name: str  # "rollout", "rollout-small", "actor", "critic", "ref"
    role: str  # the treetrain.dev/component label: rollout, actor, critic or ref
    allocation: Allocation
    pods: PodPlan
    colocated_with: str | None = None  # critic/ref inside the actor's trainer pods

    @property
    def gpus(self) -> int:
        return 0 if self.colocated_with else self.pods.gpus

    def status(self) -> ComponentStatus:
        d = self.allocation.dims
        return ComponentStatus(
            backend=str(self.allocation),
            kind=self.allocation.kind,
            dp=d.dp,
            tp=d.tp,
            pp=d.pp,
            cp=d.cp,
            ep=d.ep,
            etp=d.etp,
            world_size=self.allocation.world_size,
            gpus=self.gpus,
            pods=0 if self.colocated_with else self.pods.pods,
            gpus_per_pod=self.pods.gpus_per_pod,
            nodes=0 if self.colocated_with else self.pods.nodes,
            colocated_with=self.colocated_with,
        )


def build_components(engines: Engines) -> tuple[dict[str, Component], list[FieldError]]:
    """Each engine of ``engines`` as a Component (its backend parsed here, once), and the problems found."""
    errors: list[FieldError] = []
    components: dict[str, Component] = {}

    def add(name: str, role: str, path: str, backend: str, kind: str, colocated_with: str | None = None) -> None:
        try:
            allocation = parse(backend)
        except AllocationError as err:
            errors.append(FieldError(path, str(err)))
            return
        if allocation.kind != kind:
            want = prefixes("inference" if kind == "inference" else "training")
            errors.append(FieldError(path, f"{backend!r} is a {allocation.kind} backend; {role} needs {want}"))
            return
        try:
            pods = plan_pods(allocation, engines.gpus_per_node)
        except AllocationError as err:
            errors.append(FieldError(path, f"{err} (gpusPerNode is {engines.gpus_per_node})"))
            return
        components[name] = Component(name, role, allocation, pods, colocated_with)

    for name, path, backend in engines.rollouts:
        if name.startswith("rollout-") and name.removeprefix("rollout-") in RESERVED_ENGINE_NAMES:
            errors.append(
                FieldError(
                    path.replace(".backend", ".name"),
                    f"engine name {name.removeprefix('rollout-')!r} is reserved (child names would collide "
                    f"with another RLJob's); pick a name other than {', '.join(RESERVED_ENGINE_NAMES)}",
                )
            )
            continue
        if name in components:
            errors.append(FieldError(path.replace(".backend", ".name"), f"engine name {name!r} is used twice"))
            continue
        add(name, "rollout", path, backend, "inference")
    if engines.actor is not None:
        add("actor", "actor", "spec.actor.backend", engines.actor, "training")
    for role, aux_backend, colocated in engines.aux:
        if not colocated:
            # The trainer runs critic and ref inside the actor's gang only (for now).
            errors.append(
                FieldError(
                    f"spec.{role}.colocated",
                    f"a {role} in its own pods is not supported yet; remove colocated: false "
                    f"(the {role} then runs in the actor's trainer pods, with the actor's world size)",
                )
            )
            continue
        if not aux_backend and engines.actor is None:
            continue
        add(
            role,
            role,
            f"spec.{role}.backend",
            aux_backend or engines.actor or "",
            "training",
            "actor" if colocated else None,
        )
        actor, mine = components.get("actor"), components.get(role)
        if colocated and actor and mine and mine.allocation.world_size != actor.allocation.world_size:
            errors.append(
                FieldError(
                    f"spec.{role}.backend",
                    f"a colocated {role} runs in the actor's trainer pods, so its world size must equal the "
                    f"actor's ({mine.allocation.world_size} != {actor.allocation.world_size}); use the same world "
                    f"size, or leave backend empty (the actor's)",
                )
            )
    return components, errors
