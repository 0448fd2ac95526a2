"""Level-based reconciliation of one RLJob, as a pure function.

``decide(rljob, observed, now)`` reads the RLJob and the children that exist, and
returns what to create or update, what to delete, the new status and the events to
post. The kopf handlers only gather ``observed``, carry out the decision and patch the
status when it changed.

Ownership: only children that this RLJob controls count, those whose controller
ownerReference carries the RLJob's uid (:func:`owned`). An object that merely carries the
operator's labels, or has the name of a child, is never deleted, updated or read as state.

Trainer restarts: the trainer gang of restart ``n`` is the Indexed Job
``NAME-trainer`` (n = 0) or ``NAME-trainer-rN``. When any of its pods fails, the
restart is recorded first, then the old Job is deleted and, after an exponential
backoff, the next one is created; the trainer resumes from the latest checkpoint.
After ``maxRestarts`` the RLJob fails.

The status is an output, never an input: anyone allowed to patch ``rljobs/status`` could
write ``phase: Succeeded`` (the rollout servers would be torn down) or ``restarts: 2`` (a
healthy trainer Job would be replaced). Each pass derives it from the world:

- the restart count is that of the newest trainer gang whose Jobs exist and have not
  failed (their ``treetrain.dev/restart`` label); with none (between a failure and the next
  gang, during the backoff), the count the operator recorded, or the newest failed gang's;
- what must outlive the Jobs is recorded in the ``treetrain.dev/state`` annotation of the
  ConfigMap ``NAME-config``, an owned child that only the operator writes (:class:`Memory`):
  the restart count and time (the backoff's clock), and once the RLJob finished, its phase,
  time (the TTL's clock) and message. A recorded restart count that a live, healthy gang
  contradicts loses to the gang. The record is written before the failed Job is deleted.

Deleting every child by hand forgets it all: the RLJob then starts over from restart 0.

Spec changes while the trainer runs: rollout servers, Services and the ConfigMap follow
the spec at once, a removed engine's servers are deleted. A Job's pod template is
immutable and a running trainer read its config at start, so a change to the trainer
(``fsdp:d8`` -> ``fsdp:d16``, its image, its config) waits for the next gang: the status
keeps reporting the running Job's allocation and ``SpecChangePending`` says what waits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from rljob_operator.components import Component
from rljob_operator.errors import PlanError
from rljob_operator.models import GROUP, MAX_TTL_SECONDS, ComponentStatus, RLJobStatus
from rljob_operator.names import (
    ANNOTATION_ALLOCATION,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_COMPONENT,
    LABEL_RESTART,
    trainer_job_name,
)
from rljob_operator.plan import Plan, plan
from rljob_operator.policy import Limits

BACKOFF_MAX_SECONDS = 300.0
# On the ConfigMap NAME-config: what the operator remembers across passes (see the module doc).
ANNOTATION_STATE = f"{GROUP}/state"
MAX_MEMORY_MESSAGE = 512
WORKLOAD_KINDS = ("Job", "StatefulSet")
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


@dataclass
class Decision:
    status: dict[str, Any]
    # Applied before anything is deleted: the ConfigMap carrying the operator's record (a restart,
    # a finish), so a pass that dies after deleting the failed Job still has the restart counted.
    remember: list[dict[str, Any]] = field(default_factory=list)
    apply: list[dict[str, Any]] = field(default_factory=list)
    create_only: list[dict[str, Any]] = field(default_factory=list)  # Jobs: their pod template is immutable
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    delete_self: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None


@dataclass(frozen=True)
class Memory:
    """What the operator recorded on its ConfigMap (:data:`ANNOTATION_STATE`)."""

    restarts: int = 0
    last_restart: str | None = None  # when the last restart was decided: the backoff's clock
    finished: str | None = None  # "Succeeded" or "Failed" once the RLJob finished
    finished_at: str | None = None  # the TTL's clock
    message: str = ""

    def annotation(self) -> str:
        body = {"restarts": self.restarts, "lastRestart": self.last_restart, "finished": self.finished,
                "finishedAt": self.finished_at, "message": self.message[:MAX_MEMORY_MESSAGE] or None}  # fmt: skip
        return json.dumps({k: v for k, v in body.items() if v is not None}, sort_keys=True, separators=(",", ":"))


def read_memory(configmap: dict[str, Any] | None) -> Memory:
    """The record on ``configmap``; one that is missing or unreadable counts as empty."""
    try:
        note = json.loads(_annotations(configmap).get(ANNOTATION_STATE) or "{}")
        restarts = int(note.get("restarts", 0))
        finished = note.get("finished")
        last, done = note.get("lastRestart"), note.get("finishedAt")
        parse_time(last), parse_time(done)  # a time that does not parse makes the whole record void
    except (ValueError, TypeError, AttributeError):
        return Memory()
    return Memory(
        restarts=max(restarts, 0),
        last_restart=last,
        finished=finished if finished in ("Succeeded", "Failed") else None,
        finished_at=done,
        message=str(note.get("message") or ""),
    )


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


def timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def backoff_seconds(attempts: int, base: float, cap: float = BACKOFF_MAX_SECONDS) -> float:
    """Delay before try ``attempts`` (1-based): base, 2*base, 4*base, ... capped (5 min by default)."""
    return float(min(base * 2.0 ** max(attempts - 1, 0), cap))


def set_condition(
    conditions: list[dict[str, Any]],
    kind: str,
    status: bool | None,
    reason: str,
    message: str,
    *,
    now: datetime,
    generation: int | None,
) -> None:
    """Set one condition in place; its transition time moves only when its status does."""
    value = "Unknown" if status is None else ("True" if status else "False")
    for cond in conditions:
        if cond["type"] == kind:
            if cond["status"] != value:
                cond["lastTransitionTime"] = timestamp(now)
            cond.update(status=value, reason=reason, message=message, observedGeneration=generation)
            return
    conditions.append(
        {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": timestamp(now),
            "observedGeneration": generation,
        }
    )


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def decide(rljob: dict[str, Any], observed: Observed, now: datetime, limits: Limits = Limits()) -> Decision:  # noqa: B008
    observed = owned(rljob, observed)
    old = RLJobStatus.model_validate(rljob.get("status") or {}).model_dump(by_alias=True, exclude_none=True)
    status: dict[str, Any] = {**old, "conditions": [dict(c) for c in old.get("conditions", [])]}
    generation = (rljob.get("metadata") or {}).get("generation")
    status["observedGeneration"] = generation
    cond = _Conditions(status, now, generation)
    spec = rljob.get("spec") or {}
    decision = Decision(status=status)
    config_name = f"{(rljob.get('metadata') or {}).get('name')}-config"
    memory = read_memory(next((c for c in observed.configmaps if c["metadata"]["name"] == config_name), None))

    # A finished RLJob stays finished (as recorded, whatever the status says); only its TTL and
    # rollout teardown remain.
    if memory.finished:
        status.update(phase=memory.finished, restarts=memory.restarts)
        _set_or_drop(status, "completionTime", memory.finished_at)
        _set_or_drop(status, "lastRestartTime", memory.last_restart)
        if old.get("phase") != memory.finished:
            status["message"] = memory.message or memory.finished.lower()
        _finish(decision, observed, now, spec)
        return _with_events(decision, old)

    restarts = _restarts(memory, observed)
    try:
        desired = plan(rljob, restart=restarts, limits=limits, node_gpu_mib=observed.node_gpu_mib)
    except PlanError as err:
        cond.set("Valid", False, "InvalidSpec", str(err))
        status.update(phase="Failed", message=f"invalid spec: {err}", allocation={}, gpus=0)
        cond.set("Running", False, "InvalidSpec", "no pods are created for an invalid spec")
        decision.delete = [(o["kind"], o["metadata"]["name"]) for o in (*observed.jobs, *observed.statefulsets)]
        return _with_events(decision, old)
    memory = replace(memory, restarts=restarts)
    status["restarts"] = restarts
    _set_or_drop(status, "lastRestartTime", memory.last_restart if restarts else None)
    status.pop("completionTime", None)

    # exclude_none: the API server drops nulls, so a null here would differ from what is stored
    # and cost a no-op status PATCH on every pass.
    status["allocation"] = {
        name: c.status().model_dump(by_alias=True, exclude_none=True) for name, c in desired.components.items()
    }
    status["gpus"] = desired.total_gpus
    cond.set("Valid", True, "Planned", _describe(desired))
    ckpt = desired.checkpoints()
    if ckpt["persistent"]:
        cond.set("CheckpointsEphemeral", False, "CheckpointVolume", f"checkpoints on claim {ckpt['claim']}")
    else:
        cond.set("CheckpointsEphemeral", True, "NoCheckpointVolume", ckpt["why"])
    if _invalid(old):
        status["phase"] = "Pending"  # a fixed spec starts over

    if desired.spec.suspend:
        decision.delete = [(o["kind"], o["metadata"]["name"]) for o in (*observed.jobs, *observed.statefulsets)]
        status.update(phase="Suspended", message="suspended: pods removed, the RLJob is kept")
        cond.set("Suspended", True, "Suspended", "spec.suspend is true")
        cond.set("SpecChangePending", False, "Suspended", "resuming starts the trainer from the current spec")
        cond.set("Running", False, "Suspended", "suspended")
        return _with_events(decision, old)
    cond.set("Suspended", False, "NotSuspended", "")

    trainers = {o["metadata"]["name"]: o for o in observed.jobs if _component(o) in TRAINER_ROLES}
    current = {c.role: trainer_job_name(desired.name, c.role, restarts) for c in _trainer_components(desired)}
    # The status describes what exists: a running trainer Job keeps its allocation until the next gang.
    status["allocation"].update(_running_allocation(trainers, current))
    status["gpus"] = sum(a["gpus"] for a in status["allocation"].values())
    pending = _pending_changes(desired, trainers)
    stale = [name for name in trainers if name not in current.values()]
    decision.delete += [("Job", name) for name in stale]
    # A rollout engine removed from the spec: its servers go (their GPUs are no longer counted),
    # and so does its headless Service.
    for kind, objects in (("StatefulSet", observed.statefulsets), ("Service", observed.services)):
        wanted = {o["metadata"]["name"] for o in desired.objects if o["kind"] == kind}
        decision.delete += [(kind, o["metadata"]["name"]) for o in objects if o["metadata"]["name"] not in wanted]

    # Trainer finished or failed?
    failure = _trainer_failure(trainers, current, observed.pods, restarts)
    if not failure and current and all(_job_complete(trainers.get(name)) for name in current.values()):
        done = _completion_time(trainers, current) or timestamp(now)
        status.update(phase="Succeeded", completionTime=done, message="trainer completed")
        cond.set("Succeeded", True, "TrainerCompleted", "the trainer Job completed")
        cond.set("Running", False, "Completed", "finished")
        cond.set("SpecChangePending", False, "Finished", "")
        decision.remember = _remembered(desired, replace(memory, finished="Succeeded", finished_at=done,
                                                         message=status["message"]))  # fmt: skip
        _finish(decision, observed, now, spec)
        return _with_events(decision, old)
    if failure:
        max_restarts = desired.spec.max_restarts
        if restarts >= max_restarts:
            status.update(
                phase="Failed",
                completionTime=timestamp(now),
                message=f"trainer failed after {restarts} restarts (maxRestarts {max_restarts}): {failure}",
            )
            cond.set("Failed", True, "TrainerFailed", status["message"])
            cond.set("Running", False, "Failed", "failed")
            cond.set("SpecChangePending", False, "Finished", "")
            decision.remember = _remembered(desired, replace(memory, finished="Failed", finished_at=timestamp(now),
                                                             message=status["message"]))  # fmt: skip
            _finish(decision, observed, now, spec)
            return _with_events(decision, old)
        status.update(restarts=restarts + 1, lastRestartTime=timestamp(now), phase="Pending")
        cond.set("Running", False, "Restarting", f"restart {restarts + 1} of {max_restarts}")
        status["message"] = (
            f"restarting the trainer gang ({restarts + 1}/{max_restarts}), {_resume(desired)}: {failure}"
        )
        cond.set("Restarting", True, "TrainerFailed", status["message"])
        cond.set("SpecChangePending", False, "Restarting", "the next trainer gang starts from the current spec")
        decision.remember = _remembered(desired, replace(memory, restarts=restarts + 1, last_restart=timestamp(now)))
        decision.delete += [("Job", name) for name in trainers if ("Job", name) not in decision.delete]
        decision.requeue_after = backoff_seconds(restarts + 1, desired.spec.restart_backoff_seconds)
        return _with_events(decision, old)

    # Create or update everything of the current gang at once (rollout servers and trainers).
    wait = _backoff_left(memory, now, desired.spec.restart_backoff_seconds)
    existing = {o["metadata"]["name"] for o in observed.jobs}
    for obj in _with_memory(desired.objects, memory):
        if obj["kind"] == "Job":
            # Read before create: a Job that exists is left alone (no POST answered 409 per pass).
            if wait > 0 or obj["metadata"]["name"] in stale or obj["metadata"]["name"] in existing:
                continue
            decision.create_only.append(obj)
        elif obj["kind"] == "Secret":
            decision.create_only.append(obj)  # the API key: random, created once, never rewritten
        else:
            decision.apply.append(obj)
    if pending:
        cond.set("SpecChangePending", True, "TrainerRunning", _pending_message(pending))
    else:
        cond.set("SpecChangePending", False, "UpToDate", "")
    if wait > 0:
        decision.requeue_after = wait
        status["message"] = f"restarting the trainer gang in {wait:.0f} s (backoff), {_resume(desired)}"

    _observe_pods(desired, observed, status, cond, restarts, now)
    return _with_events(decision, old)


def _set_or_drop(status: dict[str, Any], key: str, value: Any) -> None:
    if value is None:
        status.pop(key, None)
    else:
        status[key] = value


def _restart_of(obj: dict[str, Any]) -> int | None:
    try:
        return int(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_RESTART, ""))
    except ValueError:
        return None


def _restarts(memory: Memory, observed: Observed) -> int:
    """The trainer gang's restart count, from the world: the newest gang whose Jobs exist and
    have not failed; with none, the recorded count or the newest failed gang's, whichever is newer."""
    gangs: dict[int, bool] = {}  # restart -> healthy
    for job in observed.jobs:
        n = _restart_of(job)
        if _component(job) not in TRAINER_ROLES or n is None:
            continue
        ok = not (job.get("metadata") or {}).get("deletionTimestamp") and _job_condition(job, "Failed") is None
        gangs[n] = gangs.get(n, True) and ok
    for pod in observed.pods:
        n = _restart_of(pod)
        if n in gangs and _component(pod) in TRAINER_ROLES and (pod.get("status") or {}).get("phase") == "Failed":
            gangs[n] = False
    healthy = [n for n, ok in gangs.items() if ok]
    if healthy:
        return max(healthy)
    return max([memory.restarts, *gangs])


