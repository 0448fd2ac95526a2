"""RLJobs that the API server accepts but that can never run (issue 21): none may stop the
operator, and none may cost more API requests than the backoff says.

- nested 1,200 and 300 levels deep (kopf's watch died on the first, pydantic on the second);
- a child the API refuses (a ResourceQuota of zero StatefulSets): once a hot loop of about
  4,840 requests a minute with a flapping condition, now the 5 s -> 5 min backoff;
- a foreign Job at ``<name>-trainer`` (its 409 was swallowed) and a toleration with an unknown
  field (a 500 from server-side apply, retried every 5 s): each a ``ReconcileError`` naming it;
- a 253-character name: ``Valid=False``, then no further request for children (each pass got
  a 400 listing them, every 5 s).

The operator runs as a child process under exactly its RBAC rules (operator_helpers.py);
request counts come from its own counter on /metrics. Figures are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import Cluster, wait_for
from kubernetes import client
from operator_helpers import OperatorProcess, kubeconfig, operator
from rljob_helpers import SMALL, get, phase_is, rljob

pytestmark = pytest.mark.cluster
# The operator in a child process under exactly its RBAC rules: operator_helpers' fixtures.
__all__ = ["kubeconfig", "operator"]

WINDOW = 65.0  # seconds over which a refused RLJob's requests are counted (at least a minute)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), None)


def is_true(status: dict[str, Any], kind: str) -> bool:
    c = condition(status, kind)
    return c is not None and c["status"] == "True"


def create_and_wait_refused(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """Create a small RLJob and wait for its ``ReconcileError=True``; return its status."""
    client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        "treetrain.dev", "v1alpha1", namespace, "rljobs", rljob(name, **SMALL)
    )

    def refused() -> dict[str, Any] | None:
        status = get(cluster, namespace, name).get("status") or {}
        return status if is_true(status, "ReconcileError") else None

    return wait_for("ReconcileError=True", refused, timeout=120)


def deep_manifest(name: str, levels: int) -> str:
    """A small RLJob whose trainerConfig.taskArgs.turns nests ``levels`` levels deep, as JSON
    text (Python's own JSON writer cannot write it)."""
    body = rljob(name, **SMALL, trainerConfig={"taskArgs": {"turns": "DEEP"}})
    return json.dumps(body).replace('"DEEP"', '{"a": ' * levels + "1" + "}" * levels)


def kubectl_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """An RLJob's status read by kubectl (the Python client cannot decode the deep spec)."""
    out = cluster.run("kubectl", "get", "rljob", name, "-n", namespace, "-o", "jsonpath={.status}").stdout
    status: dict[str, Any] = json.loads(out) if out.strip() else {}
    return status


def delta(after: dict[tuple[str, str, str], float], before: dict[tuple[str, str, str], float]) -> Counter[str]:
    """Requests between two counter snapshots, by "verb resource code"."""
    counts: Counter[str] = Counter()
    for key, value in after.items():
        if value - before.get(key, 0.0):
            counts[" ".join(key)] += int(value - before.get(key, 0.0))
    return counts


def requests_over(operator: OperatorProcess, seconds: float) -> Counter[str]:
    """The operator's requests during the next ``seconds`` (a measurement window, not a wait)."""
    before, start = operator.requests(), time.monotonic()
    while time.monotonic() - start < seconds:
        time.sleep(1)
    return delta(operator.requests(), before)


@pytest.fixture
def stopped_operator(kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """An operator for ``namespace`` that the test starts itself (after creating objects)."""
    op = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log")
    try:
        yield op
    finally:
        op.stop()


def test_rljobs_nested_too_deeply_neither_stop_the_operator_nor_block_others(
    cluster: Cluster, namespace: str, stopped_operator: OperatorProcess, tmp_path: Path
) -> None:
    # Stored before the operator starts: what every restart of the old operator died on.
    for name, levels in (("deep-1200", 1200), ("deep-300", 300)):
        path = tmp_path / f"{name}.json"
        path.write_text(deep_manifest(name, levels))
        cluster.run("kubectl", "create", "-n", namespace, "-f", str(path))
    op = stopped_operator
    started = time.monotonic()
    op.start()
    create_small = client.CustomObjectsApi(cluster.api).create_namespaced_custom_object
    create_small("treetrain.dev", "v1alpha1", namespace, "rljobs", rljob("healthy", **SMALL))
    wait_for("healthy Running beside the deep RLJobs", phase_is(cluster, namespace, "healthy", "Running"), timeout=240)
    print(f"\nwith RLJobs nested 1200 and 300 levels deep stored: another RLJob Running "
          f"{time.monotonic() - started:.1f} s after the operator started")  # fmt: skip
    for name in ("deep-1200", "deep-300"):
        status = wait_for(f"{name}: Valid=False", lambda n=name: (s := kubectl_status(cluster, namespace, n))  # type: ignore[misc]
                          and condition(s, "Valid") and s)  # fmt: skip
        valid = condition(status, "Valid")
        assert valid is not None and valid["status"] == "False", status
        assert "spec.trainerConfig.taskArgs.turns" in valid["message"], valid
        assert "nested more than 64 levels deep" in valid["message"], valid
        assert status["phase"] == "Failed", status
    # A restart (the Deployment's) lists them again: still alive, still serving. It stops on
    # SIGTERM (one restart of the old operator ignored it for 60 s and had to be killed).
    op.stop()
    assert op.proc is not None and op.proc.returncode == 0, op.output()[-3000:]
    op.start()
    create_small("treetrain.dev", "v1alpha1", namespace, "rljobs", rljob("after-restart", **SMALL))
    wait_for("after-restart Running", phase_is(cluster, namespace, "after-restart", "Running"), timeout=240)
    op.assert_alive_and_quiet()
    assert "nested more than 100 levels deep" in op.output()  # said in one line, not a traceback


def test_a_refused_child_costs_what_the_backoff_says(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # A quota of zero StatefulSets: the API refuses the rollout StatefulSet (403), whatever
    # admission checks up front. It was a hot loop: each pass cleared the condition and wrote
    # the status twice, and each write queued the next pass at once.
    core = client.CoreV1Api(cluster.api)
    core.create_namespaced_resource_quota(
        namespace, {"metadata": {"name": "no-sts"}, "spec": {"hard": {"count/statefulsets.apps": "0"}}}
    )
    wait_for("the quota counted", lambda: (core.read_namespaced_resource_quota("no-sts", namespace).status.hard
                                           or None), timeout=60)  # fmt: skip
    status = create_and_wait_refused(cluster, namespace, "refused")
    first = condition(status, "ReconcileError")
    assert first is not None and "StatefulSet refused-rollout" in first["message"], first
    assert "exceeded quota" in first["message"], first
    before = operator.requests()
    start = time.monotonic()
    seen = set()
    # The measurement window itself (not a wait for a condition): the condition is read all along.
    while time.monotonic() - start < WINDOW:
        c = condition(get(cluster, namespace, "refused")["status"], "ReconcileError")
        assert c is not None
        seen.add((c["status"], c["lastTransitionTime"]))
        time.sleep(2)
    spent = delta(operator.requests(), before)
    minutes = (time.monotonic() - start) / 60
    total = sum(spent.values())
    print(f"\na refused RLJob over {minutes * 60:.0f} s: {total} requests ({total / minutes:.0f}/min): {dict(spent)}")
    # The backoff from the first refusal: passes at +5, +15, +35 s (+75 s), each a GET, five
    # LISTs and the refused PATCH; nothing written (the status already says it all).
    assert total <= 40, spent
    assert not [k for k in spent if k.startswith("patch_status")], spent
    assert seen == {("True", first["lastTransitionTime"])}, seen  # no flapping
    # Fixed (the quota removed): taken up at the next try of the backoff, the condition cleared.
    core.delete_namespaced_resource_quota("no-sts", namespace)
    status = wait_for("refused Running once the quota is gone", phase_is(cluster, namespace, "refused", "Running"),
                      timeout=240)  # fmt: skip
    cleared = condition(status, "ReconcileError")
    assert cleared is not None and cleared["status"] == "False", status
    operator.assert_alive_and_quiet()


def test_a_foreign_job_at_the_trainer_name_is_a_reconcile_error(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    batch = client.BatchV1Api(cluster.api)
    foreign = batch.create_namespaced_job(
        namespace,
        {
            "metadata": {"name": "clash-trainer"},
            "spec": {
                "suspend": True,
                "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}},
            },
        },
    )
    status = create_and_wait_refused(cluster, namespace, "clash")
    c = condition(status, "ReconcileError")
    assert c is not None and "Job clash-trainer already exists" in c["message"], c
    assert "clash-trainer" in status["message"], status
    job = batch.read_namespaced_job("clash-trainer", namespace)
    assert job.metadata.uid == foreign.metadata.uid and not job.metadata.owner_references  # untouched
    operator.assert_alive_and_quiet()


def test_a_toleration_the_api_refuses_is_a_reconcile_error_under_the_backoff(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    # Server-side apply answers 500 for a toleration with a field it does not know.
    scheduling = {"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "bogus": 1}]}
    client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        "treetrain.dev", "v1alpha1", namespace, "rljobs", rljob("tol", scheduling=scheduling, **SMALL)
    )

    def said() -> dict[str, Any] | None:
        status = get(cluster, namespace, "tol").get("status") or {}
        refused = is_true(status, "ReconcileError")
        invalid = (condition(status, "Valid") or {}).get("status") == "False"  # if admission refuses it first
        return status if refused or invalid else None

    status = wait_for("ReconcileError=True (or Valid=False)", said, timeout=120)
    c = condition(status, "ReconcileError") if is_true(status, "ReconcileError") else condition(status, "Valid")
    assert c is not None and ("bogus" in c["message"] or "toleration" in c["message"].lower()), c
    spent = requests_over(operator, 30.0)
    assert sum(spent.values()) <= 25, spent  # the backoff (5, 10, 20 s), not every 5 s for ever
    operator.assert_alive_and_quiet()


def test_an_invalid_rljob_makes_no_further_requests_for_children(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    name = "l" * 253  # a valid object name, far too long for a label value or a child's name
    client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        "treetrain.dev", "v1alpha1", namespace, "rljobs", rljob(name, **SMALL)
    )
    status = wait_for("Valid=False", lambda: (s := get(cluster, namespace, name).get("status") or {})
                      and (condition(s, "Valid") or {}).get("status") == "False" and s, timeout=120)  # fmt: skip
    assert status["phase"] == "Failed"
    spent = requests_over(operator, 30.0)
    print(f"\nan invalid RLJob over 30 s: {dict(spent)}")
    assert not [k for k in spent if k.startswith("list")], spent  # children are not listed again
    assert not [k for k in spent if not k.endswith(" 200") and not k.endswith(" 201")], spent
    assert sum(spent.values()) <= 2, spent
    operator.assert_alive_and_quiet()
