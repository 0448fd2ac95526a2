"""Plan an RLJob: manifest in, components and desired child objects out. Pure: no API calls.

``plan`` validates everything it can (schema, backend strings, placement, colocation)
and raises one ``PlanError`` listing every problem with its field path, so
``rljob plan`` and the operator's Valid condition say the same thing.

Children of RLJob ``NAME`` (all in its namespace):

    NAME-config                 ConfigMap: the trainer config (config.yaml)
    NAME-rollout[-ENGINE]       headless Service + StatefulSet per rollout engine
    NAME-trainer                headless Service + Indexed Job for the trainer gang (actor,
                                and critic/ref colocated in the same pods); with trainer.agent
                                the Service also has the port ``openai`` (trainer.proxy.port):
                                the OpenAI-compatible endpoint that trainer rank 0 serves
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rljob_operator import admission
from rljob_operator.gpu_memory import MemoryReport, check_memory
from rljob_operator.models import GROUP, KIND, RESERVED_ENGINE_NAMES, VERSION, ComponentStatus, RLJobSpec, RolloutEngine
from rljob_operator.network import API_KEY_ENV, NetworkSettings, api_key_secret, key_env, network_policy
from rljob_operator.servers import multi_node_command, server_argv, server_auth, server_env, vllm_weight_sync
from treetrain.alloc import Allocation, AllocationError, PodPlan, parse, plan_pods
from treetrain.config import ConfigError, TrainConfig, dump_yaml, validate
from treetrain.config.load import field_name, value_problem

MANAGED_BY = "rljob-operator"
LABEL_RLJOB = f"{GROUP}/rljob"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_ENGINE = f"{GROUP}/engine"
LABEL_RESTART = f"{GROUP}/restart"
# A ceiling only: admission.child_problems checks every name and label value the children, and the
# pods their controllers create, would carry (a long engine name can pass 63 with a short RLJob name).
MAX_NAME_LENGTH = 30
CONFIG_PATH = "/etc/treetrain/config.yaml"
CHECKPOINT_DIR = "/checkpoints"
MODEL_DIR = "/models"
DATA_DIR = "/data"  # spec.data, read-only in the trainer pods
OPENAI_PORT_NAME = "openai"  # the trainer Service's port of the agent endpoint (trainer.agent set)
METRICS_PORT = 9400
ANNOTATION_WEIGHT_SYNC = f"{GROUP}/weight-sync"
# On each trainer Job: the allocation of the components in its pods, and a hash of its pod
# template and trainer config. The Job's template is immutable, so the status reports these
# (what runs) and shows a spec change that differs from them as pending.
ANNOTATION_ALLOCATION = f"{GROUP}/allocation"
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"
EPHEMERAL_CHECKPOINTS = (
    "no spec.checkpoint.volume: checkpoints live in the trainer pod's emptyDir and die with it, so a restarted "
    "trainer gang starts from step 0; set spec.checkpoint.volume.claimName to keep them"
)


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class PlanError(ValueError):
    """Every problem found in one manifest."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


@dataclass(frozen=True)
class Component:
    """One engine of the RLJob and where its GPUs go."""

    name: str  # "rollout", "rollout-small", "actor", "critic", "ref"
    role: str  # the treetrain.dev/component label: rollout, actor, critic or ref
    allocation: Allocation
    pods: PodPlan
    colocated_with: str | None = None  # critic/ref inside the actor's trainer pods

    @property
    def gpus(self) -> int:
        return 0 if self.colocated_with else self.pods.gpus

    def status(self) -> ComponentStatus:
        d = self.allocation.dims
        return ComponentStatus(
            backend=str(self.allocation),
            kind=self.allocation.kind,
            dp=d.dp,
            tp=d.tp,
            pp=d.pp,
            cp=d.cp,
            ep=d.ep,
            etp=d.etp,
            world_size=self.allocation.world_size,
            gpus=self.gpus,
            pods=0 if self.colocated_with else self.pods.pods,
            gpus_per_pod=self.pods.gpus_per_pod,
            nodes=0 if self.colocated_with else self.pods.nodes,
            colocated_with=self.colocated_with,
        )


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    spec: RLJobSpec
    components: dict[str, Component]
    config: TrainConfig | None = None  # what the trainer pods run (the ConfigMap), checked by its own rules
    objects: list[dict[str, Any]] = field(default_factory=list)
    restart: int = 0  # the trainer gang's generation: its rank 0 pod is the weight-sync rendezvous
    memory: MemoryReport | None = None  # memory per GPU of each component (gpu_memory.check_memory)

    @property
    def total_gpus(self) -> int:
        return sum(c.gpus for c in self.components.values())

    @property
    def total_pods(self) -> int:
        return sum(c.pods.pods for c in self.components.values() if not c.colocated_with)

    def summary(self) -> dict[str, Any]:
        """What ``rljob plan --json`` prints."""
        return {
            "components": {
                name: {
                    "backend": str(c.allocation),
                    "gpus": c.gpus,
                    "pods": 0 if c.colocated_with else c.pods.pods,
                    "gpus_per_pod": c.pods.gpus_per_pod,
                    "nodes": 0 if c.colocated_with else c.pods.nodes,
                    "world_size": c.allocation.world_size,
                    "kind": c.allocation.kind,
                    **({"colocated_with": c.colocated_with} if c.colocated_with else {}),
                }
                for name, c in self.components.items()
            },
            "total_gpus": self.total_gpus,
        }

    def weight_sync(self) -> dict[str, Any]:
        """How weights reach the servers, as both sides see it (``rljob plan`` prints it)."""
        ws = self.spec.weight_sync
        if ws.method == "disk":
            return {"method": "disk", "dir": f"{CHECKPOINT_DIR}/weights", "claim": _claim(self.spec)}
        return {
            "method": "distributed",
            "rendezvous": f"{trainer_rank0_address(self)}:{ws.port}",
            "world_size": 1 + sum(gpus for _, _, gpus in _servers(self)),
            "ranks": {"trainer": "0", **engine_ranks(self)},
        }

    def openai_endpoint(self) -> str | None:
        """The base URL of the OpenAI-compatible endpoint trainer rank 0 serves (None without
        ``trainer.agent``); reachable only from the RLJob's own pods under its NetworkPolicy."""
        port = openai_port(self.config)
        return None if port is None else f"http://{trainer_rank0_address(self)}:{port}/v1"

    def checkpoints(self) -> dict[str, Any]:
        """Where checkpoints live and whether a restarted gang can resume from them."""
        claim = _claim(self.spec)
        if claim is None:
            return {"dir": CHECKPOINT_DIR, "persistent": False, "why": EPHEMERAL_CHECKPOINTS}
        return {"dir": CHECKPOINT_DIR, "persistent": True, "claim": claim}


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
    network: NetworkSettings = field(default_factory=NetworkSettings)  # the NetworkPolicy (operator/network.py)


