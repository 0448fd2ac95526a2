"""A small, pure evaluator of Kubernetes NetworkPolicy ingress semantics, for checking the
policies the API server holds against the labels of real pods. The test cluster runs no network
plugin, so nothing enforces these policies there; this reads them as an enforcing plugin would.

Covered: policies select pods of their own namespace by ``podSelector``; a pod selected by no
policy with ``Ingress`` in its ``policyTypes`` accepts everything; a selected pod accepts a
connection when some selecting policy has a rule whose ``from`` admits the source (``podSelector``
alone: pods of the policy's namespace; ``namespaceSelector`` alone: every pod of the matching
namespaces; both: matching pods of the matching namespaces; no ``from``: anyone) and whose
``ports`` admit the port (none listed: every port; numbers, names of the destination's container
ports, ``endPort`` ranges; protocol TCP unless given). ``ipBlock`` peers match no pod here (pod IPs
are not evaluated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # container port name -> number


def matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Label selector semantics; ``{}`` selects everything, a missing selector nothing."""
    if selector is None:
        return False
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _ingress_policy(policy: dict[str, Any]) -> bool:
    spec = policy["spec"]
    return "Ingress" in (spec.get("policyTypes") or ["Ingress"])


def _peer_admits(peer: dict[str, Any], policy_ns: str, src: Pod, namespaces: dict[str, dict[str, str]]) -> bool:
    pods, nss = peer.get("podSelector"), peer.get("namespaceSelector")
    if pods is None and nss is None:
        return False  # an ipBlock: no pod address is evaluated here
    in_namespace = src.namespace == policy_ns if nss is None else matches(nss, namespaces.get(src.namespace, {}))
    return in_namespace and matches(pods if pods is not None else {}, src.labels)


def _port_admits(rule_ports: list[dict[str, Any]] | None, dst: Pod, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        number = dst.ports.get(want) if isinstance(want, str) else want
        if number is not None and number <= port <= p.get("endPort", number):
            return True
    return False


def admitted(
    policies: list[dict[str, Any]],
    namespaces: dict[str, dict[str, str]],
    src: Pod,
    dst: Pod,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether ``src`` may open a connection to ``dst`` on ``port``, given every NetworkPolicy
    (as the API server returns them) and the namespaces' labels."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == dst.namespace
        and _ingress_policy(p)
        and matches(p["spec"].get("podSelector") or {}, dst.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            who = not peers or any(_peer_admits(peer, dst.namespace, src, namespaces) for peer in peers)
            if who and _port_admits(rule.get("ports"), dst, port, protocol):
                return True
    return False
