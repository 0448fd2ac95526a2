"""The RLJob's network children: the rollout servers' key (a Secret, created once; none when
``spec.apiKeySecret`` names one) and, unless turned off, the NetworkPolicy that admits only this
RLJob's pods and the configured Prometheus."""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout, rollout_engine
from rljob_operator.names import (
    LABEL_RLJOB,
    MANAGED_BY,
    METRICS_PORT,
    api_key_secret_name,
    labels,
    network_policy_name,
)
from rljob_operator.network import NetworkSettings, api_key_secret, network_policy


def network(layout: Layout, settings: NetworkSettings) -> list[dict[str, Any]]:
    """The key's Secret (created once, before any pod reads it; a Secret the RLJob names is
    never rendered: it is used as is) and, with ``settings.enabled``, the NetworkPolicy."""
    out = []
    if layout.spec.api_key_secret is None:
        name = api_key_secret_name(layout.name)
        out.append(api_key_secret(name=name, namespace=layout.namespace, labels=labels(layout.name, "network")))
    if settings.enabled:
        ports = [rollout_engine(layout.spec, n).port for n, c in layout.components.items() if c.role == "rollout"]
        pods = {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_RLJOB: layout.name}
        out.append(
            network_policy(
                name=network_policy_name(layout.name),
                namespace=layout.namespace,
                labels=labels(layout.name, "network"),
                pods=pods,
                metrics_ports=[METRICS_PORT],
                server_ports=ports,
                settings=settings,
            )
        )
    return out
