"""Admission of an RLJob: every check, in one place, before anything is rendered or created.

``admit`` reads the manifest once (:mod:`rljob_operator.spec_reader`), parses every backend
string once into an Allocation (:mod:`rljob_operator.components`), refuses a request beyond the
operator's ceilings before any more work, checks the trainer config with the trainer's own rules,
the operator's rules and allow-lists (:mod:`rljob_operator.policy`) and the memory per GPU
(:mod:`rljob_operator.gpu_memory`), and raises one ``PlanError`` listing every problem with its
field path. :func:`child_problems` checks the names and labels of the rendered children.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rljob_operator import api_rules
from rljob_operator.components import build_components
from rljob_operator.errors import FieldError, PlanError
from rljob_operator.gpu_memory import MemoryReport, check_memory
from rljob_operator.layout import Layout, trainer_config
from rljob_operator.names import rollout_name, trainer_job_name
from rljob_operator.policy import Limits, check_admission, weight_sync_problems
from rljob_operator.spec_reader import Reading, field_paths, names_a_field, read
from treetrain.config import ConfigError, TrainConfig, validate


@dataclass(frozen=True)
class Admitted:
    """An RLJob that passed every check before rendering."""

    layout: Layout
    config: TrainConfig  # what the trainer pods run (the ConfigMap), checked by its own rules
    memory: MemoryReport  # memory per GPU of each component (gpu_memory.check_memory)
    uid: str | None  # the RLJob's uid: the children's owner


def admit(
    manifest: Any,
    *,
    restart: int = 0,
    limits: Limits = Limits(),  # noqa: B008
    model_config: dict[str, Any] | None = None,
    node_gpu_mib: int | None = None,
) -> Admitted:
    """Check ``manifest``; ``restart`` names the trainer gang's generation (its names are wired in).

    Memory: with the model's config (``model_config``, else ``spec.model.config``) and a GPU
    size (``spec.gpuMemoryGiB``, else ``node_gpu_mib``: the smallest ``nvidia.com/gpu.memory``
    label of the nodes the pods can land on), a component that does not fit is refused."""
    reading = read(manifest)
    errors = list(reading.errors)
    spec = reading.spec
    # Backend strings are checked even when the schema failed, so one run lists every problem.
    components, component_errors = build_components(reading.engines)
    _add_new(errors, component_errors)
    layout = None
    if spec is not None:
        layout = Layout(reading.name, reading.namespace, spec, components, restart)
        # Before any object is rendered: a huge request is refused in microseconds.
        if layout.total_gpus > limits.max_gpus or layout.total_pods > limits.max_pods:
            errors.append(
                FieldError(
                    "spec",
                    f"asks for {layout.total_gpus} GPUs in {layout.total_pods} pods; this operator allows at most "
                    f"{limits.max_gpus} GPUs and {limits.max_pods} pods per RLJob (the chart's "
                    "limits.maxGpusPerRLJob and limits.maxPodsPerRLJob)",
                )
            )
            raise PlanError(errors)
    config, config_errors = _check_trainer_config(layout, reading)
    _add_new(errors, config_errors)
    memory: MemoryReport | None = None
    if layout is not None:
        errors += weight_sync_problems(layout.spec)
        errors += check_admission(layout.spec, components, config, limits)
        memory = check_memory(
            model_config if model_config is not None else layout.spec.model.config,
            components,
            config,
            gpu_memory_gib=layout.spec.gpu_memory_gib,
            node_gpu_mib=node_gpu_mib,
            backend_paths={name: path for name, path, _ in reading.engines.rollouts},
        )
        errors += [FieldError(path, message) for path, message in memory.problems]
    if errors or layout is None or config is None or memory is None:
        raise PlanError(errors)
    return Admitted(layout, config, memory, reading.uid)


def _add_new(errors: list[FieldError], more: list[FieldError]) -> None:
    """``more`` without the problems of a field already reported (one message per field)."""
    seen = {e.path for e in errors}
    errors += [e for e in more if e.path not in seen]


# Where each part of the trainer config comes from in an RLJob: the longest prefix wins.
_CONFIG_SOURCES = {
    "rollout.weightSync.masterPort": "spec.weightSync.port",
    "rollout.weightSync": "spec.weightSync",
    "trainer": "spec.trainerConfig",
    "actor": "spec.actor",
    "critic": "spec.critic",
    "ref": "spec.ref",
    "model": "spec.model",
    "checkpoint": "spec.checkpoint",
    "rollout": "spec.rollout",
}
# Trainer config fields with no RLJob field of their own: what the operator writes them from.
_WRITTEN_FROM = {
    "checkpoint.dir": "from spec.checkpoint.volume (mounted at /checkpoints)",
    "rollout.servers": "from spec.rollout and spec.additionalRollouts",
    "rollout.weightSync.masterAddress": "as trainer rank 0's address",
}


def rljob_path(config_path: str) -> str:
    """``trainer.optimizer.lr`` -> ``spec.trainerConfig.optimizer.lr``: a trainer config path
    as the RLJob field the user wrote."""
    for prefix in sorted(_CONFIG_SOURCES, key=len, reverse=True):
        if config_path == prefix or config_path.startswith((prefix + ".", prefix + "[")):
            return _CONFIG_SOURCES[prefix] + config_path[len(prefix) :]
    return config_path or "spec.trainerConfig"


def suggestion(config_path: str) -> str:
    """The trainer's "did you mean X?" for an RLJob: X's RLJob field when it has one, else who
    sets X (an RLJob cannot name it)."""
    field = rljob_path(config_path)
    if names_a_field(field):
        return f"did you mean {field}?"
    written = next((how for path, how in _WRITTEN_FROM.items() if config_path.startswith(path)), None)
    if written is not None:
        return f"the trainer config's {config_path} is the operator's to write, {written}"
    return f"the trainer config's {config_path} has no RLJob field (the trainer's default applies)"


def _check_trainer_config(layout: Layout | None, reading: Reading) -> tuple[TrainConfig | None, list[FieldError]]:
    """The trainer's own rules, before anything is created: what it would refuse in the pod (a
    misplaced trainerConfig key, an engine it cannot run, a micro-batch cap off the block
    alignment) is refused here, in the trainer's words. When the RLJob schema failed, the
    sections the user wrote are still checked, so one run lists every problem."""
    draft = trainer_config(layout) if layout is not None else reading.written_sections
    try:
        return validate(draft), []
    except ConfigError as err:
        written = ("actor", "critic", "ref", "trainer")
        found = err.problems if layout is not None else [p for p in err.problems if p[0].split(".")[0] in written]
        return None, [_config_problem(p) for p in found]


# A trainer config field named in a trainer message (trainer.algorithm, critic.colocated): dotted,
# whole, not already part of a longer path.
_CONFIG_PATH = re.compile(
    r"(?<![\w./-])("
    + "|".join(re.escape(p) for p in sorted((p for p in field_paths(TrainConfig) if "." in p), key=len, reverse=True))
    + r")(?![\w])"
)


def _config_problem(problem: tuple[str, str]) -> FieldError:
    path, message = problem
    # The message is the trainer's own; a field it names or suggests is named as the RLJob field.
    message = re.sub(r"did you mean (\S+)\?", lambda m: suggestion(m.group(1)), message)
    message = _CONFIG_PATH.sub(lambda m: field if names_a_field(field := rljob_path(m[1])) else m[1], message)
    return FieldError(rljob_path(path), message)


def child_problems(layout: Layout, objects: list[dict[str, Any]]) -> list[FieldError]:
    """Every child name and label value, with the field that makes it and how much to cut."""
    blame: dict[str, tuple[str, str]] = {}
    for i, engine in enumerate(layout.spec.additional_rollouts):
        blame[rollout_name(layout.name, f"rollout-{engine.name}")] = (
            f"spec.additionalRollouts[{i}].name",
            f"shorten the engine name {engine.name!r} (or metadata.name)",
        )
    worst: dict[str, str] = {}
    last = layout.spec.max_restarts
    for comp in layout.components.values():
        if comp.role != "rollout" and comp.colocated_with is None:
            worst[trainer_job_name(layout.name, comp.role, layout.restart)] = trainer_job_name(
                layout.name, comp.role, max(last, 1)
            )
    problems = api_rules.child_problems(objects, blame=blame, worst_job_names=worst)
    return [FieldError(path, message) for path, message in problems]