# Deeper than this is refused before any model reads it: pydantic gives up past about 250 levels
# (a traceback), Python's JSON reader past about 990 (kopf's watch died); real manifests nest < 15.
MAX_DEPTH = 64


def _check_depth(manifest: dict[str, Any]) -> None:
    """A PlanError naming where ``manifest`` nests more than :data:`MAX_DEPTH` levels; iterative."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(manifest, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            where = ".".join(path[:4]) + (".…" if len(path) > 4 else "")
            raise PlanError([FieldError(where, f"nested more than {MAX_DEPTH} levels deep; an RLJob may nest at "
                                               f"most {MAX_DEPTH}: flatten it")])  # fmt: skip
        if isinstance(node, dict):
            stack.extend((v, (*path, str(k))) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, (*path, f"[{i}]")) for i, v in enumerate(node))


def plan(
    manifest: dict[str, Any],
    *,
    restart: int = 0,
    limits: Limits = Limits(),
    model_config: dict[str, Any] | None = None,
    node_gpu_mib: int | None = None,
) -> Plan:
    """Validate ``manifest`` and plan its children; ``restart`` names the trainer gang's generation.

    Memory: with the model's config (``model_config``, else ``spec.model.config``) and a GPU
    size (``spec.gpuMemoryGiB``, else ``node_gpu_mib``: the smallest ``nvidia.com/gpu.memory``
    label of the nodes the pods can land on), a component that does not fit is refused."""
    errors: list[FieldError] = []
    if not isinstance(manifest, dict):
        raise PlanError([FieldError("(document)", "an RLJob manifest must be a mapping")])
    _check_depth(manifest)
    if manifest.get("apiVersion") != f"{GROUP}/{VERSION}":
        errors.append(FieldError("apiVersion", f"must be {GROUP}/{VERSION}, got {manifest.get('apiVersion')!r}"))
    if manifest.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND}, got {manifest.get('kind')!r}"))
    metadata = manifest.get("metadata") or {}
    name = str(metadata.get("name") or "")
    namespace = str(metadata.get("namespace") or "default")
    errors += _check_name(name)
    raw = manifest.get("spec")
    spec: RLJobSpec | None = None
    try:
        spec = RLJobSpec.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        errors += [_pydantic_error(e) for e in exc.errors()]
    # Backend strings are checked even when the schema failed, so one run lists every problem.
    components, component_errors = _components(_engines(spec, raw))
    seen = {e.path for e in errors}
    errors += [e for e in component_errors if e.path not in seen]
    # Before any object is rendered: a huge request is refused in microseconds.
    draft = Plan(name=name, namespace=namespace, spec=spec, components=components) if spec else None
    if draft is not None and (draft.total_gpus > limits.max_gpus or draft.total_pods > limits.max_pods):
        errors.append(
            FieldError(
                "spec",
                f"asks for {draft.total_gpus} GPUs in {draft.total_pods} pods; this operator allows at most "
                f"{limits.max_gpus} GPUs and {limits.max_pods} pods per RLJob (the chart's limits.maxGpusPerRLJob "
                "and limits.maxPodsPerRLJob)",
            )
        )
        raise PlanError(errors)
    config, config_errors = _check_trainer_config(name, namespace, spec, raw, components, restart)
    seen = {e.path for e in errors}
    errors += [e for e in config_errors if e.path not in seen]
    memory: MemoryReport | None = None
    if spec is not None:
        errors += _check_weight_sync(spec)
        errors += check_admission(spec, config, limits)
        memory = check_memory(
            model_config if model_config is not None else spec.model.config,
            components,
            config,
            gpu_memory_gib=spec.gpu_memory_gib,
            node_gpu_mib=node_gpu_mib,
        )
        errors += [FieldError(path, message) for path, message in memory.problems]
    if errors or spec is None:
        raise PlanError(errors)
    result = Plan(name=name, namespace=namespace, spec=spec, components=components, config=config, restart=restart)
    objects = _objects(result, restart=restart, network=limits.network)
    child_errors = _check_children(result, objects)
    if child_errors:
        raise PlanError(child_errors)
    uid = metadata.get("uid")
    if uid:
        owner = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        for obj in objects:
            obj["metadata"]["ownerReferences"] = [owner]
    return Plan(
        name=name,
        namespace=namespace,
        spec=spec,
        components=components,
        config=config,
        objects=objects,
        restart=restart,
        memory=memory,
    )


# Where each section of the trainer config comes from in an RLJob.
_CONFIG_SOURCES = {
    "trainer": "spec.trainerConfig",
    "actor": "spec.actor",
    "critic": "spec.critic",
    "ref": "spec.ref",
    "model": "spec.model",
    "checkpoint": "spec.checkpoint",
    "rollout": "spec.rollout",
}


def rljob_path(config_path: str) -> str:
    """``trainer.optimizer.lr`` -> ``spec.trainerConfig.optimizer.lr``: a trainer config path
    as the RLJob field the user wrote."""
    head, dot, rest = config_path.partition(".")
    base = _CONFIG_SOURCES.get(head)
    if base is None:
        return config_path or "spec.trainerConfig"
    return base + dot + rest


def _check_trainer_config(
    name: str, namespace: str, spec: RLJobSpec | None, raw: Any, components: dict[str, Component], restart: int
) -> tuple[TrainConfig | None, list[FieldError]]:
    """The trainer's own rules, before anything is created: what it would refuse in the pod (a
    misplaced trainerConfig key, an engine it cannot run, a micro-batch cap off the block
    alignment) is refused here, in the trainer's words. When the RLJob schema failed, the
    sections the user wrote are still checked, so one run lists every problem."""
    if spec is not None:
        draft = trainer_config(Plan(name=name, namespace=namespace, spec=spec, components=components, restart=restart))
    else:
        draft = _written_sections(raw)
    try:
        return validate(draft), []
    except ConfigError as err:
        written = ("actor", "critic", "ref", "trainer")
        found = err.problems if spec is not None else [p for p in err.problems if p[0].split(".")[0] in written]
        return None, [_config_problem(p) for p in found]


def _written_sections(raw: Any) -> dict[str, Any]:
    """The trainer config sections an RLJob spec spells like the config itself."""
    raw = raw if isinstance(raw, dict) else {}
    found = {
        "actor": raw.get("actor"),
        "critic": raw.get("critic"),
        "ref": raw.get("ref"),
        "trainer": raw.get("trainerConfig"),
    }
    # model.path is a placeholder (a broken schema may hide the real one); its problems are dropped.
    return {"model": {"path": "unchecked"}, **{k: v for k, v in found.items() if isinstance(v, dict)}}


def _check_weight_sync(spec: RLJobSpec) -> list[FieldError]:
    ws, volume = spec.weight_sync, spec.checkpoint.volume
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


def openai_port(config: TrainConfig | None) -> int | None:
    """``trainer.proxy.port`` when the trainer runs an agent (``trainer.agent``), else None."""
    if config is None or config.trainer.agent is None:
        return None
    return config.trainer.proxy.port


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


def check_admission(spec: RLJobSpec, config: TrainConfig | None, limits: Limits) -> list[FieldError]:
    """What the API would refuse in the pod spec, what the servers would execute (a model path
    that is a flag or leaves its volume; under allow-lists, server flags that load code), and
    the operator's allow-lists (``--allow-task-module``, also for the agent and reward modules,
    ``--allow-image-prefix``, ``--allow-server-flag``). Child names are checked on the rendered
    objects (:func:`plan`)."""
    errors = [FieldError(path, message) for path, message in _spec_problems(spec, limits)]
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
        for key, image in (("trainer", spec.images.trainer), ("rollout", spec.images.rollout)):
            if not admission.image_allowed(image, limits.image_prefixes):
                errors.append(
                    FieldError(
                        f"spec.images.{key}",
                        f"{image!r} is not allowed by this operator, which runs only images under "
                        f"{' or '.join(limits.image_prefixes)} (whole path segments); use one of those, or ask the "
                        "cluster admin to add a prefix to the chart's admission.allowedImagePrefixes",
                    )
                )
    return errors


def _spec_problems(spec: RLJobSpec, limits: Limits) -> list[admission.Problem]:
    s = spec.scheduling
    found = admission.scheduling_problems(
        node_selector=s.node_selector,
        tolerations=s.tolerations,
        priority_class=s.priority_class_name,
        queue=s.queue_name,
    )
    if why := admission.extended_resource_problem(spec.gpu_resource_name):
        found.append(("spec.gpuResourceName", f"{spec.gpu_resource_name!r} {why}"))
    for path, volume in (("spec.model.volume", spec.model.volume), ("spec.checkpoint.volume", spec.checkpoint.volume)):
        if volume is not None and (why := admission.subdomain_problem(volume.claim_name)):
            found.append((f"{path}.claimName", f"{volume.claim_name!r} {why} (the name of a PersistentVolumeClaim)"))
    found += _data_problems(spec)
    found += admission.model_path_problems(spec.model.path, volume=spec.model.volume is not None)
    if limits.task_modules or limits.image_prefixes or limits.server_flags:
        engines = [("spec.rollout", spec.rollout), *((f"spec.additionalRollouts[{i}]", e)
                                                     for i, e in enumerate(spec.additional_rollouts))]  # fmt: skip
        for path, engine in engines:
            backend = engine.backend.partition(":")[0].strip()
            found += admission.server_flag_problems(
                f"{path}.serverArgs", backend, engine.server_args, allowed=frozenset(limits.server_flags)
            )
    return found


def _data_problems(spec: RLJobSpec) -> list[admission.Problem]:
    data = spec.data
    if data is None:
        return []
    if (data.claim_name is None) == (data.config_map is None):
        return [("spec.data", "set exactly one of claimName (a PersistentVolumeClaim) and configMap (a ConfigMap)")]
    name, what = (data.claim_name, "PersistentVolumeClaim") if data.claim_name else (data.config_map, "ConfigMap")
    assert name is not None
    field = "claimName" if data.claim_name else "configMap"
    if why := admission.subdomain_problem(name):
        return [(f"spec.data.{field}", f"{name!r} {why} (the name of a {what})")]
    return []


def _check_children(plan: Plan, objects: list[dict[str, Any]]) -> list[FieldError]:
    """Every child name and label value, with the field that makes it and how much to cut."""
    blame: dict[str, tuple[str, str]] = {}
    for i, engine in enumerate(plan.spec.additional_rollouts):
        blame[rollout_name(plan, f"rollout-{engine.name}")] = (
            f"spec.additionalRollouts[{i}].name",
            f"shorten the engine name {engine.name!r} (or metadata.name)",
        )
    worst: dict[str, str] = {}
    last = plan.spec.max_restarts
    for comp in plan.components.values():
        if comp.role != "rollout" and comp.colocated_with is None:
            worst[trainer_job_name(plan, comp.role, plan.restart)] = trainer_job_name(plan, comp.role, max(last, 1))
    problems = admission.child_problems(objects, blame=blame, worst_job_names=worst)
    return [FieldError(path, message) for path, message in problems]


def _config_problem(problem: tuple[str, str]) -> FieldError:
    path, message = problem
    # The message is the trainer's own; a field it suggests is named as the RLJob field too.
    message = re.sub(r"did you mean (\S+)\?", lambda m: f"did you mean {rljob_path(m.group(1))}?", message)
    return FieldError(rljob_path(path), message)


def _check_name(name: str) -> list[FieldError]:
    if not name:
        return [FieldError("metadata.name", "is required")]
    if len(name) > MAX_NAME_LENGTH or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        return [
            FieldError(
                "metadata.name",
                f"{name!r} must be a DNS label of at most {MAX_NAME_LENGTH} characters "
                "(lower-case letters, digits, '-'), so that child names stay valid",
            )
        ]
    return []


def _pydantic_error(error: Any) -> FieldError:
    path = ".".join(field_name(p) for p in ("spec", *error["loc"]))
    if error["type"] == "missing":
        return FieldError(path, "is required")
    if error["type"] == "extra_forbidden":
        return FieldError(path, "is not a field of RLJob (check the spelling; fields are camelCase)")
    return FieldError(path, value_problem(error))


@dataclass(frozen=True)
class _Engines:
    """The backend-bearing fields of a spec, read from the model or, when the schema
    failed, as far as possible from the raw mapping."""

    gpus_per_node: int
    rollouts: list[tuple[str, str, str]]  # (component, field path, backend)
    actor: str | None
    aux: list[tuple[str, str, bool]]  # (role, backend or "", colocated)


def _engines(spec: RLJobSpec | None, raw: Any) -> _Engines:
    if spec is not None:
        rollouts = [("rollout", "spec.rollout.backend", spec.rollout.backend)]
        rollouts += [
            (f"rollout-{e.name}", f"spec.additionalRollouts[{i}].backend", e.backend)
            for i, e in enumerate(spec.additional_rollouts)
        ]
        aux = [(role, a.backend, a.colocated) for role in ("critic", "ref") if (a := getattr(spec, role)) is not None]
        return _Engines(spec.gpus_per_node, rollouts, spec.actor.backend, aux)
    raw = raw if isinstance(raw, dict) else {}

    def backend(node: Any) -> str | None:
        value = node.get("backend") if isinstance(node, dict) else None
        return value if isinstance(value, str) and value else None

    gpus = raw.get("gpusPerNode", 8)
    rollouts = [("rollout", "spec.rollout.backend", b)] if (b := backend(raw.get("rollout"))) else []
    extra = raw.get("additionalRollouts")
    for i, node in enumerate(extra if isinstance(extra, list) else []):
        if (b := backend(node)) and isinstance(node.get("name"), str):
            rollouts.append((f"rollout-{node['name']}", f"spec.additionalRollouts[{i}].backend", b))
    aux = []
    for role in ("critic", "ref"):
        node = raw.get(role)
        if isinstance(node, dict):
            aux.append((role, backend(node) or "", node.get("colocated", True) is not False))
    return _Engines(
        gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 8,
        rollouts,
        backend(raw.get("actor")),
        aux,
    )


def _components(engines: _Engines) -> tuple[dict[str, Component], list[FieldError]]:
    errors: list[FieldError] = []
    components: dict[str, Component] = {}

    def add(name: str, role: str, path: str, backend: str, kind: str, colocated_with: str | None = None) -> None:
        try:
            allocation = parse(backend)
        except AllocationError as err:
            errors.append(FieldError(path, str(err)))
            return
        if allocation.kind != kind:
            want = "sglang:... or vllm:..." if kind == "inference" else "fsdp:..., megatron:... or archon:..."
            errors.append(FieldError(path, f"{backend!r} is a {allocation.kind} backend; {role} needs {want}"))
            return
        try:
            pods = plan_pods(allocation, engines.gpus_per_node)
        except AllocationError as err:
            errors.append(FieldError(path, f"{err} (gpusPerNode is {engines.gpus_per_node})"))
            return
        components[name] = Component(name, role, allocation, pods, colocated_with)

    for name, path, backend in engines.rollouts:
        if name.startswith("rollout-") and name.removeprefix("rollout-") in RESERVED_ENGINE_NAMES:
            errors.append(
                FieldError(
                    path.replace(".backend", ".name"),
                    f"engine name {name.removeprefix('rollout-')!r} is reserved (child names would collide "
                    f"with another RLJob's); pick a name other than {', '.join(RESERVED_ENGINE_NAMES)}",
                )
            )
            continue
        if name in components:
            errors.append(FieldError(path.replace(".backend", ".name"), f"engine name {name!r} is used twice"))
            continue
        add(name, "rollout", path, backend, "inference")
    if engines.actor is not None:
        add("actor", "actor", "spec.actor.backend", engines.actor, "training")
    for role, aux_backend, colocated in engines.aux:
        if not colocated:
            # The trainer runs critic and ref inside the actor's gang only (for now).
            errors.append(
                FieldError(
                    f"spec.{role}.colocated",
                    f"a {role} in its own pods is not supported yet; remove colocated: false "
                    f"(the {role} then runs in the actor's trainer pods, with the actor's world size)",
                )
            )
            continue
        if not aux_backend and engines.actor is None:
            continue
        add(
            role,
            role,
            f"spec.{role}.backend",
            aux_backend or engines.actor or "",
            "training",
            "actor" if colocated else None,
        )
        actor, mine = components.get("actor"), components.get(role)
        if colocated and actor and mine and mine.allocation.world_size != actor.allocation.world_size:
            errors.append(
                FieldError(
                    f"spec.{role}.backend",
                    f"a colocated {role} runs in the actor's trainer pods, so its world size must equal the "
                    f"actor's ({mine.allocation.world_size} != {actor.allocation.world_size}); use the same world "
                    f"size, leave backend empty, or set {role}.colocated: false",
                )
            )
    return components, errors


# ---------------------------------------------------------------------------
# Child objects


def labels(plan: Plan, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": "treetrain",
        LABEL_RLJOB: plan.name,
        LABEL_COMPONENT: component,
    }


def _meta(plan: Plan, name: str, component: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": plan.namespace, "labels": {**labels(plan, component), **(extra or {})}}


def rollout_name(plan: Plan, component: str) -> str:
    return f"{plan.name}-{component}"


def trainer_service_name(plan: Plan, role: str = "actor") -> str:
    return f"{plan.name}-trainer" if role == "actor" else f"{plan.name}-{role}"


def trainer_job_name(plan: Plan, role: str, restart: int) -> str:
    """Each restart of the trainer gang is a new Job, so the old one can be deleted safely."""
    base = trainer_service_name(plan, role)
    return base if restart == 0 else f"{base}-r{restart}"


def rollout_servers(plan: Plan) -> list[tuple[str, str]]:
    """(base URL, kind) of every rollout server (instance leaders), as stable DNS names: each
    engine's servers are spoken to in their own API (sglang or vllm)."""
    return [(url, kind) for url, kind, _ in _servers(plan)]


