"""Smoke tests of the test control plane: the real scheduler, controllers and garbage collector,
with kwok playing the kubelets of simulated GPU nodes."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from cluster_helpers import Cluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

T = TypeVar("T")
GPU = "nvidia.com/gpu"
TIMEOUT = 60.0


def job_with_condition(batch: client.BatchV1Api, ns: str, name: str, condition: str) -> client.V1Job:
    """Wait until Job ``name`` has ``condition`` (Complete, Failed) true; return its status."""

    def probe() -> client.V1Job | None:
        job = batch.read_namespaced_job_status(name, ns)
        conditions = job.status.conditions or []
        return job if any(c.type == condition and c.status == "True" for c in conditions) else None

    return wait_for(f"Job {name} {condition}", probe, timeout=TIMEOUT)


def maybe(read: Callable[[], T]) -> T | None:
    """`read()`, or None when the object does not exist."""
    try:
        return read()
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def gone(read: Callable[[], object]) -> bool:
    return maybe(read) is None


def container(name: str = "main", gpus: int = 0) -> client.V1Container:
    limits = {GPU: str(gpus)} if gpus else None
    return client.V1Container(
        name=name, image="treetrain/sim:none", resources=client.V1ResourceRequirements(limits=limits)
    )


def pod_phases(core: client.CoreV1Api, ns: str, selector: str) -> dict[str, str]:
    pods = core.list_namespaced_pod(ns, label_selector=selector).items
    return {p.metadata.name: p.status.phase for p in pods}


def test_nodes_are_simulated_gpu_nodes(cluster: Cluster) -> None:
    nodes = client.CoreV1Api(cluster.api).list_node().items
    gpu_nodes = [n for n in nodes if n.metadata.name.startswith("gpu-node-")]
    assert len(gpu_nodes) == 4
    for node in gpu_nodes:
        assert node.status.allocatable[GPU] == "8"
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True"
        assert not node.spec.taints


def test_indexed_gpu_job_is_scheduled_runs_and_completes(cluster: Cluster, namespace: str) -> None:
    core, batch = client.CoreV1Api(cluster.api), client.BatchV1Api(cluster.api)
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(
            labels={"app": "trainer", "sim.treetrain.dev/succeed": "true"},
            annotations={"sim.treetrain.dev/run-for": "4s"},
        ),
        spec=client.V1PodSpec(restart_policy="Never", containers=[container(gpus=8)]),
    )
    job = client.V1Job(
        metadata=client.V1ObjectMeta(name="trainer"),
        spec=client.V1JobSpec(
            completions=4, parallelism=4, completion_mode="Indexed", backoff_limit=0, template=template
        ),
    )
    batch.create_namespaced_job(namespace, job)

    running = wait_for(
        "4 Running trainer pods",
        lambda: (
            pods
            if len(pods := core.list_namespaced_pod(namespace, label_selector="app=trainer").items) == 4
            and all(p.status.phase == "Running" for p in pods)
            else None
        ),
    )
    # One whole 8-GPU node per pod: the scheduler spread them over the 4 nodes.
    assert sorted(p.spec.node_name for p in running) == [f"gpu-node-{i}" for i in range(4)]
    indexes = sorted(p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in running)
    assert indexes == ["0", "1", "2", "3"]
    for pod in running:
        assert ipaddress.ip_address(pod.status.pod_ip).is_loopback, pod.status.pod_ip
        assert all(s.ready for s in pod.status.container_statuses)

    done = job_with_condition(batch, namespace, "trainer", "Complete")
    assert done.status.succeeded == 4
    assert done.status.completed_indexes == "0-3"
    assert set(pod_phases(core, namespace, "app=trainer").values()) == {"Succeeded"}


def test_pod_asking_for_too_many_gpus_stays_pending(cluster: Cluster, namespace: str) -> None:
    core = client.CoreV1Api(cluster.api)
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="greedy"),
        spec=client.V1PodSpec(containers=[container(gpus=9)]),
    )
    core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> client.V1PodCondition | None:
        status = core.read_namespaced_pod_status("greedy", namespace).status
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                return cond
        return None

    cond = wait_for("PodScheduled=False/Unschedulable", unschedulable)
    assert f"Insufficient {GPU}" in cond.message
    # Not a timed wait: a pod that fits, created after it, is scheduled and runs (the scheduler
    # went past the greedy one, and a new pod puts unschedulable ones back in its queue), and
    # the greedy pod still has no node.
    modest = client.V1Pod(
        metadata=client.V1ObjectMeta(name="modest"), spec=client.V1PodSpec(containers=[container(gpus=1)])
    )
    core.create_namespaced_pod(namespace, modest)
    wait_for("modest Running", lambda: core.read_namespaced_pod("modest", namespace).status.phase == "Running")
    pod = core.read_namespaced_pod("greedy", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_chosen_pod_can_be_made_to_fail(cluster: Cluster, namespace: str) -> None:
    core = client.CoreV1Api(cluster.api)
    for name in ("victim", "bystander"):
        pod = client.V1Pod(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PodSpec(restart_policy="Never", containers=[container(gpus=1)]),
        )
        core.create_namespaced_pod(namespace, pod)
    for name in ("victim", "bystander"):
        wait_for(f"{name} Running", lambda n=name: core.read_namespaced_pod(n, namespace).status.phase == "Running")  # type: ignore[misc]

    patch = {
        "metadata": {
            "labels": {"sim.treetrain.dev/fail": "true"},
            "annotations": {"sim.treetrain.dev/exit-code": "3", "sim.treetrain.dev/reason": "OOMKilled"},
        }
    }
    core.patch_namespaced_pod("victim", namespace, patch)
    failed = wait_for(
        "victim Failed",
        lambda: p if (p := core.read_namespaced_pod("victim", namespace)).status.phase == "Failed" else None,
    )
    terminated = failed.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (3, "OOMKilled")  # the exit it was told, no other
    # No stray exit, checked without a timed wait: the unlabelled twin started with it still runs
    # after the whole time the victim took to fail.
    bystander = core.read_namespaced_pod("bystander", namespace)
    assert bystander.status.phase == "Running"
    assert bystander.status.container_statuses[0].state.terminated is None


def test_job_with_failing_pod_fails(cluster: Cluster, namespace: str) -> None:
    batch = client.BatchV1Api(cluster.api)
    template = client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels={"sim.treetrain.dev/fail": "true"}),
        spec=client.V1PodSpec(restart_policy="Never", containers=[container(gpus=1)]),
    )
    job = client.V1Job(
        metadata=client.V1ObjectMeta(name="doomed"),
        spec=client.V1JobSpec(backoff_limit=0, template=template),
    )
    batch.create_namespaced_job(namespace, job)
    failed = job_with_condition(batch, namespace, "doomed", "Failed")
    assert failed.status.failed == 1


def test_deleting_owner_garbage_collects_children(cluster: Cluster, namespace: str) -> None:
    core, apps = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api)
    labels = {"app": "rollout"}
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="rollout"),
        spec=client.V1DeploymentSpec(
            replicas=2,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[container(gpus=2)]),
            ),
        ),
    )
    apps.create_namespaced_deployment(namespace, deployment)
    wait_for(
        "2 Running rollout pods",
        lambda: list(pod_phases(core, namespace, "app=rollout").values()) == ["Running"] * 2,
    )
    rs = apps.list_namespaced_replica_set(namespace).items
    assert len(rs) == 1 and rs[0].metadata.owner_references[0].kind == "Deployment"

    # An object owned by a ConfigMap, to check the collector on plain owner references too.
    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner")))
    ref = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid, block_owner_deletion=True
    )
    child_meta = client.V1ObjectMeta(name="child", owner_references=[ref])
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=child_meta))

    apps.delete_namespaced_deployment("rollout", namespace, propagation_policy="Background")
    core.delete_namespaced_config_map("owner", namespace, propagation_policy="Foreground")
    wait_for("ReplicaSet collected", lambda: not apps.list_namespaced_replica_set(namespace).items)
    wait_for("rollout pods collected", lambda: not pod_phases(core, namespace, "app=rollout"))
    wait_for("child ConfigMap collected", lambda: gone(lambda: core.read_namespaced_config_map("child", namespace)))
    wait_for("owner ConfigMap deleted", lambda: gone(lambda: core.read_namespaced_config_map("owner", namespace)))


def test_deleting_a_namespace_finishes(cluster: Cluster) -> None:
    core, apps = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api)
    ns = "doomed-namespace"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    labels = {"app": "x"}
    apps.create_namespaced_deployment(
        ns,
        client.V1Deployment(
            metadata=client.V1ObjectMeta(name="x"),
            spec=client.V1DeploymentSpec(
                replicas=1,
                selector=client.V1LabelSelector(match_labels=labels),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(containers=[container()]),
                ),
            ),
        ),
    )
    core.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="c")))
    wait_for("x pod Running", lambda: list(pod_phases(core, ns, "app=x").values()) == ["Running"])

    core.delete_namespace(ns)
    wait_for("namespace deleted", lambda: gone(lambda: core.read_namespace(ns)))


def test_statefulset_with_headless_service_has_stable_names(cluster: Cluster, namespace: str) -> None:
    core, apps = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api)
    labels = {"app": "rollout"}
    core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="rollout"),
            spec=client.V1ServiceSpec(
                cluster_ip="None",
                selector=labels,
                ports=[client.V1ServicePort(name="http", port=30000)],
            ),
        ),
    )
    apps.create_namespaced_stateful_set(
        namespace,
        client.V1StatefulSet(
            metadata=client.V1ObjectMeta(name="rollout"),
            spec=client.V1StatefulSetSpec(
                service_name="rollout",
                replicas=3,
                pod_management_policy="Parallel",
                selector=client.V1LabelSelector(match_labels=labels),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels=labels),
                    spec=client.V1PodSpec(containers=[container(gpus=4)]),
                ),
            ),
        ),
    )
    names = ["rollout-0", "rollout-1", "rollout-2"]
    wait_for(
        "3 Running rollout pods",
        lambda: pod_phases(core, namespace, "app=rollout") == dict.fromkeys(names, "Running"),
    )
    for name in names:
        pod = core.read_namespaced_pod(name, namespace)
        # Stable DNS identity: <hostname>.<subdomain>.<namespace>.svc
        assert (pod.spec.hostname, pod.spec.subdomain) == (name, "rollout")
    sts = wait_for(
        "StatefulSet 3 ready",
        lambda: (
            s if (s := apps.read_namespaced_stateful_set("rollout", namespace)).status.ready_replicas == 3 else None
        ),
    )
    assert sts.status.current_replicas == 3

    old_uid = core.read_namespaced_pod("rollout-1", namespace).metadata.uid
    core.delete_namespaced_pod("rollout-1", namespace)

    def recreated() -> client.V1Pod | None:
        pod = maybe(lambda: core.read_namespaced_pod("rollout-1", namespace))
        if pod and pod.metadata.uid != old_uid and pod.status.phase == "Running":
            return pod
        return None

    wait_for("rollout-1 recreated under its name", recreated)


def test_token_and_endpointslice_controllers_run(cluster: Cluster, namespace: str) -> None:
    core, discovery = client.CoreV1Api(cluster.api), client.DiscoveryV1Api(cluster.api)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="operator"))
    )
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name="operator-token", annotations={"kubernetes.io/service-account.name": "operator"}
        ),
        type="kubernetes.io/service-account-token",
    )
    core.create_namespaced_secret(namespace, secret)
    wait_for(
        "a token in the service-account Secret",
        lambda: (core.read_namespaced_secret("operator-token", namespace).data or {}).get("token"),
    )

    # A Service without Ready pods: the endpointslice controller writes its (empty) slice. Slices
    # with pod addresses cannot be written here: pod IPs are loopback (see docs/cluster.md).
    core.create_namespaced_service(
        namespace,
        client.V1Service(
            metadata=client.V1ObjectMeta(name="idle"),
            spec=client.V1ServiceSpec(selector={"app": "none"}, ports=[client.V1ServicePort(port=80)]),
        ),
    )
    wait_for(
        "EndpointSlice of Service idle",
        lambda: (
            discovery.list_namespaced_endpoint_slice(namespace, label_selector="kubernetes.io/service-name=idle").items
        ),
    )


def test_kubectl_client_and_server_versions_match(cluster: Cluster) -> None:
    res = cluster.run("kubectl", "version", "--output=json")
    versions = json.loads(res.stdout)
    client_v, server_v = versions["clientVersion"]["gitVersion"], versions["serverVersion"]["gitVersion"]
    assert client_v == server_v
    assert client_v.startswith("v1.") and "master" not in client_v and "dirty" not in client_v
    assert "WARNING" not in res.stderr, res.stderr


def test_helm_version_and_install(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    res = cluster.run("helm", "version", "--template={{.Version}}")
    assert res.stdout.startswith("v3."), res.stdout
    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text('apiVersion: v2\nname: smoke\nversion: 0.1.0\nkubeVersion: ">=1.30.0-0"\n')
    (chart / "templates" / "deployment.yaml").write_text(
        """apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: 1
  selector:
    matchLabels: {app: smoke}
  template:
    metadata:
      labels: {app: smoke}
    spec:
      containers:
      - name: main
        image: treetrain/sim:none
