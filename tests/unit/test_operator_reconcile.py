"""The pure reconcile step: observed state in, actions and status out."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
from helpers.rljobs import NOW, example_rljob

from rljob_operator.conditions import backoff_seconds, set_condition
from rljob_operator.controller import merge_patch
from rljob_operator.observe import Observed
from rljob_operator.reconcile import Decision, decide


def rljob(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return example_rljob(status, generation=3, **spec)


def pod(name: str, component: str, *, phase: str = "Running", restart: int = 0, node: str | None = "n0",
        unschedulable: str | None = None, exit_code: int | None = None) -> dict[str, Any]:  # fmt: skip
    labels = {"treetrain.dev/rljob": "demo", "treetrain.dev/component": component}
    if component == "actor":
        labels["treetrain.dev/restart"] = str(restart)
    status: dict[str, Any] = {"phase": phase}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]  # fmt: skip
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code,
                                                                                    "reason": "Error"}}}]  # fmt: skip
    gpus = "8" if component == "actor" else "4"
    spec: dict[str, Any] = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": gpus}}}]}
    if node:
        spec["nodeName"] = node
    return {"kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec, "status": status}


OWNER = [{"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "name": "demo", "uid": "u", "controller": True}]


def child(kind: str, name: str, labels: dict[str, str] | None = None, *, owner: str | None = "u") -> dict[str, Any]:
    """A child as the API server lists it; ``owner`` is the uid in its controller ownerReference."""
    refs = [{**OWNER[0], "uid": owner}] if owner else []
    return {"kind": kind, "metadata": {"name": name, "labels": labels or {}, "ownerReferences": refs}}


def job(name: str, condition: str | None = None, *, owner: str | None = "u") -> dict[str, Any]:
    restart = name.rsplit("-r", 1)[1] if "-trainer-r" in name else "0"
    labels = {"treetrain.dev/rljob": "demo", "treetrain.dev/component": "actor", "treetrain.dev/restart": restart}
    status = {"conditions": [{"type": condition, "status": "True", "reason": "X"}]} if condition else {}
    return {**child("Job", name, labels, owner=owner), "status": status}


def jobs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Jobs among ``objects`` (``create_only`` also holds the key Secret, created once)."""
    return [o for o in objects if o["kind"] == "Job"]


def recorded(d: Decision) -> list[dict[str, Any]]:
    """The ConfigMaps a decision wrote, as the next pass lists them (its record of restarts, finishes)."""
    written = {o["metadata"]["name"]: o for o in (*d.apply, *d.remember) if o["kind"] == "ConfigMap"}
    return list(written.values())


def running_pods(restart: int = 0) -> list[dict[str, Any]]:
    trainer = "demo-trainer-0" if restart == 0 else f"demo-trainer-r{restart}-0"
    return [pod("demo-rollout-0", "rollout"), pod("demo-rollout-1", "rollout"),
            pod(trainer, "actor", restart=restart)]  # fmt: skip


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_new_rljob_creates_everything_at_once() -> None:
    d = decide(rljob(), Observed(), NOW)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in d.apply) == [
        ("ConfigMap", "demo-config"), ("NetworkPolicy", "demo-network"), ("Service", "demo-rollout"),
        ("Service", "demo-trainer"), ("StatefulSet", "demo-rollout"),
    ]  # fmt: skip
    # The key Secret is created once (kube.py remembers it); the trainer Job after the rest.
    assert [(o["kind"], o["metadata"]["name"]) for o in d.create_only] == [("Secret", "demo-api-key"),
                                                                           ("Job", "demo-trainer")]  # fmt: skip
    assert d.status["phase"] == "Pending" and d.status["gpus"] == 16 and d.status["observedGeneration"] == 3
    assert cond(d.status, "Valid")["status"] == "True"
    assert d.status["allocation"]["rollout"]["gpusPerPod"] == 4
    assert ("Normal", "Planned", "16 GPUs: rollout sglang:d2t4 (2 pods), actor fsdp:d8 (1 pod)") in d.events