def _servers(plan: Plan) -> list[tuple[str, str, int]]:
    """(base URL, kind, GPUs) of every rollout server, in the trainer config's order: the order of
    their ranks in the weight-update group."""
    servers: list[tuple[str, str, int]] = []
    for name, comp in plan.components.items():
        if comp.role != "rollout":
            continue
        engine = _engine(plan.spec, name)
        sts = rollout_name(plan, name)
        for instance in range(comp.allocation.instances):
            ordinal = instance * comp.pods.pods_per_instance
            url = f"http://{sts}-{ordinal}.{sts}.{plan.namespace}.svc:{engine.port}"
            servers.append((url, comp.allocation.backend, comp.allocation.gpus_per_instance))
    return servers


def engine_ranks(plan: Plan) -> dict[str, str]:
    """Each rollout engine's ranks in the weight-update group ("1-8"); trainer rank 0 is rank 0."""
    out: dict[str, str] = {}
    first = 1
    for name, comp in plan.components.items():
        if comp.role == "rollout":
            n = comp.allocation.instances * comp.allocation.gpus_per_instance
            out[name] = f"{first}-{first + n - 1}" if n > 1 else str(first)
            first += n
    return out


def trainer_rank0_address(plan: Plan) -> str:
    """The stable DNS name of the trainer gang's pod 0 (global rank 0) of this restart."""
    return f"{trainer_job_name(plan, 'actor', plan.restart)}-0.{trainer_service_name(plan)}.{plan.namespace}.svc"


