"""Each RLJob's NetworkPolicy and API-key Secret on the real control plane: the operator, under
exactly its RBAC rules, creates both (the kube-apiserver validates the policy), owned by the
RLJob; the policies read back from the API server are evaluated against the labels of the real
pods the StatefulSet and Job controllers created, and against pods that must be refused.

Enforcement itself needs a network plugin that implements NetworkPolicy (Calico, Cilium, ...);
the test cluster has none, so nothing here sends a packet: ``netpol_eval`` reads the policies
as such a plugin would. Loopback only: no pod, node or Service address is dialled."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_helpers import Cluster, operator_account, scratch_namespace, wait_for
from kubernetes import client
from netpol_eval import Pod, admitted
from rljob_helpers import EXAMPLE, ROOT, rljob

from rljob_operator.models import GROUP, PLURAL, VERSION
from rljob_operator.network import NetworkSettings
from rljob_operator.policy import Limits
from rljob_operator.rbac import RULES
from rljob_operator.runner import make_controller, serve

pytestmark = pytest.mark.cluster

SERVER_PORT, RENDEZVOUS_PORT, WEIGHT_SYNC_PORT, METRICS_PORT = 30000, 29500, 29600, 9400
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}


@pytest.fixture(scope="module")
def monitoring(cluster: Cluster) -> Iterator[str]:
    """The namespace Prometheus runs in (its name is its kubernetes.io/metadata.name label)."""
    with scratch_namespace(cluster.api, "mon") as name:
        yield name


@pytest.fixture(scope="module")
def operator(cluster: Cluster, monitoring: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The operator in this process, with a token bound to exactly its RBAC rules and the
    Prometheus peer the chart passes as --metrics-from."""
    path = ROOT / "crds" / "rljob.yaml"
    cluster.run("kubectl", "apply", "--server-side", "-f", str(path))
    cluster.run("kubectl", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": monitoring}},
        "podSelector": {"matchLabels": PROMETHEUS_LABELS},
    }
    with operator_account(cluster.api, cluster.kubeconfig, "rljob-netpol", RULES,
                          tmp_path_factory.mktemp("netpol") / "kubeconfig") as kubeconfig:  # fmt: skip
        controller = make_controller(str(kubeconfig), Limits(network=NetworkSettings(metrics_from=peer)))
        stop, ready = threading.Event(), threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(serve(controller, namespaces=[], stop_flag=stop, ready_flag=ready)),
            daemon=True,
        )
        thread.start()
        assert ready.wait(120), "the operator did not become ready in 120 s"
        yield
        stop.set()
        thread.join(60)
        assert not thread.is_alive(), "the operator did not stop in 60 s"


def _rljob(name: str) -> dict[str, Any]:
    return rljob(name, rollout={"backend": "sglang:d1t1"}, actor={**EXAMPLE["spec"]["actor"], "backend": "fsdp:d1"})


def _pod(core: client.CoreV1Api, namespace: str, name: str, labels: dict[str, str]) -> None:
    """A plain pod (never run by anything: the kwok nodes only simulate it)."""
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="example.invalid/none")]),
    )
    core.create_namespaced_pod(namespace, body)


def _as_pod(pod: client.V1Pod) -> Pod:
    ports = {p.name: p.container_port for c in pod.spec.containers for p in (c.ports or []) if p.name}
    return Pod(pod.metadata.name, pod.metadata.namespace, dict(pod.metadata.labels or {}), ports)


