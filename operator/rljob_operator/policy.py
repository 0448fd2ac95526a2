"""The operator's own rules for an admitted spec: the cluster admin's ceilings and allow-lists
(:class:`Limits`), what the API would refuse in the pod spec, what the servers and the trainer
would import or execute, and the ports and volumes weight sync needs. Pure: the spec, its
components and the checked trainer config in, field errors out."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rljob_operator import api_rules
from rljob_operator.api_rules import Problem
from rljob_operator.components import Component
from rljob_operator.errors import FieldError
from rljob_operator.layout import openai_port
from rljob_operator.models import ROLLOUT_KIND, RLJobSpec
from rljob_operator.names import DATA_DIR, METRICS_PORT
from rljob_operator.network import NetworkSettings
from rljob_operator.servers import VLLM_LORA_RANKS
from treetrain.config import TrainConfig


@dataclass(frozen=True)
class Limits:
    """What the cluster admin allows per RLJob. Ceilings (chart values ``limits.*``): one RLJob
    that asks for a million servers must not take the operator, or the controller-manager, down.
    Allow-lists (``admission.*``; empty allows any): whoever creates an RLJob picks the images
    its pods run and the task module its trainer imports, so a shared cluster can pin both; with
    either list set, rollout servers also take only flags that load no code (``server_flags``
    adds more)."""

    max_gpus: int = 4096
    max_pods: int = 1024
    task_modules: tuple[str, ...] = ()  # a package allows its submodules too; builtin: tasks always pass
    image_prefixes: tuple[str, ...] = ()  # whole path segments: ghcr.io/acme never admits ghcr.io/acmeevil/x
    server_flags: tuple[str, ...] = ()  # under allow-lists, serverArgs flags allowed besides the safe ones
    network: NetworkSettings = field(
        default_factory=NetworkSettings
    )  # the NetworkPolicy (operator/rljob_operator/network.py)


def weight_sync_problems(spec: RLJobSpec) -> list[FieldError]:
    ws, volume = spec.weight_sync, spec.checkpoint.volume
    lora = spec.actor.lora
    if lora is not None and lora.sync == "adapter":
        # The trainer saves each adapter under the checkpoint directory; every rollout pod loads it from there.
        if volume is None or volume.read_only:
            return [
                FieldError(
                    "spec.actor.lora.sync",
                    "adapter saves each step's adapter where the rollout pods read it: set "
                    "spec.checkpoint.volume.claimName to a ReadWriteMany claim (readOnly false), or use sync: merged "
                    "(full weights through spec.weightSync)",
                )
            ]
        engines = [spec.rollout, *spec.additional_rollouts]
        if lora.rank > VLLM_LORA_RANKS[-1] and any(e.backend.startswith("vllm:") for e in engines):
            top = VLLM_LORA_RANKS[-1]
            return [FieldError("spec.actor.lora.rank", f"vLLM serves LoRA ranks up to {top}; use rank <= {top}")]
    if ws.method == "disk" and volume is None:
        return [
            FieldError(
                "spec.weightSync.method",
                "disk needs a checkpoint volume that the trainer and the rollout pods both mount: set "
                "spec.checkpoint.volume.claimName to a ReadWriteMany claim, or use method: distributed "
                "(the default; no shared storage)",
            )
        ]
    if ws.method == "disk" and volume is not None and volume.read_only:
        return [FieldError("spec.checkpoint.volume.readOnly", "disk weight sync writes the weights there; set false")]
    if ws.method == "distributed" and ws.port in (spec.master_port, METRICS_PORT):
        taken = "spec.masterPort" if ws.port == spec.master_port else "the trainer's metrics port"
        return [FieldError("spec.weightSync.port", f"{ws.port} is taken by {taken}; pick another port")]
    return []


def task_module_allowed(task: str, allowed: tuple[str, ...], *, builtins: bool = True) -> bool:
    """``builtin:NAME`` always (with ``builtins``: the trainer resolves those names itself and
    imports nothing); ``pkg.mod:fn`` when ``pkg.mod`` or a package above it is listed; anything
    when nothing is listed."""
    if not allowed or (builtins and task.startswith("builtin:")):
        return True
    module = task.partition(":")[0]
    return any(module == entry or module.startswith(entry + ".") for entry in allowed)


# A dataset path the trainer would have to download: scheme://... (s3://, gs://, hf://, http://, file://).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# (key, what, has built-ins): rewards have builtin:NAME; there are no built-in agents, so an agent
# "builtin:run" would import a module named builtin and is checked like any other.
_CODE_KEYS = (("agent", "an agent", False), ("reward", "a reward", True))
_DATASET_KEYS = (("dataset",), ("eval", "dataset"))


def trainer_code_problems(trainer: dict[str, Any], allowed: tuple[str, ...]) -> list[FieldError]:
    """What ``spec.trainerConfig`` imports and reads that the trainer config cannot judge: the
    agent and reward import strings against the task-module allow-list (one rule for every
    module the trainer imports), and dataset paths that are URLs (the trainer reads only files
    in its pod). Read from the mapping as written, so it holds even when other keys are wrong."""
    errors: list[FieldError] = []
    for key, what, builtins in _CODE_KEYS:
        value = trainer.get(key)
        if isinstance(value, str) and not task_module_allowed(value, allowed, builtins=builtins):
            errors.append(
                FieldError(
                    f"spec.trainerConfig.{key}",
                    f"{value!r} is not allowed by this operator, which imports {what} only from modules under "
                    f"{', '.join(allowed)}; use one of those, or ask the cluster admin to add the module to the "
                    "chart's admission.allowedTaskModules",
                )
            )
    for keys in _DATASET_KEYS:
        node: Any = trainer
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        path = node.get("path") if isinstance(node, dict) else None
        if isinstance(path, str) and _URL.match(path):
            errors.append(
                FieldError(
                    f"spec.trainerConfig.{'.'.join(keys)}.path",
                    f"{path!r} is a URL; the trainer reads local files only: mount it into the pod and give the "
                    f"path (spec.data mounts a claim or ConfigMap at {DATA_DIR}: {DATA_DIR}/train.jsonl)",
                )
            )
    return errors


def _port_problems(spec: RLJobSpec, config: TrainConfig | None) -> list[FieldError]:
    """The agent endpoint's port must be a fixed port no other trainer port uses."""
    port = openai_port(config)
    if port is None:
        return []
    path = "spec.trainerConfig.proxy.port"
    if port == 0:
        return [FieldError(path, "0 (any free port) cannot be a Service port; give a fixed port (8000, the default)")]
    taken = {METRICS_PORT: "the trainer's metrics port", spec.master_port: "spec.masterPort (torchrun)"}
    if spec.weight_sync.method == "distributed":
        taken.setdefault(spec.weight_sync.port, "spec.weightSync.port")
    if port in taken:
        return [FieldError(path, f"{port} is also {taken[port]}; give the agent endpoint another port (8000)")]
    return []