def _claim(spec: RLJobSpec) -> str | None:
    return spec.checkpoint.volume.claim_name if spec.checkpoint.volume is not None else None


def _engine(spec: RLJobSpec, component: str) -> RolloutEngine:
    if component == "rollout":
        return spec.rollout
    return next(e for e in spec.additional_rollouts if f"rollout-{e.name}" == component)


def _objects(plan: Plan, *, restart: int, network: NetworkSettings = NetworkSettings()) -> list[dict[str, Any]]:  # noqa: B008
    objects: list[dict[str, Any]] = [_config_map(plan), *_network(plan, network)]
    for name, comp in plan.components.items():
        if comp.role == "rollout":
            objects += _rollout(plan, name, comp)
        elif comp.colocated_with is None:
            objects += _trainer(plan, comp, restart=restart)
    return objects


def api_key_secret_name(plan: Plan) -> str:
    return f"{plan.name}-api-key"


def _network(plan: Plan, network: NetworkSettings) -> list[dict[str, Any]]:
    """The key's Secret (created once, before any pod reads it) and, unless turned off, the
    NetworkPolicy that admits only this RLJob's pods and the configured Prometheus."""
    out = [api_key_secret(name=api_key_secret_name(plan), namespace=plan.namespace, labels=labels(plan, "network"))]
    if network.enabled:
        ports = [_engine(plan.spec, n).port for n, c in plan.components.items() if c.role == "rollout"]
        pods = {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_RLJOB: plan.name}
        out.append(
            network_policy(
                name=f"{plan.name}-network",
                namespace=plan.namespace,
                labels=labels(plan, "network"),
                pods=pods,
                metrics_ports=[METRICS_PORT],
                server_ports=ports,
                settings=network,
            )
        )
    return out


