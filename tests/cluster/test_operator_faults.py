"""Faults against the real operator on the test cluster: it is SIGKILLed mid-reconcile, the API
server goes away for 30 s, children are deleted by hand, the spec is edited while Running, and a
burst of child events arrives from many threads. Each time: it converges, no child is doubled,
and the status says what exists.

The operator runs as `rljob operator --namespace NS` in a child process (so it can be killed),
under a ServiceAccount token bound to exactly ``rljob_operator.rbac.RULES``. Recovery times are
printed (`pytest -s` shows them); deadlines are generous and only catch hangs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import Cluster, gpu_room, wait_for
from kubernetes import client
from operator_helpers import OperatorProcess, kubeconfig, operator
from rljob_helpers import FAIL, SMALL, cond, create, custom, get, label_pods, phase_is, rljob, trainer_selector

from rljob_operator.models import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.cluster
# The operator in a child process under exactly its RBAC rules: operator_helpers' fixtures.
__all__ = ["kubeconfig", "operator"]

LAUNCHER = Path(__file__).resolve().parent / "launcher.py"
PATCHES = 600  # label and annotation patches on children in the event-burst test


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def extra_gpus(cluster: Cluster) -> Iterator[None]:
    """Extra simulated GPU nodes, so that 20 small RLJobs fit beside whatever earlier tests'
    namespaces still hold while they go away."""
    with gpu_room(cluster.api, 48, "faults-gpu", cidr_offset=200):
        yield


# ---------------------------------------------------------------------------
# Helpers


def all_running(cluster: Cluster, namespace: str, names: list[str]) -> bool:
    items = custom(cluster).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    phases = {o["metadata"]["name"]: (o.get("status") or {}).get("phase") for o in items}
    return all(phases.get(n) == "Running" for n in names)


def children(cluster: Cluster, namespace: str, name: str) -> dict[str, list[str]]:
    """Names of every child of RLJob ``name``, by kind (pods being deleted left out)."""
    selector = f"treetrain.dev/rljob={name}"
    core, apps, batch = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)
    listed = {
        "StatefulSet": apps.list_namespaced_stateful_set(namespace, label_selector=selector).items,
        "Job": batch.list_namespaced_job(namespace, label_selector=selector).items,
        "Service": core.list_namespaced_service(namespace, label_selector=selector).items,
        "ConfigMap": core.list_namespaced_config_map(namespace, label_selector=selector).items,
        "Pod": [p for p in core.list_namespaced_pod(namespace, label_selector=selector).items
                if not p.metadata.deletion_timestamp],
    }  # fmt: skip
    return {kind: sorted(o.metadata.name for o in items) for kind, items in listed.items()}


def exactly_once(cluster: Cluster, namespace: str, name: str) -> dict[str, list[str]]:
    """The children of a small Running RLJob: each one exactly once."""
    found = children(cluster, namespace, name)
    assert found["StatefulSet"] == [f"{name}-rollout"], found
    assert found["Job"] == [f"{name}-trainer"], found
    assert found["Service"] == [f"{name}-rollout", f"{name}-trainer"], found
    assert found["ConfigMap"] == [f"{name}-config"], found
    return found


def settled_pods(cluster: Cluster, namespace: str, name: str, count: int) -> list[str] | None:
    """The names of the RLJob's pods once exactly ``count`` exist and all run."""
    listed = client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=f"treetrain.dev/rljob={name}")
    live = [p for p in listed.items if not p.metadata.deletion_timestamp]
    running = len(live) == count and all(p.status.phase == "Running" for p in live)
    return sorted(p.metadata.name for p in live) if running else None


def reaches_running(cluster: Cluster, namespace: str, name: str, since: float, timeout: float) -> tuple[float, float]:
    """Seconds from ``since`` until the operator first wrote the RLJob's status (it reacted),
    and until it was Running (the whole control plane worked)."""
    deadline = since + timeout
    reacted: float | None = None
    while time.monotonic() < deadline:
        status = get(cluster, namespace, name).get("status") or {}
        if status and reacted is None:
            reacted = time.monotonic() - since
        if status.get("phase") == "Running":
            return reacted or 0.0, time.monotonic() - since
        time.sleep(0.3)
    raise AssertionError(f"{name} not Running after {timeout:.0f} s (status written after {reacted} s)")


