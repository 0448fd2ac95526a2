"""Ownership on the real control plane: the operator touches only what its RLJob controls.

Issue 21: objects that merely carried the operator's labels were deleted as stale children
(item 4); a ConfigMap deleted and made again by someone else under the child's name (what
``kubectl replace --force`` does) was taken over and later garbage-collected with the RLJob
(item 5); a status patched to a lie tore the rollout servers down or replaced a healthy
trainer (item 10). A Secret ``NAME-api-key`` made before the RLJob silently became its key and
was never owned (hostile-user review). The operator runs as a child process under exactly its
RBAC rules (the fixtures of operator_helpers.py); each ownership scenario runs 5 times.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from cluster_helpers import Cluster, wait_for
from kubernetes import client
from operator_helpers import OperatorProcess, kubeconfig, operator
from rljob_helpers import SMALL, create, custom, get, phase_is, rljob

from rljob_operator.models import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.cluster
# The operator in a child process under exactly its RBAC rules: operator_helpers' fixtures.
__all__ = ["kubeconfig", "operator"]

ROUNDS = 5


def labels(name: str, component: str) -> dict[str, str]:
    """The labels of a child of RLJob ``name``, which anyone may put on anything."""
    return {"app.kubernetes.io/managed-by": "rljob-operator", "treetrain.dev/rljob": name,
            "treetrain.dev/component": component}  # fmt: skip


def foreign_objects(cluster: Cluster, namespace: str, owner: str, tag: str) -> dict[str, str]:
    """A StatefulSet, a Service and a Job with the operator's labels for RLJob ``owner``, no
    ownerReference and no child's name; their uids by kind. They run nothing (0 replicas, suspended)."""
    core, apps, batch = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)
    name = f"{owner}-x{tag}"
    meta = {"name": name, "labels": labels(owner, "rollout")}
    pod: dict[str, Any] = {"metadata": {"labels": {"foreign": name}},
                           "spec": {"containers": [{"name": "c", "image": "busybox"}]}}  # fmt: skip
    sts = apps.create_namespaced_stateful_set(namespace, {"metadata": meta, "spec": {
        "replicas": 0, "serviceName": name, "selector": {"matchLabels": {"foreign": name}}, "template": pod}})  # fmt: skip
    svc = core.create_namespaced_service(namespace, {"metadata": meta, "spec": {
        "clusterIP": "None", "selector": {"foreign": name}, "ports": [{"port": 80}]}})  # fmt: skip
    job_meta = {"name": name, "labels": {**labels(owner, "actor"), "treetrain.dev/restart": "0"}}
    job = batch.create_namespaced_job(namespace, {"metadata": job_meta, "spec": {
        "suspend": True, "template": {**pod, "spec": {**pod["spec"], "restartPolicy": "Never"}}}})  # fmt: skip
    return {"StatefulSet": sts.metadata.uid, "Service": svc.metadata.uid, "Job": job.metadata.uid}


def live_uid(cluster: Cluster, namespace: str, kind: str, name: str) -> str | None:
    """The uid of the object, None when it is gone or being deleted."""
    read = {
        "StatefulSet": client.AppsV1Api(cluster.api).read_namespaced_stateful_set,
        "Service": client.CoreV1Api(cluster.api).read_namespaced_service,
        "Job": client.BatchV1Api(cluster.api).read_namespaced_job,
        "ConfigMap": client.CoreV1Api(cluster.api).read_namespaced_config_map,
    }[kind]
    try:
        obj = read(name, namespace)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
    return None if obj.metadata.deletion_timestamp else str(obj.metadata.uid)


def owner_uids(obj: Any) -> list[str]:
    return [r.uid for r in obj.metadata.owner_references or []]


