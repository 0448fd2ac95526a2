"""What an RLJob's children say, read from the API server's copies (plain dicts): which are its
own, which trainer gang is current, whether it failed or completed, what its Jobs run and what
a spec change asks of them, and why pods wait."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rljob_operator.conditions import whole_seconds
from rljob_operator.names import ANNOTATION_ALLOCATION, ANNOTATION_TEMPLATE_HASH, LABEL_COMPONENT, LABEL_RESTART
from rljob_operator.plan import Plan
from rljob_operator.record import Memory, annotations_of
from rljob_operator.status_api import ComponentStatus

TRAINER_ROLES = ("actor", "critic", "ref")


@dataclass
class Observed:
    """Children of one RLJob as the API server has them (plain dicts)."""

    jobs: list[dict[str, Any]] = field(default_factory=list)
    statefulsets: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    configmaps: list[dict[str, Any]] = field(default_factory=list)
    # The smallest nvidia.com/gpu.memory label (MiB) of the nodes the pods can land on
    # (gpu_memory.smallest_node_gpu_mib), for the memory check when spec.gpuMemoryGiB is unset.
    node_gpu_mib: int | None = None


def controlled_by(obj: dict[str, Any], uid: str | None) -> bool:
    """Whether ``obj``'s controller ownerReference names the object with ``uid``."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return bool(uid) and any(r.get("controller") and r.get("uid") == uid for r in refs)


def owned(rljob: dict[str, Any], observed: Observed) -> Observed:
    """The children this RLJob controls: labels alone make nothing a child (anyone can set them).
    Pods are owned by the Jobs and StatefulSets, so they are kept as listed."""
    uid = (rljob.get("metadata") or {}).get("uid")

    def mine(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [o for o in objects if controlled_by(o, uid)]

    return Observed(
        jobs=mine(observed.jobs),
        statefulsets=mine(observed.statefulsets),
        pods=observed.pods,
        services=mine(observed.services),
        configmaps=mine(observed.configmaps),
        node_gpu_mib=observed.node_gpu_mib,
    )


def restart_of(obj: dict[str, Any]) -> int | None:
    try:
        return int(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_RESTART, ""))
    except ValueError:
        return None


def gang_restarts(memory: Memory, observed: Observed) -> int:
    """The trainer gang's restart count, from the world: the newest gang whose Jobs exist and
    have not failed; with none, the recorded count or the newest failed gang's, whichever is newer."""
    gangs: dict[int, bool] = {}  # restart -> healthy
    for job in observed.jobs:
        n = restart_of(job)
        if component_of(job) not in TRAINER_ROLES or n is None:
            continue
        ok = not (job.get("metadata") or {}).get("deletionTimestamp") and job_condition(job, "Failed") is None
        gangs[n] = gangs.get(n, True) and ok
    for pod in observed.pods:
        n = restart_of(pod)
        if n in gangs and component_of(pod) in TRAINER_ROLES and (pod.get("status") or {}).get("phase") == "Failed":
            gangs[n] = False
    healthy = [n for n, ok in gangs.items() if ok]
    if healthy:
        return max(healthy)
    return max([memory.restarts, *gangs])


def component_of(obj: dict[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPONENT, ""))


def job_condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    if job is None:
        return None
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def job_complete(job: dict[str, Any] | None) -> bool:
    return job_condition(job, "Complete") is not None


def trainer_failure(
    trainers: dict[str, dict[str, Any]], current: dict[str, str], pods: list[dict[str, Any]], restarts: int
) -> str | None:
    """Why the current trainer gang failed, or None."""
    for role, name in current.items():
        failed = job_condition(trainers.get(name), "Failed")
        if failed:
            return f"{role} Job {name}: {failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_COMPONENT) not in TRAINER_ROLES or labels.get(LABEL_RESTART) != str(restarts):
            continue
        if (pod.get("status") or {}).get("phase") == "Failed":
            return f"pod {pod['metadata']['name']} failed: {pod_reason(pod)}"
    return None


def pod_reason(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"container {cs.get('name')} exited with {term.get('exitCode')} ({term.get('reason', 'Error')})"
    return str(status.get("reason") or status.get("message") or "Failed")


def completion_time(trainers: dict[str, dict[str, Any]], current: dict[str, str]) -> str | None:
    """When the last of the current trainer Jobs completed, as the Job controller recorded it."""
    times = [(trainers.get(name) or {}).get("status", {}).get("completionTime") for name in current.values()]
    known = [t for t in (whole_seconds(t) for t in times) if t]
    return max(known) if known and len(known) == len(times) else None


def running_allocation(trainers: dict[str, dict[str, Any]], current: dict[str, str]) -> dict[str, Any]:
    """The allocation of the components in the current trainer Jobs, as each Job was created
    (empty for Jobs without the annotation: created by an older operator)."""
    found: dict[str, Any] = {}
    for name in current.values():
        found.update(allocation_note(trainers.get(name)))
    return found


def allocation_note(job: dict[str, Any] | None) -> dict[str, Any]:
    """A Job's allocation annotation; one that is missing or was edited into nonsense counts as absent."""
    try:
        note = json.loads(annotations_of(job).get(ANNOTATION_ALLOCATION) or "{}")
        return {c: ComponentStatus.model_validate(a).model_dump(by_alias=True, exclude_none=True)
                for c, a in note.items()}  # fmt: skip
    except (ValueError, AttributeError):  # pydantic's ValidationError is a ValueError
        return {}


def pending_changes(desired: Plan, trainers: dict[str, dict[str, Any]]) -> list[str]:
    """What the spec asks of the running trainer Jobs that their pods do not have."""
    changes: list[str] = []
    for obj in desired.objects:
        running = trainers.get(obj["metadata"]["name"]) if obj["kind"] == "Job" else None
        have = annotations_of(running)
        want = annotations_of(obj)
        if ANNOTATION_TEMPLATE_HASH not in have or have[ANNOTATION_TEMPLATE_HASH] == want[ANNOTATION_TEMPLATE_HASH]:
            continue
        old, new = allocation_note(running), allocation_note(obj)
        moved = [
            f"{c} {_backend(old.get(c))} -> {_backend(new.get(c))} ({_gpus(old.get(c))} -> {_gpus(new.get(c))} GPUs)"
            for c in sorted(old.keys() | new.keys())
            if (old.get(c) or {}).get("backend") != (new.get(c) or {}).get("backend")
        ]
        changes += moved or [f"Job {obj['metadata']['name']}: its pod template or trainer config"]
    return changes


def pending_message(changes: list[str]) -> str:
    return (
        f"not applied while the trainer runs: {'; '.join(changes)}. It applies when the trainer gang next starts "
        "(after a restart, or now: suspend and resume the RLJob); until then the status shows what runs"
    )


def _backend(allocation: dict[str, Any] | None) -> str:
    return str(allocation["backend"]) if allocation else "(none)"


def _gpus(allocation: dict[str, Any] | None) -> int:
    return int(allocation["gpus"]) if allocation else 0


def is_current(pod: dict[str, Any], restarts: int) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    if labels.get(LABEL_COMPONENT) in TRAINER_ROLES:
        return labels.get(LABEL_RESTART) == str(restarts)
    return True


def unschedulable_reason(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "Unschedulable")
    return None


def gpus_asked(pod: dict[str, Any], resource: str) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        total += int(limits.get(resource, 0))
    return total
