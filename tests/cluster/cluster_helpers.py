"""Small helpers shared by the cluster tests (polling, loopback ports and HTTP, an operator's kubeconfig)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client

T = TypeVar("T")


@dataclass(frozen=True)
class Cluster:
    dir: Path
    kubeconfig: Path
    bin: Path
    env: dict[str, str]  # os.environ plus KUBECONFIG and PATH, for kubectl and helm
    api: client.ApiClient

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a tool from the cluster's bin directory (kubectl, helm) against the cluster."""
        return subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 60.0) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def http_get(url: str) -> tuple[int, str]:
    """GET a loopback URL: (status, body), or (0, "") when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # loopback only
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # a busy process may not answer in 2 s
        return 0, ""


def service_account_kubeconfig(
    api: Any, admin_kubeconfig: Path, namespace: str, name: str, rules: list[dict[str, Any]], path: Path
) -> Path:
    """Create namespace ``namespace`` (if missing), ServiceAccount ``name`` in it and a
    ClusterRole + binding ``name`` holding only ``rules``; write a kubeconfig with that account's
    token to ``path``: the operator then runs with exactly the permissions the chart grants."""
    from kubernetes import client

    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    except client.ApiException as err:
        if err.status != 409:
            raise
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name)))
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        }
    )
    token = core.create_namespaced_service_account_token(
        name, namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    ).status.token
    entry = yaml.safe_load(admin_kubeconfig.read_text())["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [entry],
                "users": [{"name": name, "user": {"token": token}}],
                "contexts": [{"name": name, "context": {"cluster": entry["name"], "user": name}}],
                "current-context": name,
            }
        )
    )
    return path


def gpus_in_use(api: Any) -> int:
    """GPUs that scheduled, unfinished pods hold (limits of ``nvidia.com/gpu``)."""
    from kubernetes import client

    used = 0
    for pod in client.CoreV1Api(api).list_pod_for_all_namespaces().items:
        if pod.status.phase in ("Succeeded", "Failed") or not pod.spec.node_name:
            continue
        for container in pod.spec.containers:
            used += int(((container.resources and container.resources.limits) or {}).get("nvidia.com/gpu", 0))
    return used


@contextlib.contextmanager
def gpu_room(api: Any, gpus: int, prefix: str, cidr_offset: int) -> Iterator[None]:
    """Simulated GPU nodes like the launcher's, added until ``gpus`` GPUs are free beside what
    earlier tests' pods still hold (plus one node to spare); removed at the end. Node ``i``
    gets pod CIDR ``127.3.{cidr_offset + i}.0/24``."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    nodes = core.list_node(label_selector="nvidia.com/gpu.present=true").items
    template = nodes[0].to_dict()
    per_node = int(template["status"]["allocatable"]["nvidia.com/gpu"])
    free = sum(int(n.status.allocatable["nvidia.com/gpu"]) for n in nodes) - gpus_in_use(api)
    extra = [f"{prefix}-{i}" for i in range(max(0, -(-(gpus - free) // per_node)) + 1)]
    for i, name in enumerate(extra):
        core.create_node(
            {
                "metadata": {
                    "name": name,
                    "labels": {**template["metadata"]["labels"], "kubernetes.io/hostname": name},
                    "annotations": template["metadata"]["annotations"],
                },
                "spec": {"podCIDR": f"127.3.{cidr_offset + i}.0/24"},
                "status": {"capacity": template["status"]["capacity"],
                           "allocatable": template["status"]["allocatable"]},
            }
        )  # fmt: skip
    try:
        yield
    finally:
        for name in extra:
            core.delete_node(name)


@contextlib.contextmanager
def scratch_namespace(api: Any, prefix: str) -> Iterator[str]:
    """A fresh namespace ``PREFIX-<random>``, deleted afterwards (without waiting)."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        core.delete_namespace(name)


@contextlib.contextmanager
def operator_account(
    api: Any, admin_kubeconfig: Path, prefix: str, rules: list[dict[str, Any]], path: Path
) -> Iterator[Path]:
    """``service_account_kubeconfig`` under a fresh name ``PREFIX-<random>`` (namespace, account and
    ClusterRole), so test modules never collide; all three are deleted afterwards."""
    from kubernetes import client

    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    service_account_kubeconfig(api, admin_kubeconfig, name, name, rules, path)
    try:
        yield path
    finally:
        rbac = client.RbacAuthorizationV1Api(api)
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)
        client.CoreV1Api(api).delete_namespace(name)