def _with_memory(objects: list[dict[str, Any]], memory: Memory) -> list[dict[str, Any]]:
    """``objects`` with the record on the trainer ConfigMap (every apply carries it, or server-side
    apply would drop it)."""
    out = []
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-config"):
            meta = obj["metadata"]
            obj = {**obj, "metadata": {**meta, "annotations": {**(meta.get("annotations") or {}),
                                                               ANNOTATION_STATE: memory.annotation()}}}  # fmt: skip
        out.append(obj)
    return out


def _remembered(desired: Plan, memory: Memory) -> list[dict[str, Any]]:
    return [o for o in _with_memory(desired.objects, memory) if ANNOTATION_STATE in _annotations(o)]


def _completion_time(trainers: dict[str, dict[str, Any]], current: dict[str, str]) -> str | None:
    """When the last of the current trainer Jobs completed, as the Job controller recorded it."""
    times = [(trainers.get(name) or {}).get("status", {}).get("completionTime") for name in current.values()]
    known = [t for t in (_whole_seconds(t) for t in times) if t]
    return max(known) if known and len(known) == len(times) else None


def _whole_seconds(text: Any) -> str | None:
    """``text`` as an RFC 3339 time in whole seconds (UTC), or None when it is not one."""
    if not isinstance(text, str):
        return None
    whole: str = text.split(".")[0].rstrip("Z") + "Z"
    try:
        parse_time(whole)
    except ValueError:
        return None
    return whole


