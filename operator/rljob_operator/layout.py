"""The wiring of an RLJob: its admitted spec and components under the names of one trainer
generation, and what follows from them alone: the rollout servers' stable URLs, each engine's
ranks in the weight-update group, trainer rank 0's address, and the trainer config mapping
(which admission then checks with the trainer's own rules). Pure: no API calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob_operator.components import Component
from rljob_operator.models import RLJobSpec, RolloutEngine
from rljob_operator.names import (
    CHECKPOINT_DIR,
    MODEL_DIR,
    api_key_secret_name,
    rollout_name,
    trainer_job_name,
    trainer_service_name,
)
from rljob_operator.network import API_KEY_FIELD
from treetrain.alloc.precision import resolve_dtype
from treetrain.config import TrainConfig

EPHEMERAL_CHECKPOINTS = (
    "no spec.checkpoint.volume: checkpoints live in the trainer pod's emptyDir and die with it, so a restarted "
    "trainer gang starts from step 0; set spec.checkpoint.volume.claimName to keep them"
)


@dataclass(frozen=True)
class Layout:
    """An admitted RLJob's components, placed: what every child name and URL derives from."""

    name: str
    namespace: str
    spec: RLJobSpec
    components: dict[str, Component]
    restart: int = 0  # the trainer gang's generation: its rank 0 pod is the weight-sync rendezvous

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
            return {"method": "disk", "dir": f"{CHECKPOINT_DIR}/weights", "claim": checkpoint_claim(self.spec)}
        return {
            "method": "distributed",
            "rendezvous": f"{trainer_rank0_address(self)}:{ws.port}",
            "world_size": 1 + sum(gpus for _, _, gpus in servers(self)),
            "ranks": {"trainer": "0", **engine_ranks(self)},
        }

    def checkpoints(self) -> dict[str, Any]:
        """Where checkpoints live and whether a restarted gang can resume from them."""
        claim = checkpoint_claim(self.spec)
        if claim is None:
            return {"dir": CHECKPOINT_DIR, "persistent": False, "why": EPHEMERAL_CHECKPOINTS}
        return {"dir": CHECKPOINT_DIR, "persistent": True, "claim": claim}


def checkpoint_claim(spec: RLJobSpec) -> str | None:
    return spec.checkpoint.volume.claim_name if spec.checkpoint.volume is not None else None


def api_key_ref(layout: Layout) -> tuple[str, str]:
    """(Secret, data key) the rollout servers' API key is read from: the Secret the RLJob names in
    ``spec.apiKeySecret``, used as is, else the operator's own ``NAME-api-key``."""
    named = layout.spec.api_key_secret
    if named is not None:
        return named.name, named.key
    return api_key_secret_name(layout.name), API_KEY_FIELD


def rollout_engine(spec: RLJobSpec, component: str) -> RolloutEngine:
    """The spec of rollout engine ``component`` ("rollout" or "rollout-NAME")."""
    if component == "rollout":
        return spec.rollout
    return next(e for e in spec.additional_rollouts if f"rollout-{e.name}" == component)


def model_path(spec: RLJobSpec) -> str:
    """The model path as the pods see it: a Hugging Face id, or a path under the mounted volume."""
    if spec.model.volume is None:
        return spec.model.path
    return f"{MODEL_DIR}/{spec.model.path.lstrip('/')}"


def rollout_servers(layout: Layout) -> list[tuple[str, str]]:
    """(base URL, kind) of every rollout server (instance leaders), as stable DNS names: each
    engine's servers are spoken to in their own API (sglang or vllm)."""
    return [(url, kind) for url, kind, _ in servers(layout)]


def servers(layout: Layout) -> list[tuple[str, str, int]]:
    """(base URL, kind, GPUs) of every rollout server, in the trainer config's order: the order of
    their ranks in the weight-update group."""
    found: list[tuple[str, str, int]] = []
    for name, comp in layout.components.items():
        if comp.role != "rollout":
            continue
        engine = rollout_engine(layout.spec, name)
        sts = rollout_name(layout.name, name)
        for instance in range(comp.allocation.instances):
            ordinal = instance * comp.pods.pods_per_instance
            url = f"http://{sts}-{ordinal}.{sts}.{layout.namespace}.svc:{engine.port}"
            found.append((url, comp.allocation.backend, comp.allocation.gpus_per_instance))
    return found


def engine_ranks(layout: Layout) -> dict[str, str]:
    """Each rollout engine's ranks in the weight-update group ("1-8"); trainer rank 0 is rank 0."""
    out: dict[str, str] = {}
    first = 1
    for name, comp in layout.components.items():
        if comp.role == "rollout":
            n = comp.allocation.instances * comp.allocation.gpus_per_instance
            out[name] = f"{first}-{first + n - 1}" if n > 1 else str(first)
            first += n
    return out


def trainer_rank0_address(layout: Layout) -> str:
    """The stable DNS name of the trainer gang's pod 0 (global rank 0) of this restart."""
    job = trainer_job_name(layout.name, "actor", layout.restart)
    return f"{job}-0.{trainer_service_name(layout.name)}.{layout.namespace}.svc"


def openai_port(config: TrainConfig | None) -> int | None:
    """``trainer.proxy.port`` when the trainer runs an agent (``trainer.agent``), else None."""
    if config is None or config.trainer.agent is None:
        return None
    return config.trainer.proxy.port


def trainer_config(layout: Layout) -> dict[str, Any]:
    """The trainer config of the RLJob, as a mapping (admission validates it)."""
    spec = layout.spec
    actor = layout.components.get("actor")
    config: dict[str, Any] = {
        "model": {
            "path": model_path(spec),
            "dtype": trainer_dtype(layout),
            "gradientCheckpointing": spec.model.gradient_checkpointing,
        },
        "actor": {
            "backend": str(actor.allocation) if actor else spec.actor.backend,
            "treeTraining": spec.actor.tree_training.model_dump(by_alias=True),
            **(
                {"lora": spec.actor.lora.model_dump(by_alias=True, exclude_none=True)}
                if spec.actor.lora is not None
                else {}
            ),
        },
        "checkpoint": {"dir": CHECKPOINT_DIR, "intervalSteps": spec.checkpoint.interval_steps},
        "rollout": {
            "servers": [{"url": url, "kind": kind, "gpus": gpus} for url, kind, gpus in servers(layout)],
            "weightSync": _weight_sync_config(layout),
        },
        "trainer": spec.trainer_config,
    }
    for role in ("critic", "ref"):
        settings = getattr(spec, role)
        if settings is not None:
            comp = layout.components.get(role)
            config[role] = {
                "backend": str(comp.allocation) if comp else settings.backend,
                "colocated": settings.colocated,
            }
    return config


def trainer_dtype(layout: Layout) -> str:
    """``spec.model.dtype`` as the trainer config's ``model.dtype``: ``auto`` is bfloat16 when the
    trainer pods request GPUs (the actor's allocation gives each pod at least one), float32 when
    they request none. Written out, so the ConfigMap and ``rljob plan`` say what the pods run."""
    actor = layout.components.get("actor")
    return resolve_dtype(layout.spec.model.dtype, cuda=actor is None or actor.pods.gpus_per_pod > 0)


def _weight_sync_config(layout: Layout) -> dict[str, Any]:
    ws = layout.spec.weight_sync
    if ws.method == "disk":
        return {"method": "disk"}
    return {
        "method": "distributed",
        "masterAddress": trainer_rank0_address(layout),
        "masterPort": ws.port,
        "bucketMb": ws.bucket_mb,
        "timeoutSeconds": ws.timeout_seconds,
    }
