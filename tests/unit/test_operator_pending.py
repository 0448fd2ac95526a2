"""Spec changes while the trainer runs: the status reports what runs, SpecChangePending what waits."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
from helpers.rljobs import NOW, example_rljob

from rljob_operator.names import ANNOTATION_ALLOCATION, ANNOTATION_TEMPLATE_HASH
from rljob_operator.observe import Observed
from rljob_operator.reconcile import decide


def rljob(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return example_rljob(status, generation=2, **spec)


def pod(name: str, component: str, *, restart: int = 0, phase: str = "Running") -> dict[str, Any]:
    labels = {"treetrain.dev/rljob": "demo", "treetrain.dev/component": component}
    if component == "actor":
        labels["treetrain.dev/restart"] = str(restart)
    return {"kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {"nodeName": "n0"},
            "status": {"phase": phase}}  # fmt: skip


def started(**spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The status and the trainer Job (as created) of an RLJob whose pods run, for ``spec``."""
    first = decide(rljob(**spec), Observed(), NOW)
    (job,) = [o for o in first.create_only if o["kind"] == "Job"]  # beside it: the key Secret
    running = decide(rljob(status=first.status, **spec), Observed(jobs=[job], pods=running_pods(job)), NOW)
    assert running.status["phase"] == "Running"
    return running.status, job


def running_pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    pods = [pod(f"demo-rollout-{i}", "rollout") for i in range(2)]
    return pods + [pod(f"demo-trainer-{i}", "actor") for i in range(job["spec"]["parallelism"])]


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_the_trainer_job_says_what_its_pods_run() -> None:
    _, job = started()
    notes = job["metadata"]["annotations"]
    assert '"backend":"fsdp:d8"' in notes[ANNOTATION_ALLOCATION] and '"gpus":8' in notes[ANNOTATION_ALLOCATION]
    assert len(notes[ANNOTATION_TEMPLATE_HASH]) == 16
    # Colocated critic/ref run in the actor's pods: they are in its Job's allocation.
    _, ppo = started(critic={}, trainerConfig={"algorithm": "ppo"})
    assert '"critic":' in ppo["metadata"]["annotations"][ANNOTATION_ALLOCATION]


def test_unchanged_spec_has_nothing_pending() -> None:
    status, job = started()
    again = decide(rljob(status=status), Observed(jobs=[job], pods=running_pods(job)), NOW)
    c = cond(again.status, "SpecChangePending")
    assert (c["status"], c["reason"]) == ("False", "UpToDate")
    assert again.status == status and again.events == []


