"""What every pod of an RLJob shares: hardening, requests, scheduling fields and volumes."""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout
from rljob_operator.models import Resources, RLJobSpec
from rljob_operator.names import CHECKPOINT_DIR, MODEL_DIR

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


def resources(gpu: str, count: int, wanted: Resources) -> dict[str, Any]:
    """A container's requests and limits: the user's CPU and memory, :data:`POD_REQUESTS` for one
    given neither a request nor a limit (with only a limit, Kubernetes requests the limit), and
    the GPUs, which are the operator's."""
    limits = wanted.limits.model_dump(exclude_none=True)
    given = wanted.requests.model_dump(exclude_none=True)
    requests = {k: given.get(k, default) for k, default in POD_REQUESTS.items() if k in given or k not in limits}
    return {"limits": {**limits, gpu: str(count)}, "requests": {**requests, gpu: str(count)}}


def pod_scheduling(layout: Layout) -> dict[str, Any]:
    s = layout.spec.scheduling
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


def volumes(
    layout: Layout, *, checkpoints: bool, read_only: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    spec = layout.spec
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


def data_volume(spec: RLJobSpec) -> dict[str, Any]:
    data = spec.data
    assert data is not None
    if data.claim_name is not None:
        return {"name": "data", "persistentVolumeClaim": {"claimName": data.claim_name, "readOnly": True}}
    return {"name": "data", "configMap": {"name": data.config_map}}