def check_admission(
    spec: RLJobSpec, components: dict[str, Component], config: TrainConfig | None, limits: Limits
) -> list[FieldError]:
    """What the API would refuse in the pod spec, what the servers would execute (a model path
    that is a flag or leaves its volume; under allow-lists, server flags that load code), and
    the operator's allow-lists (``--allow-task-module``, also for the agent and reward modules,
    ``--allow-image-prefix``, ``--allow-server-flag``). Child names are checked on the rendered
    objects (:func:`plan`)."""
    errors = [FieldError(path, message) for path, message in _spec_problems(spec, components, limits)]
    errors += trainer_code_problems(spec.trainer_config, limits.task_modules)
    errors += _port_problems(spec, config)
    if config is not None and not task_module_allowed(config.trainer.task, limits.task_modules):
        errors.append(
            FieldError(
                "spec.trainerConfig.task",
                f"{config.trainer.task!r} is not allowed by this operator, which runs only built-in tasks and task "
                f"modules under {', '.join(limits.task_modules)}; use one of those, or ask the cluster admin to add "
                "the module to the chart's admission.allowedTaskModules",
            )
        )
    if limits.image_prefixes:
        # "{kind}" stands for a path segment's end (sglang, vllm): judged with one of them filled in.
        rollout = spec.images.rollout.replace(ROLLOUT_KIND, "vllm")
        for key, image in (("trainer", spec.images.trainer), ("rollout", rollout)):
            if not api_rules.image_allowed(image, limits.image_prefixes):
                errors.append(
                    FieldError(
                        f"spec.images.{key}",
                        f"{image!r} is not allowed by this operator, which runs only images under "
                        f"{' or '.join(limits.image_prefixes)} (whole path segments); use one of those, or ask the "
                        "cluster admin to add a prefix to the chart's admission.allowedImagePrefixes",
                    )
                )
    return errors