def trainer_config(plan: Plan) -> dict[str, Any]:
    """The trainer config of the RLJob, as a mapping (validated in :func:`plan`)."""
    spec = plan.spec
    actor = plan.components.get("actor")
    config: dict[str, Any] = {
        "model": {"path": _model_path(spec)},
        "actor": {
            "backend": str(actor.allocation) if actor else spec.actor.backend,
            "treeTraining": spec.actor.tree_training.model_dump(by_alias=True),
        },
        "checkpoint": {"dir": CHECKPOINT_DIR, "intervalSteps": spec.checkpoint.interval_steps},
        "rollout": {
            "servers": [{"url": url, "kind": kind, "gpus": gpus} for url, kind, gpus in _servers(plan)],
            "weightSync": _weight_sync_config(plan),
        },
        "trainer": spec.trainer_config,
    }
    for role in ("critic", "ref"):
        settings = getattr(spec, role)
        if settings is not None:
            comp = plan.components.get(role)
            config[role] = {
                "backend": str(comp.allocation) if comp else settings.backend,
                "colocated": settings.colocated,
            }
    return config


def _weight_sync_config(plan: Plan) -> dict[str, Any]:
    ws = plan.spec.weight_sync
    if ws.method == "disk":
        return {"method": "disk"}
    return {
        "method": "distributed",
        "masterAddress": trainer_rank0_address(plan),
        "masterPort": ws.port,
        "bucketMb": ws.bucket_mb,
        "timeoutSeconds": ws.timeout_seconds,
    }