def test_a_bigger_trainer_while_it_runs_is_pending_and_the_status_shows_what_runs() -> None:
    # fsdp:d8 -> fsdp:d16 used to report 24 GPUs (and Pending: 4 pods expected, 3 running)
    # while the 8-GPU Job kept running.
    status, job = started()
    d = decide(rljob(status=status, actor={"backend": "fsdp:d16"}), Observed(jobs=[job], pods=running_pods(job)), NOW)
    assert not [o for o in d.create_only if o["kind"] == "Job"] and ("Job", "demo-trainer") not in d.delete
    assert d.status["allocation"]["actor"]["backend"] == "fsdp:d8" and d.status["allocation"]["actor"]["gpus"] == 8
    assert d.status["gpus"] == 16 and d.status["phase"] == "Running"
    c = cond(d.status, "SpecChangePending")
    assert (c["status"], c["reason"]) == ("True", "TrainerRunning")
    assert "actor fsdp:d8 -> fsdp:d16 (8 -> 16 GPUs)" in c["message"]
    assert "suspend and resume" in c["message"]
    assert ("Normal", "TrainerRunning", c["message"]) in d.events
    # The plan itself is valid and says what it will be.
    assert cond(d.status, "Valid")["message"].startswith("24 GPUs")

    # The next gang (after a failure) starts from the new spec: nothing pending any more.
    failed = [*running_pods(job)[:2], pod("demo-trainer-0", "actor", phase="Failed")]
    restart = decide(rljob(status=d.status, actor={"backend": "fsdp:d16"}), Observed(jobs=[job], pods=failed), NOW)
    assert restart.status["restarts"] == 1
    assert cond(restart.status, "SpecChangePending")["status"] == "False"
    # The restart is recorded on the ConfigMap (the status is not trusted): the next pass lists it.
    later = decide(rljob(status=restart.status, actor={"backend": "fsdp:d16"}), Observed(configmaps=restart.remember),
                   NOW + timedelta(seconds=11))  # fmt: skip
    (new_job,) = [o for o in later.create_only if o["kind"] == "Job"]
    assert new_job["metadata"]["name"] == "demo-trainer-r1" and new_job["spec"]["parallelism"] == 2
    assert later.status["allocation"]["actor"]["gpus"] == 16


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"images": {"trainer": "registry.example/trainer:2"}}, "Job demo-trainer: its pod template or trainer config"),
        ({"trainerConfig": {"steps": 7}}, "Job demo-trainer: its pod template or trainer config"),
        # More servers change the trainer's config (server list, weight-sync world size), which
        # the running trainer read at start; the servers themselves follow at once.
        ({"rollout": {"backend": "sglang:d4t4"}}, "Job demo-trainer: its pod template or trainer config"),
        # Precision and recompute are the trainer config's; CPU and memory the pod template's.
        ({"model": {"path": "Qwen/Qwen3-8B", "dtype": "float32"}}, "Job demo-trainer: its pod template or trainer"),
        (
            {"actor": {"backend": "fsdp:d8", "resources": {"requests": {"memory": "64Gi"}}}},
            "Job demo-trainer: its pod template or trainer config",
        ),
    ],
    ids=["image", "trainer-config", "rollout", "dtype", "resources"],
)
def test_other_trainer_changes_are_pending_too(change: dict[str, Any], words: str) -> None:
    status, job = started()
    d = decide(rljob(status=status, **change), Observed(jobs=[job], pods=running_pods(job)), NOW)
    c = cond(d.status, "SpecChangePending")
    assert c["status"] == "True" and words in c["message"], c


def test_rollout_changes_apply_at_once() -> None:
    status, job = started()
    d = decide(rljob(status=status, rollout={"backend": "sglang:d4t4"}), Observed(jobs=[job], pods=running_pods(job)),
               NOW)  # fmt: skip
    (sts,) = [o for o in d.apply if o["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 4 and d.status["allocation"]["rollout"]["pods"] == 4
    assert d.status["gpus"] == 24  # 16 rollout GPUs are asked for now, the trainer keeps 8


def test_a_job_of_an_older_operator_is_taken_as_it_is() -> None:
    status, job = started()
    bare = copy.deepcopy(job)
    del bare["metadata"]["annotations"]
    d = decide(rljob(status=status, actor={"backend": "fsdp:d16"}), Observed(jobs=[bare], pods=running_pods(job)), NOW)
    assert cond(d.status, "SpecChangePending")["status"] == "False"
    assert d.status["allocation"]["actor"]["gpus"] == 16  # unknown: the spec's
    # An allocation note edited into nonsense is ignored, never a failing pass.
    for junk in ("not json", '{"actor": {"gpus": "many"}}', "[1]"):
        edited = copy.deepcopy(job)
        edited["metadata"]["annotations"][ANNOTATION_ALLOCATION] = junk
        d = decide(rljob(status=status), Observed(jobs=[edited], pods=running_pods(job)), NOW)
        assert d.status["allocation"]["actor"]["gpus"] == 8 and d.status["phase"] == "Running"


def test_suspended_has_nothing_pending() -> None:
    status, job = started()
    d = decide(rljob(status=status, suspend=True, actor={"backend": "fsdp:d16"}), Observed(jobs=[job]), NOW)
    c = cond(d.status, "SpecChangePending")
    assert (c["status"], c["reason"]) == ("False", "Suspended")
