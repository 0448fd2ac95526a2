"""The trainer config as pydantic models: the one schema of ``treetrain train CONFIG``, of the
ConfigMap the operator writes, and of an RLJob's ``spec.trainerConfig`` (the ``trainer:``
section, :mod:`treetrain.config.trainer_settings`). Torch-free, so the operator validates
exactly what the trainer will run.

camelCase on the wire (snake_case is accepted too), unknown keys refused, values strictly
typed (a YAML string is never read as a number). Cross-section rules live in
:mod:`treetrain.config.check`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from treetrain.alloc.registry import default_training, names, prefixes
from treetrain.config.lora import LoraSettings
from treetrain.config.section import Section
from treetrain.config.trainer_settings import SamplingSettings, TrainerSettings
from treetrain.tree.pack import DEFAULT_BLOCK_SIZE

AttentionName = Literal["auto", "flex", "triton", "sparse", "dense"]
ServerKind = Literal["auto", "sglang", "vllm"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
WeightSyncMethod = Literal["distributed", "disk"]
WeightSyncBackend = Literal["auto", "nccl", "gloo"]
PipelineSchedule = Literal["1f1b", "gpipe"]

MAX_BACKEND = 128  # characters of a backend string (bounds the CRD's CEL rules too)
DEFAULT_WEIGHT_SYNC_PORT = 29600  # trainer rank 0's rendezvous port for the weight-update group


# -- model --------------------------------------------------------------------------------


class ModelSettings(Section):
    """Which model to train."""

    path: str = Field(
        min_length=1,
        description="A Hugging Face model directory (or hub id the machine can download), or builtin:NAME "
        "(builtin:smollm2-135m, builtin:tiny-llama).",
    )
    seed: int = Field(default=0, ge=0, description="Seed of random weights (built-in random models, value heads).")
    dtype: DType = Field(
        default="auto",
        description="Compute dtype; auto: bfloat16 on CUDA, float32 on the CPU. A 16-bit dtype keeps fp32 master "
        "weights (AdamW steps fp32) on every engine and layout.",
    )
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass.")
    pipeline_schedule: PipelineSchedule = Field(
        default="1f1b",
        description="Training order of pipeline stages (archon, megatron with p>1): 1f1b alternates forwards "
        "and backwards (stage s holds at most p - s micro-batches' activations); gpipe runs every forward first.",
    )


# -- engines ------------------------------------------------------------------------------


class TreeTrainingSettings(Section):
    """Tree (shared-prefix) packing of training batches."""

    enabled: bool = Field(default=True, description="Pack sequences that share prefixes into tries.")
    max_tokens_per_mb: int = Field(
        default=32768,
        ge=1,
        alias="maxTokensPerMicrobatch",
        description="Capacity of one packed micro-batch, in tree tokens; a multiple of lcm(blockSize, t*c) (t*c: the ranks that split one tree's tokens).",
    )
    attention: AttentionName = Field(
        default="auto", description="Tree attention backend; auto: flex on CUDA, sparse elsewhere."
    )
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, ge=1, le=65536, description="Attention block size; trees are padded to it."
    )
    pad_to_maximum: bool = Field(
        default=False, description="Pad every tree to maxTokensPerMicrobatch (fixed shapes, more padding)."
    )


class ActorSettings(Section):
    """The policy being trained: its backend string (engine and parallel layout) and tree packing."""

    backend: str = Field(
        default=f"{default_training()}:d1",
        min_length=1,
        max_length=MAX_BACKEND,
        description=f"Training backend string: {prefixes('training')} (e.g. {default_training()}:d4t2).",
    )
    tree_training: TreeTrainingSettings = Field(default_factory=TreeTrainingSettings)
    lora: LoraSettings | None = Field(
        default=None, description="Train a LoRA adapter on a frozen base; unset: every weight."
    )


class RoleSettings(Section):
    """A critic or reference model, run in the actor's processes."""

    backend: str = Field(default="", max_length=MAX_BACKEND, description="Backend string; empty: the actor's backend.")
    colocated: bool = Field(
        default=True, description="Run in the actor's processes (same world size); false is not supported yet."
    )


class CheckpointSettings(Section):
    """Resumable checkpoints; a restarted run continues from the latest one."""

    dir: str | None = Field(default=None, description="Directory of checkpoints; unset: no checkpoints.")
    interval_steps: int = Field(default=50, ge=1, description="Save every N steps (and after the last one).")


class RolloutServer(Section):
    """One rollout server."""

    url: str = Field(min_length=1, description="Base URL of one SGLang or vLLM server.")
    kind: ServerKind = Field(default="auto", description="The server's API; auto: probed when training starts.")
    gpus: int = Field(
        default=1, ge=1, description="The server's GPUs (t*p): its ranks in the weight-update group (distributed)."
    )


class WeightSyncSettings(Section):
    """How the trained weights reach the rollout servers after every step."""

    method: WeightSyncMethod = Field(
        default="distributed",
        description="distributed: broadcast from trainer rank 0 to every server GPU (NCCL on GPUs, gloo on CPU); "
        "disk: save under checkpoint.dir, a directory the servers also mount, and ask them to reload it.",
    )
    master_address: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="distributed: the address of trainer rank 0 that the servers dial to join the group.",
    )
    master_port: int = Field(
        default=DEFAULT_WEIGHT_SYNC_PORT,
        ge=1,
        le=65535,
        description="distributed: the port trainer rank 0 listens on for the group's rendezvous.",
    )
    backend: WeightSyncBackend = Field(default="auto", description="distributed: auto (nccl on CUDA, else gloo).")
    bucket_mb: int = Field(
        default=512, ge=1, le=65536, description="distributed: megabytes sent per broadcast (tensors are packed)."
    )
    timeout_seconds: float = Field(
        default=600.0, gt=0, description="distributed: wait this long for every server to join, and per bucket."
    )


class RolloutServers(Section):
    """The rollout servers (written by the operator from the RLJob's rollout engines)."""

    servers: list[RolloutServer] = Field(
        default_factory=list, description="One entry per server; empty: rollout runs in the trainer (local)."
    )
    weight_sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)


def max_staleness(rollout: SamplingSettings, servers: list[RolloutServer]) -> int:
    """``trainer.rollout.maxStaleness`` as the run uses it: the value set, else 0 for local
    rollout (it samples with the trainer's own model) and 1 with rollout servers."""
    if rollout.max_staleness is not None:
        return rollout.max_staleness
    remote = rollout.kind in names("inference") or (rollout.kind == "auto" and bool(servers))
    return 1 if remote else 0


class TrainConfig(Section):
    """Everything ``treetrain train`` reads."""

    model: ModelSettings
    actor: ActorSettings = Field(default_factory=ActorSettings)
    critic: RoleSettings | None = Field(default=None, description="A tree-packed critic (PPO).")
    ref: RoleSettings | None = Field(default=None, description="A reference model (KL term).")
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    rollout: RolloutServers = Field(default_factory=RolloutServers)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
