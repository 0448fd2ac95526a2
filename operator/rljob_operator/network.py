"""Who may reach an RLJob's pods, and the key its rollout servers ask for. Pure rendering; the
one impure step, drawing a fresh key, is :func:`with_fresh_key`, called by the API layer when it
creates the Secret (once: the Secret is never rewritten).

Children of RLJob ``NAME`` rendered here (see docs/install.md, "Network and API keys"):

    NAME-network    NetworkPolicy: ingress to every pod of the RLJob only from the pods of the
                    same RLJob (all ports: NCCL and Gloo pick ephemeral ports besides the server
                    port, the torchrun rendezvous and the weight-sync rendezvous), and from the
                    configured Prometheus pods to the metrics ports. Egress is not restricted.
    NAME-api-key    Secret: a random key, created once. Rollout servers require it (SGLang
                    ``--api-key``, vLLM ``VLLM_API_KEY``) and the trainer sends it as a bearer
                    token (``TREETRAIN_ROLLOUT_API_KEY``). Not rendered when ``spec.apiKeySecret``
                    names an existing Secret: the pods then read the key from that one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

API_KEY_ENV = "TREETRAIN_ROLLOUT_API_KEY"  # what trainer and rollout pods read the key from
API_KEY_FIELD = "api-key"  # the Secret's data key
# On the rendered Secret: the data key the API layer fills with a fresh random value at creation.
ANNOTATION_GENERATE = "treetrain.dev/generate"
KEY_BYTES = 32  # 256 bits, URL-safe base64 (43 characters)
PROTOCOL = "TCP"


@dataclass(frozen=True)
class NetworkSettings:
    """What the cluster admin configured (chart ``networkPolicy.*``; ``rljob operator`` flags).

    ``metrics_from`` is one NetworkPolicyPeer (``namespaceSelector`` and/or ``podSelector``):
    the Prometheus pods that may scrape the trainers' metrics port. None: nobody outside the
    RLJob reaches it. ``scrape_servers`` also opens the rollout servers' port to them: SGLang and
    vLLM serve ``/metrics`` on their API port, so this exposes their whole API to those pods."""

    enabled: bool = True
    metrics_from: dict[str, Any] | None = None  # a NetworkPolicyPeer (from parse_peer)
    scrape_servers: bool = False


_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def parse_peer(text: str) -> dict[str, Any]:
    """A NetworkPolicyPeer from JSON (``--metrics-from``): ``namespaceSelector`` and/or
    ``podSelector``, each a label selector. ValueError with one line naming the problem."""
    try:
        peer = json.loads(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not JSON; write a NetworkPolicy peer such as "
            '\'{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}\''
        ) from None
    if not isinstance(peer, dict) or not peer or set(peer) - {"namespaceSelector", "podSelector"}:
        raise ValueError(
            f"{text!r} must be an object with namespaceSelector and/or podSelector (label selectors), nothing else"
        )
    for key, selector in peer.items():
        problem = _selector_problem(selector)
        if problem:
            raise ValueError(f"{key}: {problem}")
    return peer


def _selector_problem(selector: Any) -> str | None:
    if not isinstance(selector, dict) or set(selector) - {"matchLabels", "matchExpressions"}:
        return "a label selector has only matchLabels and matchExpressions"
    labels = selector.get("matchLabels", {})
    if not isinstance(labels, dict):
        return "matchLabels must map label keys to values"
    for k, v in labels.items():
        if not _label_key(k) or not isinstance(v, str) or len(v) > 63 or not _LABEL_VALUE.fullmatch(v):
            return f"matchLabels {k!r}: {v!r} is not a valid label key and value"
    exprs = selector.get("matchExpressions", [])
    if not isinstance(exprs, list):
        return "matchExpressions must be a list"
    for e in exprs:
        if not isinstance(e, dict) or not _label_key(e.get("key")) or e.get("operator") not in _OPERATORS:
            return f"matchExpressions entry {e!r} needs a label key and an operator of {', '.join(_OPERATORS)}"
        values = e.get("values", [])
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            return f"matchExpressions entry {e!r}: values must be a list of strings"
        if (e["operator"] in ("In", "NotIn")) != bool(values):
            return f"matchExpressions entry {e!r}: In and NotIn need values, Exists and DoesNotExist none"
    return None


def _label_key(key: Any) -> bool:
    return isinstance(key, str) and len(key.rpartition("/")[2]) <= 63 and bool(_LABEL_KEY.fullmatch(key))


def network_policy(
    *,
    name: str,
    namespace: str,
    labels: dict[str, str],
    pods: dict[str, str],
    metrics_ports: list[int],
    server_ports: list[int],
    settings: NetworkSettings,
) -> dict[str, Any]:
    """The RLJob's NetworkPolicy: ``pods`` (labels every pod of the RLJob has) select both the
    pods it protects and the pods it admits on every port; the configured Prometheus peer gets
    the metrics ports (and the server ports with ``scrape_servers``)."""
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": dict(pods)}}]}]
    peer = settings.metrics_from
    if peer is not None:
        ports = sorted(set(metrics_ports) | (set(server_ports) if settings.scrape_servers else set()))
        ingress.append(
            {"from": [json.loads(json.dumps(peer))], "ports": [{"protocol": PROTOCOL, "port": p} for p in ports]}
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {"podSelector": {"matchLabels": dict(pods)}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def api_key_secret(*, name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """The Secret the key lives in, without the key: :func:`with_fresh_key` adds it at creation."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": {ANNOTATION_GENERATE: API_KEY_FIELD},
        },
    }


def with_fresh_key(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` (a Secret from :func:`api_key_secret`) with a fresh random value under the data key
    its annotation names; any other object unchanged."""
    field = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_GENERATE)
    if obj.get("kind") != "Secret" or not field:
        return obj
    return {**obj, "stringData": {field: secrets.token_urlsafe(KEY_BYTES)}}


def key_env(secret: str, key: str, *names: str) -> list[dict[str, Any]]:
    """Environment variables ``names`` holding data key ``key`` of Secret ``secret`` (kept out of
    the pod template: ``kubectl get -o yaml`` shows only the reference)."""
    ref = {"secretKeyRef": {"name": secret, "key": key}}
    return [{"name": n, "valueFrom": ref} for n in names]