# ---------------------------------------------------------------------------


class _Conditions:
    def __init__(self, status: dict[str, Any], now: datetime, generation: int | None) -> None:
        self.status, self.now, self.generation = status, now, generation

    def set(self, kind: str, value: bool | None, reason: str, message: str) -> None:
        set_condition(self.status["conditions"], kind, value, reason, message, now=self.now, generation=self.generation)


def _invalid(status: dict[str, Any]) -> bool:
    valid = condition(status, "Valid")
    return valid is not None and valid["status"] == "False"


def _describe(desired: Plan) -> str:
    parts = []
    for name, comp in desired.components.items():
        pods = comp.pods.pods
        where = f"in {comp.colocated_with}'s pods" if comp.colocated_with else f"{pods} pod{'s' if pods != 1 else ''}"
        parts.append(f"{name} {comp.allocation} ({where})")
    return f"{desired.total_gpus} GPUs: " + ", ".join(parts)


def _component(obj: dict[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPONENT, ""))


def _trainer_components(desired: Plan) -> list[Component]:
    return [c for c in desired.components.values() if c.role in TRAINER_ROLES and c.colocated_with is None]


def _job_condition(job: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    if job is None:
        return None
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return dict(cond)
    return None


def _job_complete(job: dict[str, Any] | None) -> bool:
    return _job_condition(job, "Complete") is not None


def _trainer_failure(
    trainers: dict[str, dict[str, Any]], current: dict[str, str], pods: list[dict[str, Any]], restarts: int
) -> str | None:
    """Why the current trainer gang failed, or None."""
    for role, name in current.items():
        failed = _job_condition(trainers.get(name), "Failed")
        if failed:
            return f"{role} Job {name}: {failed.get('reason', 'Failed')}: {failed.get('message', '')}".rstrip(": ")
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_COMPONENT) not in TRAINER_ROLES or labels.get(LABEL_RESTART) != str(restarts):
            continue
        if (pod.get("status") or {}).get("phase") == "Failed":
            return f"pod {pod['metadata']['name']} failed: {_pod_reason(pod)}"
    return None