def test_rljob_network_policy_admits_its_own_pods_and_prometheus_only(
    cluster: Cluster, operator: None, namespace: str, monitoring: str
) -> None:
    core, net = client.CoreV1Api(cluster.api), client.NetworkingV1Api(cluster.api)
    custom = client.CustomObjectsApi(cluster.api)
    for name in ("a", "b"):
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _rljob(name))
    # Pods that must be refused: unlabelled in the namespace, and a copy of a's labels in another
    # namespace; and Prometheus, which must reach the metrics port only.
    with scratch_namespace(cluster.api, "x") as elsewhere:
        _pod(core, namespace, "stranger", {})
        _pod(core, monitoring, "prometheus", PROMETHEUS_LABELS)

        def pods_of(rljob: str) -> dict[str, Pod] | None:
            found = core.list_namespaced_pod(namespace, label_selector=f"{GROUP}/rljob={rljob}").items
            by_component = {p.metadata.labels[f"{GROUP}/component"]: _as_pod(p) for p in found}
            return by_component if set(by_component) == {"rollout", "actor"} else None

        # Created by the StatefulSet and Job controllers from the operator's templates.
        a = wait_for("RLJob a's rollout and trainer pods", lambda: pods_of("a"), timeout=180)
        b = wait_for("RLJob b's rollout and trainer pods", lambda: pods_of("b"), timeout=180)
        _pod(core, elsewhere, "impostor", a["actor"].labels)

        def policies() -> list[dict[str, Any]] | None:
            items = [
                cluster.api.sanitize_for_serialization(p) for p in net.list_network_policy_for_all_namespaces().items
            ]
            names = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in items}
            return items if {(namespace, "a-network"), (namespace, "b-network")} <= names else None

        applied = wait_for("the RLJobs' NetworkPolicies", policies, timeout=120)
        rljob_a = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "a")
        (policy,) = [p for p in applied if p["metadata"]["name"] == "a-network"]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == rljob_a["metadata"]["uid"]
        assert policy["metadata"]["labels"]["treetrain.dev/rljob"] == "a"
        assert policy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "rljob-operator"

        namespaces = {n.metadata.name: dict(n.metadata.labels or {}) for n in core.list_namespace().items}
        stranger = _as_pod(core.read_namespaced_pod("stranger", namespace))
        impostor = _as_pod(core.read_namespaced_pod("impostor", elsewhere))
        prometheus = _as_pod(core.read_namespaced_pod("prometheus", monitoring))

        def ok(src: Pod, dst: Pod, port: int) -> bool:
            return admitted(applied, namespaces, src, dst, port)

        # The RLJob's own pods: the server port, the torchrun rendezvous, the weight-sync rendezvous.
        assert a["actor"].ports["rdzv"] == RENDEZVOUS_PORT and a["actor"].ports["weight-sync"] == WEIGHT_SYNC_PORT
        assert ok(a["actor"], a["rollout"], SERVER_PORT)
        assert ok(a["rollout"], a["actor"], WEIGHT_SYNC_PORT) and ok(a["actor"], a["actor"], RENDEZVOUS_PORT)
        # Prometheus: the trainer's metrics port, nothing else.
        assert ok(prometheus, a["actor"], METRICS_PORT)
        assert not ok(prometheus, a["actor"], WEIGHT_SYNC_PORT) and not ok(prometheus, a["rollout"], SERVER_PORT)
        # Refused: another RLJob's pods, an unlabelled pod, a pod of another namespace with a's labels.
        for src in (b["actor"], b["rollout"], stranger, impostor):
            for dst, port in (
                (a["rollout"], SERVER_PORT),
                (a["actor"], WEIGHT_SYNC_PORT),
                (a["actor"], RENDEZVOUS_PORT),
            ):
                assert not ok(src, dst, port), f"{src.namespace}/{src.name} reaches {dst.name}:{port}"
        # And the other way round: a cannot reach b's servers.
        assert not ok(a["actor"], b["rollout"], SERVER_PORT)


def test_rljob_api_key_secret_is_random_owned_referenced_and_never_rewritten(
    cluster: Cluster, operator: None, namespace: str
) -> None:
    core, custom = client.CoreV1Api(cluster.api), client.CustomObjectsApi(cluster.api)
    created = [
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _rljob(n)) for n in ("k1", "k2")
    ]
    secrets = [wait_for(f"Secret {n}-api-key", lambda n=n: _secret(core, namespace, f"{n}-api-key"), timeout=120)
               for n in ("k1", "k2")]  # fmt: skip
    keys = [s.data["api-key"] for s in secrets]
    assert keys[0] != keys[1] and all(len(k) >= 40 for k in keys)  # base64 of 43 random characters
    for secret, owner in zip(secrets, created, strict=True):
        assert secret.metadata.owner_references[0].uid == owner["metadata"]["uid"]
    # The pods read it by reference: the key is not in any template.
    pods = wait_for("k1's pods", lambda: core.list_namespaced_pod(namespace, label_selector=f"{GROUP}/rljob=k1").items
                    if len(core.list_namespaced_pod(namespace, label_selector=f"{GROUP}/rljob=k1").items) == 2 else None,
                    timeout=180)  # fmt: skip
    for pod in pods:
        refs = {e.name: e.value_from.secret_key_ref.name for e in pod.spec.containers[0].env if e.value_from
                and e.value_from.secret_key_ref}  # fmt: skip
        assert refs["TREETRAIN_ROLLOUT_API_KEY"] == "k1-api-key"
        assert all(keys[0] not in str(e.value) for e in pod.spec.containers[0].env)
    # A spec change makes the operator reconcile again: the Secret keeps its key and its version.
    version = secrets[0].metadata.resource_version
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "k1", {"spec": {"checkpoint": {"intervalSteps": 7}}}
    )

    def observed() -> bool | None:
        rljob = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "k1")
        return rljob.get("status", {}).get("observedGeneration") == rljob["metadata"]["generation"] or None

    wait_for("the operator to reconcile the edited RLJob", observed, timeout=120)
    again = core.read_namespaced_secret("k1-api-key", namespace)
    assert again.data["api-key"] == keys[0] and again.metadata.resource_version == version


def _secret(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Secret | None:
    try:
        found: client.V1Secret = core.read_namespaced_secret(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return found
