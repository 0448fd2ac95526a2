"""The RLJob's status (``treetrain.dev/v1alpha1``): the phase, conditions, and the allocation
the operator planned per component. Written by the operator only (the status subresource)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rljob_operator.models import ApiModel

Phase = Literal["Pending", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(ApiModel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class ComponentStatus(ApiModel):
    backend: str
    kind: Literal["training", "inference"]
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    world_size: int
    gpus: int
    pods: int
    gpus_per_pod: int
    nodes: int
    colocated_with: str | None = None


class RLJobStatus(ApiModel):
    phase: Phase = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    allocation: dict[str, ComponentStatus] = Field(default_factory=dict)
    gpus: int = 0
    restarts: int = 0
    start_time: str | None = None
    completion_time: str | None = None
    last_restart_time: str | None = None
    message: str = ""
