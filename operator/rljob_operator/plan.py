"""Plan an RLJob: manifest in, components and desired child objects out. Pure: no API calls.

:func:`plan` admits the manifest (:mod:`rljob_operator.admission`: every check, one
``PlanError`` listing every problem with its field path, so ``rljob plan`` and the operator's
Valid condition say the same thing), renders its children (:mod:`rljob_operator.render`),
checks their names, and builds the one immutable :class:`Plan` of this pass. The child names
are listed in :mod:`rljob_operator.names`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob_operator.admission import admit, child_problems, rljob_path
from rljob_operator.components import Component
from rljob_operator.errors import FieldError, PlanError
from rljob_operator.gpu_memory import MemoryReport
from rljob_operator.layout import Layout, openai_port, trainer_rank0_address
from rljob_operator.models import RLJobSpec
from rljob_operator.names import METRICS_PORT
from rljob_operator.policy import Limits
from rljob_operator.render import render
from treetrain.config import TrainConfig

# What code outside the operator imports from here (tests, docs): the entry point and its errors.
__all__ = ["METRICS_PORT", "Component", "FieldError", "Limits", "Plan", "PlanError", "plan", "rljob_path"]


@dataclass(frozen=True)
class Plan:
    """One pass's plan of an RLJob: built once, complete (admitted, rendered), never changed."""

    layout: Layout
    config: TrainConfig  # what the trainer pods run (the ConfigMap), checked by its own rules
    memory: MemoryReport  # memory per GPU of each component (gpu_memory.check_memory)
    objects: list[dict[str, Any]]  # the desired children, in apply order

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def namespace(self) -> str:
        return self.layout.namespace

    @property
    def spec(self) -> RLJobSpec:
        return self.layout.spec

    @property
    def components(self) -> dict[str, Component]:
        return self.layout.components

    @property
    def restart(self) -> int:
        """The trainer gang's generation: its rank 0 pod is the weight-sync rendezvous."""
        return self.layout.restart

    @property
    def total_gpus(self) -> int:
        return self.layout.total_gpus

    @property
    def total_pods(self) -> int:
        return self.layout.total_pods

    def summary(self) -> dict[str, Any]:
        """What ``rljob plan --json`` prints."""
        return self.layout.summary()

    def weight_sync(self) -> dict[str, Any]:
        """How weights reach the servers, as both sides see it (``rljob plan`` prints it)."""
        return self.layout.weight_sync()

    def checkpoints(self) -> dict[str, Any]:
        """Where checkpoints live and whether a restarted gang can resume from them."""
        return self.layout.checkpoints()

    def trainer(self) -> dict[str, Any]:
        """What the trainer pods run, from the ConfigMap's config (``rljob plan`` prints it)."""
        t, model = self.config.trainer, self.config.model
        if t.agent is not None:
            episodes = f"agent {t.agent}"
        elif t.dataset is not None:
            episodes = f"rows of {t.dataset.path}"
        else:
            episodes = f"task {t.task}"
        return {
            "episodes": episodes,
            "dataset": t.dataset.path if t.dataset is not None else None,
            "reward": t.reward,
            "algorithm": t.algorithm,
            "steps": t.steps,
            "groups_per_step": t.groups_per_step,
            "group_size": t.group_size,
            "dtype": model.dtype,
            "gradient_checkpointing": model.gradient_checkpointing,
            "max_tokens_per_microbatch": self.config.actor.tree_training.max_tokens_per_mb,
        }

    def openai_endpoint(self) -> str | None:
        """The base URL of the OpenAI-compatible endpoint trainer rank 0 serves (None without
        ``trainer.agent``); reachable only from the RLJob's own pods under its NetworkPolicy."""
        port = openai_port(self.config)
        return None if port is None else f"http://{trainer_rank0_address(self.layout)}:{port}/v1"


def plan(
    manifest: dict[str, Any],
    *,
    restart: int = 0,
    limits: Limits = Limits(),  # noqa: B008
    model_config: dict[str, Any] | None = None,
    node_gpu_mib: int | None = None,
) -> Plan:
    """Validate ``manifest`` and plan its children; ``restart`` names the trainer gang's generation.

    Memory: with the model's config (``model_config``, else ``spec.model.config``) and a GPU
    size (``spec.gpuMemoryGiB``, else ``node_gpu_mib``: the smallest ``nvidia.com/gpu.memory``
    label of the nodes the pods can land on), a component that does not fit is refused."""
    admitted = admit(manifest, restart=restart, limits=limits, model_config=model_config, node_gpu_mib=node_gpu_mib)
    objects = render(admitted.layout, admitted.config, settings=limits.network, uid=admitted.uid)
    problems = child_problems(admitted.layout, objects)
    if problems:
        raise PlanError(problems)
    return Plan(admitted.layout, admitted.config, admitted.memory, objects)