def _config_map(plan: Plan) -> dict[str, Any]:
    assert plan.config is not None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, f"{plan.name}-config", "actor"),
        "data": {"config.yaml": dump_yaml(plan.config)},
    }


def _model_path(spec: RLJobSpec) -> str:
    if spec.model.volume is None:
        return spec.model.path
    return f"{MODEL_DIR}/{spec.model.path.lstrip('/')}"


def _headless_service(
    plan: Plan, name: str, component: str, selector: dict[str, str], port: int, *extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, name, component),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are Ready (rendezvous, multi-node servers).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "main", "port": port, "targetPort": port}, *extra],
        },
    }


# Pods run under the "restricted" Pod Security Standard: a non-root user (the images run as uid
# 1000), no privilege escalation, no capabilities, the runtime's seccomp profile. fsGroup makes
# claims writable for that user. Nothing in the pods talks to the API: no ServiceAccount token.
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
# CPU and memory requests keep the pods out of the BestEffort class (first to be evicted); no
# limits: a model's host memory is not known here and an OOM kill would lose the step.
POD_REQUESTS = {"cpu": "2", "memory": "8Gi"}
SHM_SIZE = "16Gi"  # the memory-backed /dev/shm (NCCL, dataloaders) counts against the pod's memory
# SIGTERM to SIGKILL: a trainer finishes its step and writes a checkpoint; a server drains.
TRAINER_GRACE_SECONDS = 900
ROLLOUT_GRACE_SECONDS = 60


def _resources(gpu: str, count: int) -> dict[str, Any]:
    return {"limits": {gpu: str(count)}, "requests": {**POD_REQUESTS, gpu: str(count)}}