def launcher(cluster: Cluster, *args: str) -> None:
    subprocess.run([sys.executable, str(LAUNCHER), *args, "--dir", str(cluster.dir)], check=True, timeout=180)


# ---------------------------------------------------------------------------
# Tests


@pytest.mark.slow
def test_sigkill_mid_reconcile_of_twenty_rljobs_then_restart(
    cluster: Cluster, namespace: str, operator: OperatorProcess, extra_gpus: None
) -> None:
    names = [f"kill-{i:02d}" for i in range(20)]
    for name in names:
        create(cluster, namespace, rljob(name, **SMALL))
    # Kill it as soon as it is writing children: most RLJobs are then half done or not started.
    apps = client.AppsV1Api(cluster.api)
    wait_for("first StatefulSet", lambda: apps.list_namespaced_stateful_set(namespace).items, timeout=120)
    operator.kill()
    killed = time.monotonic()
    items = custom(cluster).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    running = sum((o.get("status") or {}).get("phase") == "Running" for o in items)
    with_sts = len(apps.list_namespaced_stateful_set(namespace).items)
    operator.start()
    wait_for("20 RLJobs Running after the restart", lambda: all_running(cluster, namespace, names), timeout=300)
    print(f"\nSIGKILL with {running}/20 Running and {with_sts}/20 StatefulSets; all 20 Running "
          f"{time.monotonic() - killed:.1f} s after the kill (operator start included)")  # fmt: skip
    for name in names:
        exactly_once(cluster, namespace, name)
        wait_for(f"{name}: 2 pods", lambda n=name: settled_pods(cluster, namespace, n, 2))  # type: ignore[misc]
        status = get(cluster, namespace, name)["status"]
        assert status["restarts"] == 0 and status["gpus"] == 2
        for kind in ("Valid", "Running"):
            assert cond(status, kind)["status"] == "True", status["conditions"]
    operator.assert_alive_and_quiet()


@pytest.mark.slow
def test_api_server_stopped_for_30_s_while_the_operator_runs(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("before", **SMALL))
    wait_for("before Running", phase_is(cluster, namespace, "before", "Running"))
    # One RLJob whose next pass comes during the outage: its trainer failed, the restart waits
    # out a 10 s backoff. That pass fails while the API server is away (each try one line).
    create(cluster, namespace, rljob("flaky", restartBackoffSeconds=10, maxRestarts=5, **SMALL))
    wait_for("flaky Running", phase_is(cluster, namespace, "flaky", "Running"))
    label_pods(cluster, namespace, trainer_selector("flaky", 0), FAIL)
    wait_for("flaky restart 1 recorded", lambda: get(cluster, namespace, "flaky")["status"].get("restarts") == 1)
    stopping = time.monotonic()
    launcher(cluster, "apiserver", "stop")
    try:
        # The outage itself (not a wait for a condition): the operator must outlive it.
        outage_end = time.monotonic() + 30
        while time.monotonic() < outage_end:
            assert operator.proc is not None and operator.proc.poll() is None, operator.output()[-3000:]
            time.sleep(1)
    finally:
        launcher(cluster, "apiserver", "start")
    back = time.monotonic()
    create(cluster, namespace, rljob("after", **SMALL))
    reacted, running = reaches_running(cluster, namespace, "after", back, timeout=240)
    print(f"\nAPI server away {back - stopping:.0f} s (stop, 30 s, start): an RLJob created after it came back had "
          f"its status written in {reacted:.1f} s and was Running in {running:.1f} s")  # fmt: skip
    for name in ("before", "after"):
        exactly_once(cluster, namespace, name)
        wait_for(f"{name}: 2 pods", lambda n=name: settled_pods(cluster, namespace, n, 2))  # type: ignore[misc]
        assert get(cluster, namespace, name)["status"]["restarts"] == 0
    assert cond(get(cluster, namespace, "before")["status"], "Running")["status"] == "True"
    text = operator.output()
    assert not [line for line in text.splitlines() if "the operator stops" in line]
    assert operator.proc is not None and operator.proc.poll() is None and operator.healthy()
    # One line per failure: the outage logged 64 tracebacks before.
    assert "Traceback" not in text, text[-3000:]
    failures = [line for line in text.splitlines() if "failed: the API server cannot be reached" in line]
    print(f"{len(failures)} one-line reconcile failures logged during the outage")
    assert failures, text[-3000:]
    wait_for("flaky Running again", phase_is(cluster, namespace, "flaky", "Running"), timeout=240)


