"""The headless Services: stable DNS names for the rollout servers and the trainer gang's pods."""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout
from rljob_operator.names import meta


def headless_service(
    layout: Layout, name: str, component: str, selector: dict[str, str], port: int, *extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(layout.name, layout.namespace, name, component),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are Ready (rendezvous, multi-node servers).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "main", "port": port, "targetPort": port}, *extra],
        },
    }