def test_objects_with_only_the_labels_are_never_deleted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("own", **SMALL))
    wait_for("own Running", phase_is(cluster, namespace, "own", "Running"), timeout=120)
    core = client.CoreV1Api(cluster.api)
    made: dict[tuple[str, str], str] = {}
    started = time.monotonic()
    for i in range(ROUNDS):
        for kind, uid in foreign_objects(cluster, namespace, "own", str(i)).items():
            made[(kind, f"own-x{i}")] = uid
        # A pass that surely ran after they existed: the one that brings back a child deleted by hand
        # (it lists the children, deletes what it judges stale, then applies).
        before = live_uid(cluster, namespace, "Service", "own-rollout")
        core.delete_namespaced_service("own-rollout", namespace)
        wait_for("own-rollout recreated", lambda b=before: live_uid(cluster, namespace, "Service", "own-rollout")
                 not in (None, b), timeout=120)  # fmt: skip
        kept = {key: live_uid(cluster, namespace, *key) for key in made}
        assert kept == made, f"round {i}: foreign objects deleted: {[k for k in made if kept[k] != made[k]]}"
    print(f"\n{ROUNDS} rounds of a foreign StatefulSet, Service and Job with the labels: none deleted "
          f"({time.monotonic() - started:.1f} s)")  # fmt: skip
    assert get(cluster, namespace, "own")["status"]["phase"] == "Running"
    operator.assert_alive_and_quiet()


def refusal(cluster: Cluster, namespace: str, name: str) -> str | None:
    status = get(cluster, namespace, name).get("status") or {}
    for c in status.get("conditions") or []:
        if c["type"] == "ReconcileError" and c["status"] == "True":
            return str(c["message"])
    return None


def test_a_configmap_replaced_by_someone_else_is_never_adopted(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("repl", **SMALL))
    wait_for("repl Running", phase_is(cluster, namespace, "repl", "Running"), timeout=120)
    uid = get(cluster, namespace, "repl")["metadata"]["uid"]
    core = client.CoreV1Api(cluster.api)
    started = time.monotonic()
    for i in range(ROUNDS):
        data = {"mine": f"round {i}"}
        # Delete and create at once, as `kubectl replace --force` does. When the operator recreated
        # its own ConfigMap in between, the create is refused (409): delete that one and try again.
        for _ in range(30):
            core.delete_namespaced_config_map("repl-config", namespace)
            try:
                core.create_namespaced_config_map(namespace, {"metadata": {"name": "repl-config"}, "data": data})
                break
            except client.ApiException as err:
                if err.status != 409:
                    raise
        else:
            raise AssertionError("the operator recreated repl-config before every foreign create")

        def reacted(want: dict[str, str] = data) -> str | None:
            cm = core.read_namespaced_config_map("repl-config", namespace)
            if cm.data != want or uid in owner_uids(cm):
                return f"adopted: owners {owner_uids(cm)}, data keys {sorted(cm.data or {})}"
            return refusal(cluster, namespace, "repl")

        message = wait_for("the operator's answer to the foreign repl-config", reacted, timeout=120)
        assert "ConfigMap repl-config already exists" in message, f"round {i}: {message}"
        cm = core.read_namespaced_config_map("repl-config", namespace)
        assert cm.data == data and uid not in owner_uids(cm), f"round {i}: adopted: {cm.metadata}"
        if i == ROUNDS - 1:
            break
        # Make room again: the operator recreates its own, and the refusal clears.
        core.delete_namespaced_config_map("repl-config", namespace)

        def ours_back() -> bool:
            try:
                cm = core.read_namespaced_config_map("repl-config", namespace)
            except client.ApiException:
                return False
            return uid in owner_uids(cm) and refusal(cluster, namespace, "repl") is None

        wait_for("repl-config recreated by the operator", ours_back, timeout=360)
    print(f"\n{ROUNDS} rounds of repl-config replaced by a foreign ConfigMap: none adopted "
          f"({time.monotonic() - started:.1f} s)")  # fmt: skip
    # The foreign ConfigMap outlives the RLJob: it was never given the RLJob as its owner.
    custom(cluster).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "repl")
    wait_for("repl's children garbage-collected", lambda: live_uid(cluster, namespace, "StatefulSet", "repl-rollout")
             is None and live_uid(cluster, namespace, "Service", "repl-trainer") is None, timeout=120)  # fmt: skip
    assert core.read_namespaced_config_map("repl-config", namespace).data == {"mine": f"round {ROUNDS - 1}"}
    operator.assert_alive_and_quiet()