def test_a_statefulset_and_a_job_deleted_by_hand_come_back(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("hands", **SMALL))
    wait_for("hands Running", phase_is(cluster, namespace, "hands", "Running"))
    before = exactly_once(cluster, namespace, "hands")
    # kubectl's default cascade (background): the pods go with their owner.
    cluster.run("kubectl", "delete", "-n", namespace, "statefulset/hands-rollout", "job/hands-trainer", "--wait=false")
    deleted = time.monotonic()
    apps, batch = client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)

    def back() -> bool:
        sts = apps.list_namespaced_stateful_set(namespace, label_selector="treetrain.dev/rljob=hands").items
        jobs = batch.list_namespaced_job(namespace, label_selector="treetrain.dev/rljob=hands").items
        return len(sts) == 1 and len(jobs) == 1 and not sts[0].metadata.deletion_timestamp

    wait_for("StatefulSet and Job recreated", back, timeout=120)
    recreated = time.monotonic() - deleted
    wait_for("hands Running again", lambda: settled_pods(cluster, namespace, "hands", 2) and
             phase_is(cluster, namespace, "hands", "Running")(), timeout=120)  # fmt: skip
    print(f"\nStatefulSet and Job deleted by hand: recreated after {recreated:.1f} s, "
          f"Running again after {time.monotonic() - deleted:.1f} s")  # fmt: skip
    after = exactly_once(cluster, namespace, "hands")
    assert after["Pod"] != before["Pod"]  # new pods: the old ones went with their owners
    status = get(cluster, namespace, "hands")["status"]
    assert status["restarts"] == 0 and cond(status, "Running")["status"] == "True"
    operator.assert_alive_and_quiet()


