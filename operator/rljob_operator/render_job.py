"""The trainer gang: an Indexed Job (one pod per node, torchrun's rendezvous from the PET_*
variables) and its headless Service."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rljob_operator.components import Component
from rljob_operator.layout import Layout, api_key_ref, openai_port
from rljob_operator.names import (
    ANNOTATION_ALLOCATION,
    ANNOTATION_TEMPLATE_HASH,
    CHECKPOINT_DIR,
    CONFIG_PATH,
    DATA_DIR,
    LABEL_COMPONENT,
    LABEL_RESTART,
    LABEL_RLJOB,
    METRICS_PORT,
    OPENAI_PORT_NAME,
    config_map_name,
    labels,
    meta,
    trainer_job_name,
    trainer_service_name,
)
from rljob_operator.network import API_KEY_ENV, key_env
from rljob_operator.render_pods import (
    CONTAINER_SECURITY,
    TRAINER_GRACE_SECONDS,
    data_volume,
    gang,
    headless_service,
    pod_scheduling,
    resources,
    volumes,
)
from treetrain.config import TrainConfig, dump_yaml


def trainer(layout: Layout, config: TrainConfig, comp: Component) -> list[dict[str, Any]]:
    """The headless Service and Indexed Job of trainer component ``comp`` (the actor's gang)."""
    restart = layout.restart
    spec = layout.spec
    service = trainer_service_name(layout.name, comp.role)
    job = trainer_job_name(layout.name, comp.role, restart)
    selector = {LABEL_RLJOB: layout.name, LABEL_COMPONENT: comp.role}
    gang_labels, gang_annotations = gang(layout)
    nodes, nproc = comp.pods.pods, comp.pods.gpus_per_pod
    # Indexed Job pods are named <job>-<index> and resolve under the Service (subdomain).
    master = f"{job}-0.{service}.{layout.namespace}.svc"
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
        *key_env(*api_key_ref(layout), API_KEY_ENV),
    ]
    pod_volumes, mounts = volumes(layout, checkpoints=True)
    pod_volumes.append({"name": "config", "configMap": {"name": config_map_name(layout.name)}})
    mounts.append({"name": "config", "mountPath": "/etc/treetrain", "readOnly": True})
    if spec.checkpoint.volume is None:
        pod_volumes.append({"name": "checkpoints", "emptyDir": {}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    if spec.data is not None:
        pod_volumes.append(data_volume(spec))
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
            *_sync_ports(layout, "containerPort"),
            *_openai_ports(config, "containerPort"),
        ],
        "resources": resources(gpu, nproc, spec.actor.resources),
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": mounts,
    }
    pod_meta: dict[str, Any] = {
        "labels": {**labels(layout.name, comp.role), **gang_labels, LABEL_RESTART: str(restart)}
    }
    if gang_annotations:
        pod_meta["annotations"] = gang_annotations
    indexed_job: dict[str, Any] = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(layout.name, layout.namespace, job, comp.role, {LABEL_RESTART: str(restart)}),
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
                    **pod_scheduling(layout),
                    "subdomain": service,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": TRAINER_GRACE_SECONDS,
                    "containers": [container],
                    "volumes": pod_volumes,
                },
            },
        },
    }
    indexed_job["metadata"]["annotations"] = running_as(layout, config, comp, indexed_job["spec"]["template"])
    ports = [{**p, "targetPort": p["port"]} for p in (*_sync_ports(layout, "port"), *_openai_ports(config, "port"))]
    return [headless_service(layout, service, comp.role, selector, spec.master_port, *ports), indexed_job]


def _openai_ports(config: TrainConfig, key: str) -> list[dict[str, Any]]:
    """The agent endpoint's port (``trainer.proxy.port``, named ``openai``) when ``trainer.agent`` is set."""
    port = openai_port(config)
    return [] if port is None else [{"name": OPENAI_PORT_NAME, key: port}]


def _sync_ports(layout: Layout, key: str) -> list[dict[str, Any]]:
    """Trainer rank 0's weight-sync rendezvous port (distributed sync), named ``weight-sync``."""
    ws = layout.spec.weight_sync
    return [{"name": "weight-sync", key: ws.port}] if ws.method == "distributed" else []


def running_as(layout: Layout, config: TrainConfig, comp: Component, template: dict[str, Any]) -> dict[str, str]:
    """The Job's annotations that say what its pods run: the allocation of every component in
    them, and a hash of the pod template and the trainer config they read at start."""
    inside = {n: c.status().model_dump(by_alias=True, exclude_none=True) for n, c in layout.components.items()
              if n == comp.name or c.colocated_with == comp.name}  # fmt: skip
    content = json.dumps({"template": template, "config": dump_yaml(config)}, sort_keys=True)
    return {
        ANNOTATION_ALLOCATION: json.dumps(inside, sort_keys=True, separators=(",", ":")),
        ANNOTATION_TEMPLATE_HASH: hashlib.sha256(content.encode()).hexdigest()[:16],
    }
