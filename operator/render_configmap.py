"""The ConfigMap ``NAME-config``: the checked trainer config, as the trainer pods read it."""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout
from rljob_operator.names import config_map_name, meta
from treetrain.config import TrainConfig, dump_yaml


def config_map(layout: Layout, config: TrainConfig) -> dict[str, Any]:
    """``NAME-config``: ``config`` as the YAML the trainer reads at ``CONFIG_PATH``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(layout.name, layout.namespace, config_map_name(layout.name), "actor"),
        "data": {"config.yaml": dump_yaml(config)},
    }
