"""What the pods of an RLJob share: hardening, requests, scheduling fields and volumes, the gang
labels (one Kueue pod group when ``spec.scheduling.queueName`` is set), and their headless Services
(stable DNS names for the rollout servers and the trainer gang)."""

from __future__ import annotations

from typing import Any

from rljob_operator.layout import Layout
from rljob_operator.models import Resources, RLJobSpec
from rljob_operator.names import CHECKPOINT_DIR, LABEL_GANG, MODEL_DIR, meta

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


def gang(layout: Layout) -> tuple[dict[str, str], dict[str, str]]:
    """Pod labels and annotations that make every pod of the RLJob one gang."""
    pod_labels = {LABEL_GANG: layout.name}
    annotations: dict[str, str] = {}
    if layout.spec.scheduling.queue_name:
        pod_labels["kueue.x-k8s.io/queue-name"] = layout.spec.scheduling.queue_name
        pod_labels["kueue.x-k8s.io/pod-group-name"] = layout.name
        annotations["kueue.x-k8s.io/pod-group-total-count"] = str(layout.total_pods)
    return pod_labels, annotations


def headless_service(
    layout: Layout, name: str, component: str, selector: dict[str, str], port: int, *extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(layout.name, layout.namespace, name, component),
        "spec": {
            "clusterIP": "None",
            # Peers must resolve each other before they are Ready (rendezvous, multi-node servers).
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "main", "port": port, "targetPort": port}, *extra],
        },
    }