def _pod_scheduling(plan: Plan) -> dict[str, Any]:
    s = plan.spec.scheduling
    out: dict[str, Any] = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": dict(POD_SECURITY),
    }
    if s.node_selector:
        out["nodeSelector"] = dict(s.node_selector)
    if s.tolerations:
        out["tolerations"] = [dict(t) for t in s.tolerations]
    if s.priority_class_name:
        out["priorityClassName"] = s.priority_class_name
    return out


def _gang(plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """Pod labels and annotations that make every pod of the RLJob one gang."""
    pod_labels = {f"{GROUP}/gang": plan.name}
    annotations: dict[str, str] = {}
    if plan.spec.scheduling.queue_name:
        pod_labels["kueue.x-k8s.io/queue-name"] = plan.spec.scheduling.queue_name
        pod_labels["kueue.x-k8s.io/pod-group-name"] = plan.name
        annotations["kueue.x-k8s.io/pod-group-total-count"] = str(plan.total_pods)
    return pod_labels, annotations


def _volumes(
    plan: Plan, *, checkpoints: bool, read_only: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = plan.spec
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.model.volume is not None:
        claim = spec.model.volume
        volumes.append(
            {"name": "model", "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": claim.read_only}}
        )
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": claim.read_only})
    if checkpoints and spec.checkpoint.volume is not None:
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint.volume.claim_name}}
        )
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR, **({"readOnly": True} if read_only else {})})
    return volumes, mounts


