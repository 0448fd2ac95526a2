"""The RLJob API (``treetrain.dev/v1alpha1``): pydantic models for spec and status.

These models are the single source of the CRD schema (``rljob crd``), of manifest
validation (``rljob plan``) and of the operator's view of an object. Field names are
camelCase on the wire, snake_case in Python.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from treetrain.alloc.registry import either, names, prefixes
from treetrain.config.lora import LoraSettings
from treetrain.config.schema import (
    DEFAULT_WEIGHT_SYNC_PORT,
    MAX_BACKEND,
    DType,
    RoleSettings,
    TreeTrainingSettings,
    WeightSyncMethod,
    WeightSyncSettings,
)

GROUP = "treetrain.dev"
VERSION = "v1alpha1"
KIND = "RLJob"
PLURAL = "rljobs"
SHORT_NAME = "rlj"

DEFAULT_TRAINER_IMAGE = "ghcr.io/treetrain/trainer:0.1.0"
# One image per server (trainer-image/Dockerfile, ROLLOUT=sglang|vllm: the server with the torch it
# pins); "{kind}" is each rollout engine's server. The trainer image holds neither server.
DEFAULT_ROLLOUT_IMAGE = "ghcr.io/treetrain/rollout:0.1.0-{kind}"
ROLLOUT_KIND = "{kind}"

MAX_TTL_SECONDS = 10 * 366 * 86400  # ten years: larger values overflow date arithmetic


class ApiModel(BaseModel):
    """camelCase on the wire, unknown fields refused, frozen (every RLJob API model)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, strict=True)