def test_engines_removed_and_resized_while_running(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    spec = {**SMALL, "additionalRollouts": [{"name": "small", "backend": "sglang:d1"}]}
    create(cluster, namespace, rljob("edit", **spec))
    wait_for("edit Running", phase_is(cluster, namespace, "edit", "Running"))
    apps = client.AppsV1Api(cluster.api)
    assert {s.metadata.name for s in apps.list_namespaced_stateful_set(namespace).items} == {
        "edit-rollout", "edit-rollout-small",
    }  # fmt: skip
    patch = custom(cluster).patch_namespaced_custom_object

    # An engine removed: its servers go and stop being counted.
    patch(GROUP, VERSION, namespace, PLURAL, "edit", {"spec": {"additionalRollouts": None}})
    edited = time.monotonic()
    wait_for("rollout-small torn down", lambda: settled_pods(cluster, namespace, "edit", 2)
             and [s.metadata.name for s in apps.list_namespaced_stateful_set(namespace).items] == ["edit-rollout"],
             timeout=120)  # fmt: skip
    print(f"\nengine removed: torn down in {time.monotonic() - edited:.1f} s")
    core = client.CoreV1Api(cluster.api)
    wait_for("its Service deleted", lambda: "edit-rollout-small" not in
             {s.metadata.name for s in core.list_namespaced_service(namespace).items}, timeout=60)  # fmt: skip
    status = wait_for("status without it", lambda: (s := get(cluster, namespace, "edit")["status"])["gpus"] == 2
                      and s["phase"] == "Running" and s)  # fmt: skip
    assert set(status["allocation"]) == {"rollout", "actor"}

    # The rollout backend changed: the StatefulSet follows at once (sglang:d1 -> sglang:d2).
    patch(GROUP, VERSION, namespace, PLURAL, "edit", {"spec": {"rollout": {"backend": "sglang:d2"}}})
    edited = time.monotonic()
    wait_for("2 rollout servers", lambda: settled_pods(cluster, namespace, "edit", 3), timeout=120)
    status = wait_for("edit Running with 3 GPUs", lambda: (s := get(cluster, namespace, "edit")["status"])["gpus"] == 3
                      and s["phase"] == "Running" and s)  # fmt: skip
    print(f"rollout resized: Running with the new servers in {time.monotonic() - edited:.1f} s")
    assert status["allocation"]["rollout"]["backend"] == "sglang:d2"
    assert apps.read_namespaced_stateful_set("edit-rollout", namespace).spec.replicas == 2
    operator.assert_alive_and_quiet()


def test_a_trainer_change_while_it_runs_is_pending_until_the_next_gang(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("grow", restartBackoffSeconds=1, **SMALL))
    wait_for("grow Running", phase_is(cluster, namespace, "grow", "Running"))
    batch = client.BatchV1Api(cluster.api)
    uid = batch.read_namespaced_job("grow-trainer", namespace).metadata.uid
    patch = custom(cluster).patch_namespaced_custom_object
    patch(GROUP, VERSION, namespace, PLURAL, "grow", {"spec": {"actor": {"backend": "fsdp:d2"}}})

    def pending() -> Any:
        status = get(cluster, namespace, "grow")["status"]
        c = next((c for c in status["conditions"] if c["type"] == "SpecChangePending"), None)
        return status if c and c["status"] == "True" and status["observedGeneration"] == 2 else None

    status = wait_for("SpecChangePending=True", pending)
    c = cond(status, "SpecChangePending")
    assert "actor fsdp:d1 -> fsdp:d2 (1 -> 2 GPUs)" in c["message"], c
    # The status describes what runs: the 1-GPU trainer, Running.
    assert status["allocation"]["actor"]["backend"] == "fsdp:d1" and status["gpus"] == 2
    assert status["phase"] == "Running"
    assert batch.read_namespaced_job("grow-trainer", namespace).metadata.uid == uid

    # The next gang (after a failure) starts from the new spec.
    label_pods(cluster, namespace, trainer_selector("grow", 0), FAIL)

    def applied() -> Any:
        status = get(cluster, namespace, "grow")["status"]
        return status if status["phase"] == "Running" and status.get("restarts") == 1 else None

    status = wait_for("grow restarted with the new trainer", applied, timeout=120)
    assert status["allocation"]["actor"]["backend"] == "fsdp:d2" and status["gpus"] == 3
    assert cond(status, "SpecChangePending")["status"] == "False"
    job = batch.read_namespaced_job("grow-trainer-r1", namespace)
    limits = job.spec.template.spec.containers[0].resources.limits
    assert limits["nvidia.com/gpu"] == "2"
    operator.assert_alive_and_quiet()


def test_a_burst_of_child_events_from_many_threads(cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    names = [f"burst-{i}" for i in range(6)]
    for name in names:
        create(cluster, namespace, rljob(name, **SMALL))
    wait_for("6 RLJobs Running", lambda: all_running(cluster, namespace, names), timeout=180)
    core, apps = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api)
    targets: list[tuple[str, str]] = []
    for name in names:
        found = children(cluster, namespace, name)
        targets += [(kind, child) for kind in ("Pod", "StatefulSet", "Service", "ConfigMap") for child in found[kind]]
    patchers = {
        "Pod": core.patch_namespaced_pod,
        "StatefulSet": apps.patch_namespaced_stateful_set,
        "Service": core.patch_namespaced_service,
        "ConfigMap": core.patch_namespaced_config_map,
    }

    def touch(i: int) -> None:
        kind, child = targets[i % len(targets)]
        body = {"metadata": {"labels": {"burst.test/n": str(i)}, "annotations": {"burst.test/at": str(time.time())}}}
        patchers[kind](child, namespace, body)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        done = pool.map(touch, range(PATCHES))
        create(cluster, namespace, rljob("late", **SMALL))  # made while the burst runs
        reacted, running = reaches_running(cluster, namespace, "late", started, timeout=240)
        list(done)
    burst = time.monotonic() - started
    print(f"\n{PATCHES} child patches from 16 threads in {burst:.1f} s ({PATCHES / burst:.0f}/s); an RLJob made as it began "
          f"had its status written after {reacted:.1f} s and was Running after {running:.1f} s")  # fmt: skip
    operator.assert_alive_and_quiet()
    for name in [*names, "late"]:
        exactly_once(cluster, namespace, name)