def _rollout(plan: Plan, name: str, comp: Component) -> list[dict[str, Any]]:
    spec = plan.spec
    engine = _engine(spec, name)
    sts = rollout_name(plan, name)
    selector = {LABEL_RLJOB: plan.name, LABEL_COMPONENT: "rollout", LABEL_ENGINE: name}
    gang_labels, gang_annotations = _gang(plan)
    ppi = comp.pods.pods_per_instance
    argv = server_argv(comp.allocation, model=_model_path(spec), port=engine.port, extra_args=engine.server_args)
    env: list[dict[str, Any]] = list(server_env(comp.allocation.backend))
    # The servers require the RLJob's key (operator/network.py): a flag for SGLang, VLLM_API_KEY for vLLM.
    auth_flags, auth_env = server_auth(comp.allocation.backend, API_KEY_ENV)
    argv += auth_flags
    env += key_env(api_key_secret_name(plan), API_KEY_ENV, *auth_env)
    disk = spec.weight_sync.method == "disk"
    if comp.allocation.backend == "vllm":
        flags, more_env = vllm_weight_sync(spec.weight_sync.method)
        argv += flags
        env += more_env
    if ppi > 1:
        env.append(
            {
                "name": "POD_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
            }
        )
        leader = f"{sts}-{{ordinal}}.{sts}.{plan.namespace}.svc"
        command = multi_node_command(argv, backend=comp.allocation.backend, pods_per_instance=ppi, leader_dns=leader)
    else:
        command = argv
    # Disk sync: the servers read the weights where the trainer writes them (same claim, same path).
    volumes, mounts = _volumes(plan, checkpoints=disk, read_only=True)
    gpu = spec.gpu_resource_name
    container = {
        "name": "server",
        "image": spec.images.rollout,
        "imagePullPolicy": spec.images.pull_policy,
        "command": command,
        "env": env,
        "ports": [{"name": "http", "containerPort": engine.port}],
        "resources": _resources(gpu, comp.pods.gpus_per_pod),
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": mounts,
        # Model loading can take many minutes; the startup probe covers it.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": engine.port},
            "periodSeconds": 10,
            "failureThreshold": 180,
        },
    }
    statefulset: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(plan, sts, "rollout", {LABEL_ENGINE: name}),
        "spec": {
            "serviceName": sts,
            "replicas": comp.pods.pods,
            # All servers start at once: the gang is scheduled together, and multi-pod
            # instances need every member up to initialise.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**labels(plan, "rollout"), LABEL_ENGINE: name, **gang_labels}},
                "spec": {
                    **_pod_scheduling(plan),
                    "terminationGracePeriodSeconds": ROLLOUT_GRACE_SECONDS,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    statefulset["spec"]["template"]["metadata"]["annotations"] = {**gang_annotations, **_sync_annotations(plan, name)}
    service = _headless_service(plan, sts, "rollout", selector, engine.port)
    service["metadata"]["labels"][LABEL_ENGINE] = name
    return [service, statefulset]


def _sync_annotations(plan: Plan, engine: str) -> dict[str, str]:
    """What a rollout pod's side of the weight sync is (nothing in the pod reads them: the trainer
    sends the rendezvous with its first update; they show the wiring in ``kubectl describe``)."""
    ws = plan.weight_sync()
    if ws["method"] == "disk":
        return {ANNOTATION_WEIGHT_SYNC: f"disk {ws['dir']}"}
    return {
        ANNOTATION_WEIGHT_SYNC: "distributed",
        f"{GROUP}/weight-sync-rendezvous": ws["rendezvous"],
        f"{GROUP}/weight-sync-world-size": str(ws["world_size"]),
        f"{GROUP}/weight-sync-ranks": ws["ranks"][engine],
    }


def _trainer(plan: Plan, comp: Component, *, restart: int) -> list[dict[str, Any]]:
    spec = plan.spec
    service = trainer_service_name(plan, comp.role)
    job = trainer_job_name(plan, comp.role, restart)
    selector = {LABEL_RLJOB: plan.name, LABEL_COMPONENT: comp.role}
    gang_labels, gang_annotations = _gang(plan)
    nodes, nproc = comp.pods.pods, comp.pods.gpus_per_pod
    # Indexed Job pods are named <job>-<index> and resolve under the Service (subdomain).
    master = f"{job}-0.{service}.{plan.namespace}.svc"
    env: list[dict[str, Any]] = [
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
        {
            "name": "PET_NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "PET_MASTER_ADDR", "value": master},
        {"name": "PET_MASTER_PORT", "value": str(spec.master_port)},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(spec.master_port)},
        # Everything else the trainer reads is in its config (the ConfigMap), said once.
        {"name": "TREETRAIN_ROLE", "value": comp.role},
        {"name": "TREETRAIN_CONFIG", "value": CONFIG_PATH},
        {"name": "TREETRAIN_RESTART", "value": str(restart)},
        # The rollout servers' key: the trainer's rollout client sends it as a bearer token.
        *key_env(api_key_secret_name(plan), API_KEY_ENV),
    ]
    volumes, mounts = _volumes(plan, checkpoints=True)
    volumes.append({"name": "config", "configMap": {"name": f"{plan.name}-config"}})
    mounts.append({"name": "config", "mountPath": "/etc/treetrain", "readOnly": True})
    if spec.checkpoint.volume is None:
        volumes.append({"name": "checkpoints", "emptyDir": {}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    if spec.data is not None:
        volumes.append(_data_volume(spec))
        mounts.append({"name": "data", "mountPath": DATA_DIR, "readOnly": True})
    gpu = spec.gpu_resource_name
    container = {
        "name": "trainer",
        "image": spec.images.trainer,
        "imagePullPolicy": spec.images.pull_policy,
        # torchrun reads its rendezvous settings from the PET_* variables above.
        "command": ["torchrun", "-m", "treetrain.cli", "train", CONFIG_PATH],
        "env": env,
        "ports": [
            {"name": "metrics", "containerPort": METRICS_PORT},
            {"name": "rdzv", "containerPort": spec.master_port},
            *_sync_ports(plan, "containerPort"),
            *_openai_ports(plan, "containerPort"),
        ],
        "resources": _resources(gpu, nproc),
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": mounts,
    }
    pod_meta: dict[str, Any] = {"labels": {**labels(plan, comp.role), **gang_labels, LABEL_RESTART: str(restart)}}
    if gang_annotations:
        pod_meta["annotations"] = gang_annotations
    indexed_job: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(plan, job, comp.role, {LABEL_RESTART: str(restart)}),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            # The operator restarts the whole gang (from the latest checkpoint) instead of
            # letting the Job replace single ranks, which would hang the others.
            "backoffLimit": 0,
            "template": {
                "metadata": pod_meta,
                "spec": {
                    **_pod_scheduling(plan),
                    "subdomain": service,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": TRAINER_GRACE_SECONDS,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
    indexed_job["metadata"]["annotations"] = _running_as(plan, comp, indexed_job["spec"]["template"])
    ports = [{**p, "targetPort": p["port"]} for p in (*_sync_ports(plan, "port"), *_openai_ports(plan, "port"))]
    return [_headless_service(plan, service, comp.role, selector, spec.master_port, *ports), indexed_job]


def _data_volume(spec: RLJobSpec) -> dict[str, Any]:
    data = spec.data
    assert data is not None
    if data.claim_name is not None:
        return {"name": "data", "persistentVolumeClaim": {"claimName": data.claim_name, "readOnly": True}}
    return {"name": "data", "configMap": {"name": data.config_map}}


def _openai_ports(plan: Plan, key: str) -> list[dict[str, Any]]:
    """The agent endpoint's port (``trainer.proxy.port``, named ``openai``) when ``trainer.agent`` is set."""
    port = openai_port(plan.config)
    return [] if port is None else [{"name": OPENAI_PORT_NAME, key: port}]


def _running_as(plan: Plan, comp: Component, template: dict[str, Any]) -> dict[str, str]:
    """The Job's annotations that say what its pods run: the allocation of every component in
    them, and a hash of the pod template and the trainer config they read at start."""
    inside = {n: c.status().model_dump(by_alias=True, exclude_none=True) for n, c in plan.components.items()
              if n == comp.name or c.colocated_with == comp.name}  # fmt: skip
    assert plan.config is not None
    content = json.dumps({"template": template, "config": dump_yaml(plan.config)}, sort_keys=True)
    return {
        ANNOTATION_ALLOCATION: json.dumps(inside, sort_keys=True, separators=(",", ":")),
        ANNOTATION_TEMPLATE_HASH: hashlib.sha256(content.encode()).hexdigest()[:16],
    }


def _sync_ports(plan: Plan, key: str) -> list[dict[str, Any]]:
    """Trainer rank 0's weight-sync rendezvous port (distributed sync), named ``weight-sync``."""
    ws = plan.spec.weight_sync
    return [{"name": "weight-sync", key: ws.port}] if ws.method == "distributed" else []