def _cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` for a schema node: (CEL rule, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


class VolumeRef(ApiModel):
    """A PersistentVolumeClaim mounted into the pods."""

    claim_name: str = Field(min_length=1, description="Name of a PersistentVolumeClaim in the RLJob's namespace.")
    read_only: bool = Field(default=False, description="Mount read-only.")


# A Kubernetes quantity, unsigned (resource.Quantity's syntax): 4, 0.5, 500m, 64Gi, 1e3.
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"


def _quantity(value: Any) -> str:
    """A quantity as a container spec takes it: a string, or a whole number (``cpu: 8``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not re.fullmatch(QUANTITY_PATTERN, value):
        raise PydanticCustomError("quantity", "must be a Kubernetes quantity such as 8, 500m or 64Gi")
    return value


Quantity = Annotated[
    str,
    PlainValidator(_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]


class ResourceList(ApiModel):
    """CPU and memory; GPUs are the operator's to set (from the backend and gpuResourceName)."""

    cpu: Quantity | None = Field(default=None, description="CPU cores: 8, 500m.")
    memory: Quantity | None = Field(default=None, description="Bytes: 64Gi, 512Mi.")


class Resources(ApiModel):
    """CPU and memory of a container, as in a pod spec (the operator adds the GPUs)."""

    requests: ResourceList = Field(
        default_factory=ResourceList,
        description="Unset: cpu 2 and memory 8Gi (a resource with only a limit requests the limit).",
    )
    limits: ResourceList = Field(
        default_factory=ResourceList,
        description="Unset: none. The memory-backed /dev/shm (up to 16Gi) counts against a memory limit.",
    )


# spec.model: where the pods find the weights (a Hugging Face id, or a path on a mounted claim)
# and how the trainer holds them. Not treetrain.engines.source.ModelSource, which resolves a
# model inside the trainer. The docstring is the CRD's description of spec.model.
class ModelStorage(ApiModel):
    """The model: where its weights come from, and the trainer's precision and recompute."""

    path: str = Field(
        min_length=1,
        description="A Hugging Face model id (Qwen/Qwen3-8B) or, with `volume`, a path inside the volume.",
    )
    volume: VolumeRef | None = Field(default=None, description="Mount this claim at /models; `path` is inside it.")
    config: dict[str, Any] | None = Field(
        default=None,
        description="The model's Hugging Face config.json, inline (optional): admission then estimates each "
        "component's memory per GPU and refuses a layout that cannot fit.",
    )
    # auto: the operator writes bfloat16 for trainer pods with GPUs (layout.trainer_dtype).
    dtype: DType = Field(
        default="auto",
        description="The trainer's model.dtype, the dtype it computes in (a 16-bit one keeps fp32 master weights "
        "on every engine and layout): auto is bfloat16 in trainer pods with GPUs, float32 in pods without.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="The trainer's model.gradientCheckpointing: recompute activations in the backward pass "
        "(far less activation memory, for one more forward pass per micro-batch).",
    )


class DataVolume(ApiModel):
    """Files the trainer reads (``trainer.dataset``, ``trainer.eval.dataset``): the trainer reads local
    files only, so rows come from a claim or a ConfigMap mounted into its pods."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.claimName) != has(self.configMap)", "data needs exactly one of claimName and configMap")
        )
    )

    claim_name: str | None = Field(
        default=None, min_length=1, description="A PersistentVolumeClaim in the RLJob's namespace, mounted read-only."
    )
    config_map: str | None = Field(
        default=None,
        min_length=1,
        description="A ConfigMap in the RLJob's namespace (small files, at most 1 MiB in all), each key a file.",
    )


class Images(ApiModel):
    """Container images: the trainer's, and the rollout servers' (one per server kind)."""

    trainer: str = Field(default=DEFAULT_TRAINER_IMAGE, description="Image of the trainer pods.")
    rollout: str = Field(
        default=DEFAULT_ROLLOUT_IMAGE,
        description="Image of the rollout pods; {kind} in it becomes each engine's server, sglang or vllm (the "
        "default is the project's image of that server).",
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )


_SERVERS = either(f"`{name}:...`" for name in names("inference"))  # the registry's rollout servers


class RolloutEngine(ApiModel):
    """One inference engine: `backend` is a rollout server's string; `d` = server instances."""

    backend: str = Field(
        min_length=1,
        max_length=MAX_BACKEND,
        description=f"Backend string, e.g. {names('inference')[0]}:d2t4 (2 servers x 4 GPUs).",
    )
    server_args: list[str] = Field(
        default_factory=list, description="Extra command-line flags for the server, appended as given."
    )
    port: int = Field(default=30000, ge=1, le=65535, description="HTTP port of each server.")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory of each server pod.")


# Child names are <rljob>-<suffix>; an engine adds <rljob>-rollout-<name>. With engine names
# free of '-' and never one of these words, no two RLJobs' children can share a name (RLJob
# "a" with an engine "trainer" would otherwise own "a-rollout-trainer", the trainer Service of
# RLJob "a-rollout"). tests/unit/test_operator_plan.py checks the pairs.
RESERVED_ENGINE_NAMES = ("config", "rollout", "trainer", "critic", "ref")


class NamedRolloutEngine(RolloutEngine):
    name: str = Field(
        pattern=r"^[a-z0-9]{1,20}$",
        description="Engine name: lower-case letters and digits, at most 20, not one of "
        f"{', '.join(RESERVED_ENGINE_NAMES)}; children are named <rljob>-rollout-<name>.",
    )


class Actor(ApiModel):
    """The policy being trained: its parallel layout and tree training settings."""

    backend: str = Field(min_length=1, max_length=MAX_BACKEND, description=f"Backend string: {prefixes('training')}.")
    # The trainer config's own sections (actor.treeTraining, actor.lora): one schema for both.
    tree_training: TreeTrainingSettings = Field(default_factory=TreeTrainingSettings)
    lora: LoraSettings | None = Field(
        default=None, description="A LoRA adapter on the frozen base; unset: every weight."
    )
    resources: Resources = Field(
        default_factory=Resources, description="CPU and memory of each trainer pod (critic and ref run in them too)."
    )


class Checkpoint(ApiModel):
    """Where checkpoints go; a restarted trainer gang resumes from the latest one if they outlive the pod."""

    volume: VolumeRef | None = Field(
        default=None,
        description="Claim that holds checkpoints (mounted at /checkpoints); without it they live in the trainer "
        "pod's emptyDir and a restarted gang starts from step 0.",
    )
    interval_steps: int = Field(default=50, ge=1, description="Save every N training steps.")


class WeightSync(ApiModel):
    """How the trained weights reach the rollout servers after every step."""

    method: WeightSyncMethod = Field(
        default="distributed",
        description="distributed: trainer rank 0 broadcasts the weights to every rollout GPU (NCCL), no shared "
        "storage needed; disk: the servers reload them from the checkpoint volume, which the rollout pods then "
        "mount too (needs checkpoint.volume, a ReadWriteMany claim).",
    )
    port: int = Field(
        default=DEFAULT_WEIGHT_SYNC_PORT,
        ge=1,
        le=65535,
        description="distributed: the rendezvous port on trainer rank 0 (a port of the trainer's headless Service).",
    )
    bucket_mb: int = Field(
        default=WeightSyncSettings.model_fields["bucket_mb"].default,
        ge=1,
        le=65536,
        description="distributed: megabytes sent per broadcast (tensors are packed).",
    )
    timeout_seconds: float = Field(
        default=WeightSyncSettings.model_fields["timeout_seconds"].default,
        gt=0,
        description="distributed: wait this long for every server to join, and per bucket.",
    )


class Scheduling(ApiModel):
    """Placement of every pod of the RLJob (they are one gang)."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations, as in a pod spec.")
    priority_class_name: str | None = Field(default=None, description="PriorityClass of every pod.")
    queue_name: str | None = Field(
        default=None, description="Kueue LocalQueue: all pods of the RLJob are admitted as one pod group."
    )


class ApiKeySecret(ApiModel):
    """An existing Secret that holds the rollout servers' API key, used as is."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="A Secret in the RLJob's namespace. The operator never creates, changes or deletes it "
        "(it cannot read it either: a missing Secret or key shows as pods that cannot start).",
    )
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="The key of the Secret's data that holds the API key.",
    )


def backend_rules() -> list[tuple[str, str]]:
    """The CEL rules (and messages) that catch a wrong backend family at admission time, generated
    from the engine registry as the CRD is: a backend described there is accepted here too."""
    trainers = ", ".join(repr(f"{name}:") for name in names("training"))

    def server(value: str) -> str:
        return " || ".join(f"{value}.startsWith('{name}:')" for name in names("inference"))

    def trainer(value: str) -> str:
        return f"[{trainers}].exists(p, {value}.startsWith(p))"

    listed = ", ".join(f"{name}:..." for name in names("training"))
    rules = [
        (server("self.rollout.backend"), f"rollout.backend must be an inference backend: {prefixes('inference')}"),
        (
            f"!has(self.additionalRollouts) || self.additionalRollouts.all(r, {server('r.backend')})",
            f"additionalRollouts[].backend must be {prefixes('inference')}",
        ),
        (trainer("self.actor.backend"), f"actor.backend must be {prefixes('training')}"),
    ]
    for role in ("critic", "ref"):  # empty: the actor's backend
        rule = f"!has(self.{role}) || self.{role}.backend == '' || {trainer(f'self.{role}.backend')}"
        rules.append((rule, f"{role}.backend must be empty (= actor's) or {listed}"))
    return rules


class RLJobSpec(ApiModel):
    """What to run. The operator's parser checks backend strings fully; the CEL rules
    here only catch a wrong backend family at admission time."""

    model_config = ConfigDict(json_schema_extra=_cel(*backend_rules()))

    model: ModelStorage
    images: Images = Field(default_factory=Images)
    gpus_per_node: int = Field(default=8, ge=1, le=64, description="GPUs of one node; pods fill whole nodes.")
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu", min_length=1, description="Extended resource that pods request GPUs as."
    )
    gpu_memory_gib: float | None = Field(
        default=None,
        alias="gpuMemoryGiB",
        gt=0,
        le=4096,
        description="Memory of one GPU in GiB, for the memory check (with model.config); unset: the smallest "
        "nvidia.com/gpu.memory node label (MiB) among the nodes the pods can land on.",
    )
    rollout: RolloutEngine = Field(
        description=f"One inference engine: `backend` is {_SERVERS}; `d` = server instances."
    )
    additional_rollouts: list[NamedRolloutEngine] = Field(
        default_factory=list,
        description="More rollout engines (e.g. a second model size); names are unique.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    actor: Actor
    critic: RoleSettings | None = None
    ref: RoleSettings | None = None
    # Checked by the trainer config's own rules in plan() (the same messages the trainer prints);
    # the CRD schema of this field is generated from TrainerSettings (see crd.py).
    trainer_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The trainer's `trainer:` section (docs/trainer.md): RL loop, optimizer, loss, task.",
    )
    data: DataVolume | None = Field(
        default=None,
        description="Mounted read-only at /data in the trainer pods: give trainer.dataset.path as /data/FILE.",
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    weight_sync: WeightSync = Field(default_factory=WeightSync)
    max_restarts: int = Field(default=3, ge=0, description="Trainer gang restarts before the RLJob fails.")
    restart_backoff_seconds: int = Field(
        default=10, ge=0, le=3600, description="Wait before the first restart; doubles each time, at most 5 minutes."
    )
    suspend: bool = Field(default=False, description="true removes the pods and keeps the RLJob; false resumes.")
    scheduling: Scheduling = Field(default_factory=Scheduling)
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=MAX_TTL_SECONDS, description="Delete the RLJob this long after it succeeds or fails."
    )
    master_port: int = Field(default=29500, ge=1, le=65535, description="torchrun rendezvous port.")
    api_key_secret: ApiKeySecret | None = Field(
        default=None,
        description="The rollout servers' API key from this existing Secret. Unset: the operator creates "
        "NAME-api-key with a random key, and refuses a Secret of that name it did not create.",
    )
