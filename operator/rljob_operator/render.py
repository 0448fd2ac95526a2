"""Rendering: an admitted RLJob's desired children, one module per kind of child. Pure.

- here: the trainer config (``NAME-config``) and the children in apply order
- :mod:`~rljob_operator.render_network`: the servers' key Secret and the NetworkPolicy
- :mod:`~rljob_operator.render_statefulset`: each rollout engine's StatefulSet and Service
- :mod:`~rljob_operator.render_job`: the trainer gang's Indexed Job (torchrun env) and Service
- :mod:`~rljob_operator.render_pods`: what their pods share (hardening, requests, volumes, the gang
  and Kueue labels, the headless Services)
"""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout
from rljob_operator.models import GROUP, KIND, VERSION
from rljob_operator.names import config_map_name, meta
from rljob_operator.network import NetworkSettings
from rljob_operator.render_job import trainer
from rljob_operator.render_network import network
from rljob_operator.render_statefulset import rollout
from treetrain.config import TrainConfig, dump_yaml


def render(
    layout: Layout,
    config: TrainConfig,
    *,
    settings: NetworkSettings = NetworkSettings(),  # noqa: B008
    uid: str | None = None,
) -> list[dict[str, Any]]:
    """Every child of the RLJob, in apply order; with ``uid``, each controlled by the RLJob."""
    objects: list[dict[str, Any]] = [config_map(layout, config), *network(layout, settings)]
    for name, comp in layout.components.items():
        if comp.role == "rollout":
            objects += rollout(layout, name, comp, config)
        elif comp.colocated_with is None:
            objects += trainer(layout, config, comp)
    if uid:
        owner = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": layout.name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [owner]
    return objects


def config_map(layout: Layout, config: TrainConfig) -> dict[str, Any]:
    """``NAME-config``: ``config`` as the YAML the trainer reads at ``CONFIG_PATH``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(layout.name, layout.namespace, config_map_name(layout.name), "actor"),
        "data": {"config.yaml": dump_yaml(config)},
    }