"""
    )
    cluster.run("helm", "install", "smoke", str(chart), "--namespace", namespace, "--wait", "--timeout=60s")
    listed = json.loads(cluster.run("helm", "list", "--namespace", namespace, "--output=json").stdout)
    assert [(r["name"], r["status"]) for r in listed] == [("smoke", "deployed")]
    cluster.run("helm", "uninstall", "smoke", "--namespace", namespace, "--wait")


def test_every_listener_is_on_loopback(cluster: Cluster) -> None:
    state = json.loads((cluster.dir / "state.json").read_text())
    pids = {str(p["pid"]) for p in state["processes"].values()}
    listeners = []
    for line in (
        Path("/proc/net/tcp").read_text().splitlines()[1:] + Path("/proc/net/tcp6").read_text().splitlines()[1:]
    ):
        fields = line.split()
        if fields[3] == "0A":  # LISTEN
            listeners.append((fields[1], fields[9]))  # local address, inode
    owned = []
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        inodes = set()
        for fd in fds.iterdir():
            target = str(fd.readlink()) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        owned += [addr for addr, inode in listeners if inode in inodes]
    assert owned, "found no listening socket of the cluster processes"
    loopback_v4 = "0100007F"  # 127.0.0.1 in /proc/net/tcp byte order
    assert all(addr.split(":")[0] == loopback_v4 for addr in owned), owned
