"""How the operator reaches the API server: the client (in a pod, its ServiceAccount; else a
kubeconfig) and the credentials kopf logs in with, the same identity."""

from __future__ import annotations

import re
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

import kubernetes
from kubernetes.client import ApiClient, Configuration

from rljob_operator.models import GROUP, PLURAL, VERSION

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


def cannot_list_rljobs(c: Credentials, namespaces: list[str], timeout: float = 3.0) -> str | None:
    """None when the API server at ``c.server`` lists RLJobs for this identity in every watched
    namespace (all of them when ``namespaces`` is empty); else one line saying why not. The same
    address, certificate check and RBAC as kopf's watch: the operator's readiness."""
    ctx = ssl.create_default_context(cafile=c.ca_path)
    if c.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if c.certificate_path and c.private_key_path:
        ctx.load_cert_chain(c.certificate_path, c.private_key_path)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    base = f"{c.server.rstrip('/')}/apis/{GROUP}/{VERSION}"
    for path in [f"/namespaces/{ns}/{PLURAL}" for ns in namespaces] or [f"/{PLURAL}"]:
        req = urllib.request.Request(f"{base}{path}?limit=1")
        if c.token:
            req.add_header("Authorization", f"Bearer {c.token}")
        try:
            with opener.open(req, timeout=timeout) as resp:
                # Not parsed: an RLJob nested deeper than the json module recurses is still listed.
                if not re.search(rb'"kind"\s*:\s*"RLJobList"', resp.read()):
                    return f"GET {base}{path} did not answer an RLJobList"
        except urllib.error.HTTPError as e:
            return f"GET {base}{path}: HTTP {e.code} {e.reason}"
        except (OSError, ValueError) as e:  # refused, timed out, a certificate that does not match
            return f"GET {base}{path}: {getattr(e, 'reason', None) or e}"
    return None
