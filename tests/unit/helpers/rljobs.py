"""RLJob manifests for the operator's pure tests (reconcile, pending changes)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import yaml

from helpers import ROOT

EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
# A fixed clock for decide(): conditions' times and backoffs are then exact.
NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)


def example_rljob(status: dict[str, Any] | None = None, *, generation: int, **spec: Any) -> dict[str, Any]:
    """examples/rljob.yaml as the API server hands it over (name demo in ml), ``spec`` keys
    replaced, with ``status`` when given."""
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "demo", "namespace": "ml", "uid": "u", "generation": generation}
    body["spec"].update(spec)
    if status is not None:
        body["status"] = status
    return body
