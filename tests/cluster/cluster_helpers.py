"""Small helpers shared by the cluster tests (polling, loopback ports and HTTP, an operator's kubeconfig)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


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


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """GET a loopback URL: (status, body), or (0, "") when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # loopback only
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError):
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
