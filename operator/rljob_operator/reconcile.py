"""Level-based reconciliation of one RLJob, as a pure function.

``decide(rljob, observed, now)`` reads the RLJob and the children that exist, and
returns what to create or update, what to delete, the new status and the events to
post. The controller (operator/rljob_operator/controller.py) only gathers ``observed``, carries out the
decision and patches the status when it changed. What the children say is read in
operator/rljob_operator/observe.py, the operator's record in operator/rljob_operator/record.py, the conditions and times in
operator/rljob_operator/conditions.py.

Ownership: only children that this RLJob controls count, those whose controller
ownerReference carries the RLJob's uid (:func:`owned`). An object that merely carries the
operator's labels, or has the name of a child, is never deleted, updated or read as state.
The key Secret, which the operator cannot read, is its own only by its record
(operator/rljob_operator/key_secret.py); a Secret the RLJob names in ``spec.apiKeySecret`` is never touched.

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

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from rljob_operator.components import Component
from rljob_operator.conditions import Conditions, backoff_seconds, condition, parse_time, set_or_drop, timestamp
from rljob_operator.errors import PlanError
from rljob_operator.models import MAX_TTL_SECONDS
from rljob_operator.names import (
    trainer_job_name,
)
from rljob_operator.observe import (
    TRAINER_ROLES,
    Observed,
    completion_time,
    component_of,
    gang_restarts,
    gpus_asked,
    is_current,
    job_complete,
    owned,
    pending_changes,
    pending_message,
    running_allocation,
    trainer_failure,
    unschedulable_reason,
)
from rljob_operator.plan import Plan, plan
from rljob_operator.policy import Limits
from rljob_operator.record import ANNOTATION_STATE, KeyState, Memory, annotations_of, read_memory, with_memory
from rljob_operator.status_api import RLJobStatus


@dataclass
class Decision:
    status: dict[str, Any]
    # Applied before anything is deleted: the ConfigMap carrying the operator's record (a restart,
    # a finish), so a pass that dies after deleting the failed Job still has the restart counted.
    remember: list[dict[str, Any]] = field(default_factory=list)
    apply: list[dict[str, Any]] = field(default_factory=list)
    create_only: list[dict[str, Any]] = field(default_factory=list)  # Jobs: their pod template is immutable
    # What the record says of the key Secret NAME-api-key (operator/rljob_operator/key_secret.py).
    key: KeyState = "none"
    delete: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)
    delete_self: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None


def decide(rljob: dict[str, Any], observed: Observed, now: datetime, limits: Limits = Limits()) -> Decision:  # noqa: B008
    observed = owned(rljob, observed)
    old = RLJobStatus.model_validate(rljob.get("status") or {}).model_dump(by_alias=True, exclude_none=True)
    status: dict[str, Any] = {**old, "conditions": [dict(c) for c in old.get("conditions", [])]}
    generation = (rljob.get("metadata") or {}).get("generation")
    status["observedGeneration"] = generation
    cond = Conditions(status, now, generation)
    spec = rljob.get("spec") or {}
    decision = Decision(status=status)
    config_name = f"{(rljob.get('metadata') or {}).get('name')}-config"
    memory = read_memory(next((c for c in observed.configmaps if c["metadata"]["name"] == config_name), None))

    # A finished RLJob stays finished (as recorded, whatever the status says); only its TTL and
    # rollout teardown remain.
    if memory.finished:
        status.update(phase=memory.finished, restarts=memory.restarts)
        set_or_drop(status, "completionTime", memory.finished_at)
        set_or_drop(status, "lastRestartTime", memory.last_restart)
        if old.get("phase") != memory.finished:
            status["message"] = memory.message or memory.finished.lower()
        _finish(decision, observed, now, spec)
        return _with_events(decision, old)

    restarts = gang_restarts(memory, observed)
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
    set_or_drop(status, "lastRestartTime", memory.last_restart if restarts else None)
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

    trainers = {o["metadata"]["name"]: o for o in observed.jobs if component_of(o) in TRAINER_ROLES}
    current = {c.role: trainer_job_name(desired.name, c.role, restarts) for c in _trainer_components(desired)}
    # The status describes what exists: a running trainer Job keeps its allocation until the next gang.
    status["allocation"].update(running_allocation(trainers, current))
    status["gpus"] = sum(a["gpus"] for a in status["allocation"].values())
    pending = pending_changes(desired, trainers)
    stale = [name for name in trainers if name not in current.values()]
    decision.delete += [("Job", name) for name in stale]
    # A rollout engine removed from the spec: its servers go (their GPUs are no longer counted),
    # and so does its headless Service.
    for kind, objects in (("StatefulSet", observed.statefulsets), ("Service", observed.services)):
        wanted = {o["metadata"]["name"] for o in desired.objects if o["kind"] == kind}
        decision.delete += [(kind, o["metadata"]["name"]) for o in objects if o["metadata"]["name"] not in wanted]

    # Trainer finished or failed?
    failure = trainer_failure(trainers, current, observed.pods, restarts)
    if not failure and current and all(job_complete(trainers.get(name)) for name in current.values()):
        done = completion_time(trainers, current) or timestamp(now)
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
    for obj in with_memory(desired.objects, memory):
        if obj["kind"] == "Job":
            # Read before create: a Job that exists is left alone (no POST answered 409 per pass).
            if wait > 0 or obj["metadata"]["name"] in stale or obj["metadata"]["name"] in existing:
                continue
            decision.create_only.append(obj)
        elif obj["kind"] == "Secret":
            decision.create_only.append(obj)  # the API key: random, created once, never rewritten
            decision.key = memory.key
        else:
            decision.apply.append(obj)
    if pending:
        cond.set("SpecChangePending", True, "TrainerRunning", pending_message(pending))
    else:
        cond.set("SpecChangePending", False, "UpToDate", "")
    if wait > 0:
        decision.requeue_after = wait
        status["message"] = f"restarting the trainer gang in {wait:.0f} s (backoff), {_resume(desired)}"

    _observe_pods(desired, observed, status, cond, restarts, now)
    return _with_events(decision, old)


def _remembered(desired: Plan, memory: Memory) -> list[dict[str, Any]]:
    return [o for o in with_memory(desired.objects, memory) if ANNOTATION_STATE in annotations_of(o)]


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


def _trainer_components(desired: Plan) -> list[Component]:
    return [c for c in desired.components.values() if c.role in TRAINER_ROLES and c.colocated_with is None]


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


def _observe_pods(
    desired: Plan, observed: Observed, status: dict[str, Any], cond: Conditions, restarts: int, now: datetime
) -> None:
    current = [p for p in observed.pods if is_current(p, restarts)]
    expected = sum(int(a.get("pods", 0)) for a in status["allocation"].values())
    unschedulable = [p for p in current if unschedulable_reason(p)]
    running = [p for p in current if (p.get("status") or {}).get("phase") == "Running"]
    if unschedulable:
        first = unschedulable_reason(unschedulable[0]) or ""
        asks = sorted({gpus_asked(p, desired.spec.gpu_resource_name) for p in unschedulable})
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