def _pod_reason(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"container {cs.get('name')} exited with {term.get('exitCode')} ({term.get('reason', 'Error')})"
    return str(status.get("reason") or status.get("message") or "Failed")


def _backoff_left(memory: Memory, now: datetime, base: float) -> float:
    last = parse_time(memory.last_restart)
    if memory.restarts == 0 or last is None:
        return 0.0
    delay = backoff_seconds(memory.restarts, base)
    # A clock that ran backwards (or a record from the future) never waits longer than the backoff.
    return min(delay, max(0.0, (last + timedelta(seconds=delay) - now).total_seconds()))


def _finish(decision: Decision, observed: Observed, now: datetime, spec: dict[str, Any]) -> None:
    """A finished RLJob frees its rollout GPUs, keeps the trainer Job for inspection, and
    deletes itself once its TTL has passed."""
    decision.delete += [("StatefulSet", o["metadata"]["name"]) for o in observed.statefulsets]
    ttl = spec.get("ttlSecondsAfterFinished")
    done = parse_time(decision.status.get("completionTime"))
    if ttl is None or done is None:
        return
    # An object stored before the schema bounded the TTL may hold a huge one: clamp, never overflow.
    left = (done - now).total_seconds() + min(float(ttl), MAX_TTL_SECONDS)
    if left <= 0:
        decision.delete_self = True
    else:
        decision.requeue_after = left


def _running_allocation(trainers: dict[str, dict[str, Any]], current: dict[str, str]) -> dict[str, Any]:
    """The allocation of the components in the current trainer Jobs, as each Job was created
    (empty for Jobs without the annotation: created by an older operator)."""
    found: dict[str, Any] = {}
    for name in current.values():
        found.update(_allocation_note(trainers.get(name)))
    return found


def _allocation_note(job: dict[str, Any] | None) -> dict[str, Any]:
    """A Job's allocation annotation; one that is missing or was edited into nonsense counts as absent."""
    try:
        note = json.loads(_annotations(job).get(ANNOTATION_ALLOCATION) or "{}")
        return {c: ComponentStatus.model_validate(a).model_dump(by_alias=True, exclude_none=True)
                for c, a in note.items()}  # fmt: skip
    except (ValueError, AttributeError):  # pydantic's ValidationError is a ValueError
        return {}


def _pending_changes(desired: Plan, trainers: dict[str, dict[str, Any]]) -> list[str]:
    """What the spec asks of the running trainer Jobs that their pods do not have."""
    changes: list[str] = []
    for obj in desired.objects:
        running = trainers.get(obj["metadata"]["name"]) if obj["kind"] == "Job" else None
        have = _annotations(running)
        want = _annotations(obj)
        if ANNOTATION_TEMPLATE_HASH not in have or have[ANNOTATION_TEMPLATE_HASH] == want[ANNOTATION_TEMPLATE_HASH]:
            continue
        old, new = _allocation_note(running), _allocation_note(obj)
        moved = [
            f"{c} {_backend(old.get(c))} -> {_backend(new.get(c))} ({_gpus(old.get(c))} -> {_gpus(new.get(c))} GPUs)"
            for c in sorted(old.keys() | new.keys())
            if (old.get(c) or {}).get("backend") != (new.get(c) or {}).get("backend")
        ]
        changes += moved or [f"Job {obj['metadata']['name']}: its pod template or trainer config"]
    return changes


def _pending_message(changes: list[str]) -> str:
    return (
        f"not applied while the trainer runs: {'; '.join(changes)}. It applies when the trainer gang next starts "
        "(after a restart, or now: suspend and resume the RLJob); until then the status shows what runs"
    )


def _backend(allocation: dict[str, Any] | None) -> str:
    return str(allocation["backend"]) if allocation else "(none)"


def _gpus(allocation: dict[str, Any] | None) -> int:
    return int(allocation["gpus"]) if allocation else 0


def _annotations(obj: dict[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})


def _observe_pods(
    desired: Plan, observed: Observed, status: dict[str, Any], cond: _Conditions, restarts: int, now: datetime
) -> None:
    current = [p for p in observed.pods if _is_current(p, restarts)]
    expected = sum(int(a.get("pods", 0)) for a in status["allocation"].values())
    unschedulable = [p for p in current if _unschedulable(p)]
    running = [p for p in current if (p.get("status") or {}).get("phase") == "Running"]
    if unschedulable:
        first = _unschedulable(unschedulable[0]) or ""
        asks = sorted({_gpus_asked(p, desired.spec.gpu_resource_name) for p in unschedulable})
        message = (
            f"{len(unschedulable)} of {expected} pods cannot be scheduled; each asks for "
            f"{' or '.join(str(a) for a in asks)} {desired.spec.gpu_resource_name} "
            f"({status['gpus']} GPUs in total): {first}"
        )
        cond.set("Scheduled", False, "Unschedulable", message)
        status["message"] = message
    elif current and all((p.get("spec") or {}).get("nodeName") for p in current) and len(current) >= expected:
        cond.set("Scheduled", True, "AllPodsScheduled", f"{len(current)} pods on nodes")
    else:
        cond.set("Scheduled", None, "Waiting", f"{len(current)} of {expected} pods exist")
    if expected and len(running) >= expected:
        status["phase"] = "Running"
        status.setdefault("startTime", timestamp(now))
        status["message"] = f"{len(running)} pods running"
        if restarts:
            status["message"] += f" (restart {restarts}, {_resume(desired)})"
        cond.set("Running", True, "AllPodsRunning", f"{len(running)} of {expected} pods running")
        cond.set("Restarting", False, "Running", "")
    else:
        status["phase"] = "Pending"
        cond.set("Running", False, "PodsNotRunning", f"{len(running)} of {expected} pods running")


def _resume(desired: Plan) -> str:
    """Where a restarted gang starts: checkpoints in the failed pod's emptyDir are gone with it."""
    ckpt = desired.checkpoints()
    if ckpt["persistent"]:
        return f"resuming from the latest checkpoint on claim {ckpt['claim']}"
    return "starting from step 0 (no spec.checkpoint.volume: the checkpoints died with the failed pod)"


def _is_current(pod: dict[str, Any], restarts: int) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    if labels.get(LABEL_COMPONENT) in TRAINER_ROLES:
        return labels.get(LABEL_RESTART) == str(restarts)
    return True


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return str(c.get("message") or "Unschedulable")
    return None


def _gpus_asked(pod: dict[str, Any], resource: str) -> int:
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        total += int(limits.get(resource, 0))
    return total


WARNING_REASONS = ("InvalidSpec", "Unschedulable", "TrainerFailed", "NoCheckpointVolume")


def _with_events(decision: Decision, old: dict[str, Any]) -> Decision:
    """One event per real transition: a new phase, a condition that became true, a warning."""
    new = decision.status
    if new.get("phase") != old.get("phase"):
        kind = "Warning" if new.get("phase") == "Failed" else "Normal"
        decision.events.append((kind, f"Phase{new.get('phase')}", new.get("message") or str(new.get("phase"))))
    for cond in new.get("conditions", []):
        before = condition(old, cond["type"])
        if before is not None and (before["status"], before["reason"]) == (cond["status"], cond["reason"]):
            continue
        warning = cond["reason"] in WARNING_REASONS
        if cond["status"] == "True" or warning:
            decision.events.append(
                ("Warning" if warning else "Normal", cond["reason"], cond["message"] or cond["type"])
            )
    return decision
