"""The trainer Job's annotations that say what its pods run (its pod template is immutable)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rljob_operator.components import Component
from rljob_operator.layout import Layout
from rljob_operator.names import ANNOTATION_ALLOCATION, ANNOTATION_TEMPLATE_HASH
from treetrain.config import TrainConfig, dump_yaml


def running_as(layout: Layout, config: TrainConfig, comp: Component, template: dict[str, Any]) -> dict[str, str]:
    """The Job's annotations that say what its pods run: the allocation of every component in
    them, and a hash of the pod template and the trainer config they read at start."""
    inside = {n: c.status().model_dump(by_alias=True, exclude_none=True) for n, c in layout.components.items()
              if n == comp.name or c.colocated_with == comp.name}  # fmt: skip
    content = json.dumps({"template": template, "config": dump_yaml(config)}, sort_keys=True)
    return {
        ANNOTATION_ALLOCATION: json.dumps(inside, sort_keys=True, separators=(",", ":")),
        ANNOTATION_TEMPLATE_HASH: hashlib.sha256(content.encode()).hexdigest()[:16],
    }