def test_running_when_every_pod_runs() -> None:
    d = decide(rljob(), Observed(jobs=[job("demo-trainer")], pods=running_pods()), NOW)
    assert d.status["phase"] == "Running" and d.status["startTime"] == "2026-11-29T12:00:00Z"
    assert cond(d.status, "Running")["status"] == "True" and cond(d.status, "Scheduled")["status"] == "True"
    # Running again changes nothing and posts nothing.
    again = decide(rljob(status=d.status), Observed(jobs=[job("demo-trainer")], pods=running_pods()), NOW)
    assert again.status == d.status and again.events == []


def test_unschedulable_reports_gpus_asked() -> None:
    pods = [pod("demo-rollout-0", "rollout"), pod("demo-rollout-1", "rollout"),
            pod("demo-trainer-0", "actor", phase="Pending", node=None,
                unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")]  # fmt: skip
    d = decide(rljob(), Observed(pods=pods), NOW)
    c = cond(d.status, "Scheduled")
    assert (c["status"], c["reason"]) == ("False", "Unschedulable")
    assert c["message"].startswith("1 of 3 pods cannot be scheduled; each asks for 8 nvidia.com/gpu (16 GPUs in total)")
    assert "Insufficient nvidia.com/gpu" in c["message"]
    assert ("Warning", "Unschedulable", c["message"]) in d.events


def test_trainer_failure_restarts_with_backoff() -> None:
    running = decide(rljob(), Observed(jobs=[job("demo-trainer")], pods=running_pods()), NOW).status
    failed = [*running_pods()[:2], pod("demo-trainer-0", "actor", phase="Failed", exit_code=137)]
    d = decide(rljob(status=running), Observed(jobs=[job("demo-trainer")], pods=failed), NOW)
    assert d.status["restarts"] == 1 and d.status["phase"] == "Pending"
    assert "container trainer exited with 137" in d.status["message"]
    assert ("Job", "demo-trainer") in d.delete and d.requeue_after == 10.0
    assert cond(d.status, "Restarting")["status"] == "True"

    # During the backoff the next Job is not created yet ...
    # The restart is recorded on the ConfigMap, written before the failed Job is deleted.
    assert recorded(d) == d.remember and not d.apply
    world = Observed(pods=running_pods()[:2], configmaps=recorded(d))
    soon = decide(rljob(status=d.status), world, NOW + timedelta(seconds=4))
    assert jobs(soon.create_only) == [] and soon.requeue_after == 6.0
    # ... afterwards it is, under a new name, resuming from the checkpoint.
    later = decide(rljob(status=d.status), world, NOW + timedelta(seconds=11))
    (new_job,) = jobs(later.create_only)
    assert new_job["metadata"]["name"] == "demo-trainer-r1"
    env = {e["name"]: e.get("value") for e in new_job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TREETRAIN_RESTART"] == "1"


def test_checkpoints_without_a_volume_are_said_to_be_ephemeral() -> None:
    """No spec.checkpoint.volume: a condition and one warning event at admission, and a restart
    says it starts from step 0 instead of claiming a resume."""
    d = decide(rljob(), Observed(), NOW)
    c = cond(d.status, "CheckpointsEphemeral")
    assert (c["status"], c["reason"]) == ("True", "NoCheckpointVolume")
    assert "restarted trainer gang starts from step 0" in c["message"]
    assert [e[:2] for e in d.events].count(("Warning", "NoCheckpointVolume")) == 1
    running = decide(rljob(status=d.status), Observed(jobs=[job("demo-trainer")], pods=running_pods()), NOW)
    assert not [e for e in running.events if e[1] == "NoCheckpointVolume"]  # said once

    failed = [*running_pods()[:2], pod("demo-trainer-0", "actor", phase="Failed", exit_code=1)]
    restart = decide(rljob(status=running.status), Observed(jobs=[job("demo-trainer")], pods=failed), NOW)
    assert "starting from step 0" in restart.status["message"] and "resum" not in restart.status["message"]
    later = NOW + timedelta(seconds=11)
    back = decide(rljob(status=restart.status), Observed(jobs=[job("demo-trainer-r1")], pods=running_pods(1),
                                                         configmaps=recorded(restart)), later)  # fmt: skip
    assert back.status["message"].startswith("3 pods running (restart 1, starting from step 0")

    kept = decide(rljob(checkpoint={"volume": {"claimName": "ckpt"}}), Observed(), NOW)
    assert cond(kept.status, "CheckpointsEphemeral")["status"] == "False"
    assert not [e for e in kept.events if e[1] == "NoCheckpointVolume"]
    failed_kept = decide(
        rljob(status={**running.status, "conditions": []}, checkpoint={"volume": {"claimName": "ckpt"}}),
        Observed(jobs=[job("demo-trainer")], pods=failed),
        NOW,
    )
    assert "resuming from the latest checkpoint on claim ckpt" in failed_kept.status["message"]


def test_failed_after_max_restarts() -> None:
    status = {"phase": "Running", "restarts": 2, "conditions": []}
    failed = [pod("demo-trainer-r2-0", "actor", phase="Failed", restart=2, exit_code=1)]
    d = decide(rljob(status=status, maxRestarts=2), Observed(jobs=[job("demo-trainer-r2")], pods=failed), NOW)
    assert d.status["phase"] == "Failed" and d.status["restarts"] == 2
    assert "after 2 restarts (maxRestarts 2)" in d.status["message"]
    assert cond(d.status, "Failed")["reason"] == "TrainerFailed"
    assert d.events[0][:2] == ("Warning", "PhaseFailed")


def test_old_trainer_jobs_are_deleted() -> None:
    # Restart 1 was recorded but the failed Job's deletion did not happen (the pass died).
    first = decide(rljob(), Observed(jobs=[job("demo-trainer", "Failed")]), NOW)
    assert first.status["restarts"] == 1
    later = NOW + timedelta(seconds=11)
    d = decide(rljob(status=first.status), Observed(jobs=[job("demo-trainer", "Failed")],
                                                    configmaps=recorded(first)), later)  # fmt: skip
    assert ("Job", "demo-trainer") in d.delete
    assert [o["metadata"]["name"] for o in d.create_only if o["kind"] == "Job"] == ["demo-trainer-r1"]


def test_success_tears_down_rollout_and_honours_ttl() -> None:
    sts = child("StatefulSet", "demo-rollout")
    d = decide(rljob(ttlSecondsAfterFinished=60), Observed(jobs=[job("demo-trainer", "Complete")],
                                                            statefulsets=[sts]), NOW)  # fmt: skip
    assert d.status["phase"] == "Succeeded" and d.status["completionTime"] == "2026-11-29T12:00:00Z"
    assert ("StatefulSet", "demo-rollout") in d.delete and d.requeue_after == 60.0 and not d.delete_self
    later = decide(
        rljob(status=d.status, ttlSecondsAfterFinished=60),
        Observed(configmaps=recorded(d)),
        NOW + timedelta(seconds=61),
    )
    assert later.delete_self and later.status["phase"] == "Succeeded"


def test_invalid_spec_creates_nothing() -> None:
    d = decide(rljob(actor={"backend": "fsdp:d4p2"}), Observed(), NOW)
    assert d.apply == [] and d.create_only == []
    assert d.status["phase"] == "Failed"
    valid = cond(d.status, "Valid")
    assert valid["status"] == "False" and "fsdp does not support pipeline parallel" in valid["message"]
    # Fixing the spec starts over.
    fixed = decide(rljob(status=d.status), Observed(), NOW)
    assert fixed.status["phase"] == "Pending" and fixed.create_only


def test_suspend_deletes_workloads_only() -> None:
    sts = child("StatefulSet", "demo-rollout")
    d = decide(rljob(suspend=True), Observed(jobs=[job("demo-trainer")], statefulsets=[sts]), NOW)
    assert sorted(d.delete) == [("Job", "demo-trainer"), ("StatefulSet", "demo-rollout")]
    assert d.apply == [] and d.status["phase"] == "Suspended"
    assert cond(d.status, "Suspended")["status"] == "True"


def test_condition_transition_time_moves_only_on_change() -> None:
    conditions: list[dict[str, Any]] = []
    set_condition(conditions, "Running", True, "A", "m", now=NOW, generation=1)
    set_condition(conditions, "Running", True, "B", "n", now=NOW + timedelta(seconds=5), generation=2)
    assert conditions[0]["lastTransitionTime"] == "2026-11-29T12:00:00Z" and conditions[0]["reason"] == "B"
    set_condition(conditions, "Running", False, "C", "", now=NOW + timedelta(seconds=9), generation=2)
    assert conditions[0]["lastTransitionTime"] == "2026-11-29T12:00:09Z"


def test_backoff_doubles_and_caps() -> None:
    assert [backoff_seconds(n, 10) for n in (1, 2, 3, 4)] == [10, 20, 40, 80]
    assert backoff_seconds(20, 10) == 300


def test_merge_patch_removes_stale_keys() -> None:
    old = {"phase": "Running", "message": "x", "allocation": {"critic": {"gpus": 1}, "actor": {"gpus": 8}}}
    new = {"phase": "Failed", "allocation": {"actor": {"gpus": 8}}}
    assert merge_patch(old, new) == {"phase": "Failed", "message": None,
                                     "allocation": {"actor": {"gpus": 8}, "critic": None}}  # fmt: skip


def test_a_huge_ttl_is_refused_at_admission_and_never_overflows() -> None:
    from rljob_operator.plan import PlanError, plan

    with pytest.raises(PlanError, match=r"spec\.ttlSecondsAfterFinished"):
        plan(rljob(ttlSecondsAfterFinished=10**14))
    # One stored before the bound existed is judged at once, never an OverflowError.
    done = decide(rljob(ttlSecondsAfterFinished=60), Observed(jobs=[job("demo-trainer", "Complete")]), NOW)
    for ttl in (10**14, 10**30):
        later = decide(
            rljob(status=done.status, ttlSecondsAfterFinished=ttl),
            Observed(configmaps=recorded(done)),
            NOW + timedelta(days=1),
        )
        assert not later.delete_self


def _stored(value: Any) -> Any:
    """What the API server keeps of a status written as a merge patch: nulls delete keys."""
    if isinstance(value, dict):
        return {k: _stored(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_stored(v) for v in value]
    return value


def test_a_steady_state_sends_nothing() -> None:
    # Idle RLJobs cost about 65 API requests/s: a no-op status PATCH per pass (colocatedWith null
    # vs absent) and a Job POST answered 409 per pass. A steady state must cost nothing.
    observed = Observed(jobs=[job("demo-trainer")], pods=running_pods())
    for spec in ({}, {"critic": {}, "trainerConfig": {"algorithm": "ppo"}}):
        first = decide(rljob(**spec), observed, NOW)
        stored = _stored(first.status)
        again = decide(rljob(status=stored, **spec), observed, NOW + timedelta(seconds=30))
        assert again.status == stored, "the controller would PATCH an unchanged status"
        assert jobs(again.create_only) == [], "the controller would POST a Job that exists"
        assert again.events == []


def test_a_rollout_engine_removed_from_the_spec_is_torn_down() -> None:
    # It used to keep running (GPUs held) while the status no longer counted it.
    def sts(name: str) -> dict[str, Any]:
        return child("StatefulSet", name, {"treetrain.dev/component": "rollout"})

    def svc(name: str) -> dict[str, Any]:
        return child("Service", name)

    observed = Observed(jobs=[job("demo-trainer")], statefulsets=[sts("demo-rollout"), sts("demo-rollout-small")],
                        pods=running_pods(), services=[svc("demo-rollout"), svc("demo-rollout-small"),
                                                       svc("demo-trainer")])  # fmt: skip
    d = decide(rljob(), observed, NOW)
    assert ("StatefulSet", "demo-rollout-small") in d.delete and ("Service", "demo-rollout-small") in d.delete
    assert ("StatefulSet", "demo-rollout") not in d.delete and ("Service", "demo-rollout") not in d.delete
    assert ("Service", "demo-trainer") not in d.delete


def test_objects_it_does_not_control_are_never_deleted() -> None:
    """Issue 21 item 4: a StatefulSet, Service and Job carrying only the operator's labels (no
    ownerReference, or another object's) were deleted as stale or as a removed engine's."""
    labels = {"app.kubernetes.io/managed-by": "rljob-operator", "treetrain.dev/rljob": "demo",
              "treetrain.dev/component": "rollout"}  # fmt: skip
    foreign: list[dict[str, Any]] = []
    for owner in (None, "someone-else"):
        foreign += [child("StatefulSet", f"x-{owner}", labels, owner=owner),
                    child("Service", f"x-{owner}", labels, owner=owner),
                    job(f"x-{owner}", owner=owner), job(f"demo-trainer-r7-{owner}", "Failed", owner=owner)]  # fmt: skip
    ours = Observed(jobs=[job("demo-trainer")], pods=running_pods(),
                    statefulsets=[child("StatefulSet", "demo-rollout")],
                    services=[child("Service", "demo-rollout"), child("Service", "demo-trainer")])  # fmt: skip
    world = Observed(
        jobs=[*ours.jobs, *(o for o in foreign if o["kind"] == "Job")],
        statefulsets=[*ours.statefulsets, *(o for o in foreign if o["kind"] == "StatefulSet")],
        pods=ours.pods,
        services=[*ours.services, *(o for o in foreign if o["kind"] == "Service")],
    )
    names = {o["metadata"]["name"] for o in foreign}
    finished = Observed(**{**world.__dict__, "jobs": [job("demo-trainer", "Complete"), *world.jobs[1:]]})
    running = decide(rljob(), world, NOW)
    assert running.status["phase"] == "Running" and running.status["restarts"] == 0
    for d in (
        running,
        decide(rljob(suspend=True), world, NOW),  # suspend deletes the workloads
        decide(rljob(actor={"backend": "fsdp:d4p2"}), world, NOW),  # an invalid spec deletes them too
        decide(rljob(), finished, NOW),  # a finished RLJob tears its rollout servers down
    ):
        assert not [n for _, n in d.delete if n in names], d.delete
    # A foreign ConfigMap with a record in it is no record of this RLJob.
    fake = child("ConfigMap", "demo-config", owner=None)
    fake["metadata"]["annotations"] = {"treetrain.dev/state": '{"finished":"Succeeded","restarts":3}'}
    d = decide(rljob(), Observed(**{**ours.__dict__, "configmaps": [fake]}), NOW)
    assert d.status["phase"] == "Running" and d.status["restarts"] == 0 and not d.delete


def test_a_status_patched_to_a_lie_drives_nothing() -> None:
    """Issue 21 item 10: `phase: Succeeded` tore the rollout servers down while the trainer ran
    on; `restarts: 2` deleted a healthy trainer Job and started -trainer-r2 from step 0."""
    world = Observed(jobs=[job("demo-trainer")], pods=running_pods(),
                     statefulsets=[child("StatefulSet", "demo-rollout")],
                     services=[child("Service", "demo-rollout"), child("Service", "demo-trainer")])  # fmt: skip
    truth = decide(rljob(), world, NOW)
    world.configmaps = recorded(truth)
    lies = (
        {"phase": "Succeeded", "completionTime": "2026-11-29T11:00:00Z"},
        {"phase": "Failed"},
        {"restarts": 2},
        {"restarts": 2, "lastRestartTime": "2030-01-01T00:00:00Z"},
        {"conditions": []},
    )
    for lie in lies:
        d = decide(rljob(status={**truth.status, **lie}, ttlSecondsAfterFinished=0), world, NOW)
        assert d.delete == [] and not d.delete_self and d.remember == [], lie
        assert [o for o in d.create_only if o["kind"] == "Job"] == [], lie
        assert d.status["phase"] == "Running" and d.status["restarts"] == 0, lie
        assert "completionTime" not in d.status and "lastRestartTime" not in d.status, lie
    # The operator's own record, edited to claim more restarts than the healthy gang that runs,
    # loses to that gang.
    edited = copy.deepcopy(world.configmaps)
    edited[0]["metadata"]["annotations"]["treetrain.dev/state"] = '{"restarts":2}'
    d = decide(rljob(status=truth.status), Observed(**{**world.__dict__, "configmaps": edited}), NOW)
    assert d.delete == [] and not [o for o in d.create_only if o["kind"] == "Job"] and d.status["restarts"] == 0


def test_a_finish_is_remembered_whatever_the_status_says() -> None:
    done = decide(rljob(), Observed(jobs=[job("demo-trainer", "Complete")]), NOW)
    assert done.status["phase"] == "Succeeded" and recorded(done)
    # The status patched back to Running, the Job deleted by hand: it stays Succeeded, nothing is created.
    lie = {**done.status, "phase": "Running"}
    d = decide(rljob(status=lie), Observed(configmaps=recorded(done)), NOW + timedelta(seconds=5))
    assert d.status["phase"] == "Succeeded" and d.status["completionTime"] == "2026-11-29T12:00:00Z"
    assert not [o for o in (*d.create_only, *d.apply) if o["kind"] in ("Job", "StatefulSet")]