def test_a_status_patched_to_a_lie_is_corrected_and_drives_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    create(cluster, namespace, rljob("lie", **SMALL))
    wait_for("lie Running", phase_is(cluster, namespace, "lie", "Running"), timeout=120)
    children = {("StatefulSet", "lie-rollout"), ("Job", "lie-trainer")}
    uids = {key: live_uid(cluster, namespace, *key) for key in children}
    patch = custom(cluster).patch_namespaced_custom_object_status
    for lie in ({"phase": "Succeeded", "completionTime": "2020-01-01T00:00:00Z"}, {"restarts": 2},
                {"restarts": 2, "lastRestartTime": "2020-01-01T00:00:00Z"}):  # fmt: skip
        patch(GROUP, VERSION, namespace, PLURAL, "lie", {"status": lie})

        def corrected() -> Any:
            status = get(cluster, namespace, "lie").get("status") or {}
            return status if status.get("phase") == "Running" and status.get("restarts") == 0 else None

        status = wait_for(f"the status corrected after {lie}", corrected, timeout=60)
        assert "completionTime" not in status and "lastRestartTime" not in status, status
        assert {key: live_uid(cluster, namespace, *key) for key in children} == uids, lie
        assert live_uid(cluster, namespace, "Job", "lie-trainer-r2") is None
        assert live_uid(cluster, namespace, "Job", "lie-trainer-r3") is None
    operator.assert_alive_and_quiet()


def test_a_key_secret_made_before_the_rljob_is_refused_until_the_rljob_names_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    core = client.CoreV1Api(cluster.api)
    secret = core.create_namespaced_secret(namespace, {"metadata": {"name": "pre-api-key"},
                                                       "stringData": {"api-key": "chosen-by-someone-else"}})  # fmt: skip
    create(cluster, namespace, rljob("pre", **SMALL))
    message = wait_for("pre refused", lambda: refusal(cluster, namespace, "pre"), timeout=120)
    assert "Secret pre-api-key already exists" in message and "spec.apiKeySecret" in message, message

    def warned() -> list[str]:
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=pre").items
        return [e.message for e in events if e.type == "Warning" and "Secret pre-api-key" in (e.message or "")]

    wait_for("a warning event naming the Secret", warned, timeout=60)
    assert live_uid(cluster, namespace, "StatefulSet", "pre-rollout") is None
    assert live_uid(cluster, namespace, "Job", "pre-trainer") is None
    # Named on purpose: used as is, the refusal clears, and the Secret stays exactly its author's.
    custom(cluster).patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pre",
                                                   {"spec": {"apiKeySecret": {"name": "pre-api-key"}}})  # fmt: skip
    wait_for("pre Running", phase_is(cluster, namespace, "pre", "Running"), timeout=180)
    wait_for("the refusal cleared", lambda: refusal(cluster, namespace, "pre") is None, timeout=60)
    sts = client.AppsV1Api(cluster.api).read_namespaced_stateful_set("pre-rollout", namespace)
    refs = {e.value_from.secret_key_ref.name for c in sts.spec.template.spec.containers for e in c.env or []
            if e.value_from and e.value_from.secret_key_ref}  # fmt: skip
    assert refs == {"pre-api-key"}, refs
    after = core.read_namespaced_secret("pre-api-key", namespace)
    assert after.metadata.resource_version == secret.metadata.resource_version and not after.metadata.owner_references
    # Not the RLJob's: it outlives it.
    custom(cluster).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "pre")
    wait_for("pre's children garbage-collected",
             lambda: live_uid(cluster, namespace, "StatefulSet", "pre-rollout") is None, timeout=120)  # fmt: skip
    assert core.read_namespaced_secret("pre-api-key", namespace).metadata.uid == secret.metadata.uid
    operator.assert_alive_and_quiet()
