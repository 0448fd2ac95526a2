"""How the operator reaches the API server: the client (in a pod, its ServiceAccount; else a
kubeconfig) and the credentials kopf logs in with, the same identity."""

from __future__ import annotations

from dataclasses import dataclass

import kubernetes
from kubernetes.client import ApiClient, Configuration

# Connections kept to the API server for the reconcile workers and their parallel requests
# (the client's default, 5 per CPU, made them queue for a connection on a small node).
CONNECTIONS = 64


@dataclass(frozen=True)
class Credentials:
    """What kopf needs to log in with the same identity as this client."""

    server: str
    ca_path: str | None
    insecure: bool
    token: str | None
    certificate_path: str | None
    private_key_path: str | None


def load_client(kubeconfig: str | None = None) -> tuple[ApiClient, bool]:
    """In a pod: the ServiceAccount; else ``kubeconfig`` or $KUBECONFIG / ~/.kube/config.
    Returns the client and whether it is the in-cluster one."""
    cfg = Configuration()
    cfg.connection_pool_maxsize = CONNECTIONS
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            return ApiClient(cfg), True
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
    return ApiClient(cfg), False