def _spec_problems(spec: RLJobSpec, components: dict[str, Component], limits: Limits) -> list[Problem]:
    s = spec.scheduling
    found = api_rules.scheduling_problems(
        node_selector=s.node_selector,
        tolerations=s.tolerations,
        priority_class=s.priority_class_name,
        queue=s.queue_name,
    )
    if why := api_rules.extended_resource_problem(spec.gpu_resource_name):
        found.append(("spec.gpuResourceName", f"{spec.gpu_resource_name!r} {why}"))
    for path, volume in (("spec.model.volume", spec.model.volume), ("spec.checkpoint.volume", spec.checkpoint.volume)):
        if volume is not None and (why := api_rules.subdomain_problem(volume.claim_name)):
            found.append((f"{path}.claimName", f"{volume.claim_name!r} {why} (the name of a PersistentVolumeClaim)"))
    found += _data_problems(spec)
    pods = [("spec.actor.resources", spec.actor.resources), ("spec.rollout.resources", spec.rollout.resources)]
    pods += [(f"spec.additionalRollouts[{i}].resources", e.resources) for i, e in enumerate(spec.additional_rollouts)]
    for path, wanted in pods:
        found += api_rules.resource_problems(
            path, wanted.requests.model_dump(exclude_none=True), wanted.limits.model_dump(exclude_none=True)
        )
    found += api_rules.model_path_problems(spec.model.path, volume=spec.model.volume is not None)
    if limits.task_modules or limits.image_prefixes or limits.server_flags:
        engines = [("rollout", "spec.rollout", spec.rollout), *((f"rollout-{e.name}", f"spec.additionalRollouts[{i}]", e)
                                                                 for i, e in enumerate(spec.additional_rollouts))]  # fmt: skip
        for name, path, engine in engines:
            # The server is the parsed allocation's; an engine whose backend was refused has none
            # (its backend error says what to fix, and its flags are checked once that is fixed).
            comp = components.get(name)
            if comp is None or comp.role != "rollout":
                continue
            found += api_rules.server_flag_problems(
                f"{path}.serverArgs",
                comp.allocation.backend,
                engine.server_args,
                allowed=frozenset(limits.server_flags),
            )
    return found


def _data_problems(spec: RLJobSpec) -> list[Problem]:
    data = spec.data
    if data is None:
        return []
    if (data.claim_name is None) == (data.config_map is None):
        return [("spec.data", "set exactly one of claimName (a PersistentVolumeClaim) and configMap (a ConfigMap)")]
    name, what = (data.claim_name, "PersistentVolumeClaim") if data.claim_name else (data.config_map, "ConfigMap")
    assert name is not None
    field = "claimName" if data.claim_name else "configMap"
    if why := api_rules.subdomain_problem(name):
        return [(f"spec.data.{field}", f"{name!r} {why} (the name of a {what})")]
    return []
