"""The rollout servers of each engine: a StatefulSet (one pod per server, or per member of a
multi-pod instance) and its headless Service."""

from __future__ import annotations

from typing import Any

from rljob_operator.components import Component
from rljob_operator.layout import Layout, api_key_ref, model_path, rollout_engine
from rljob_operator.models import GROUP, ROLLOUT_KIND
from rljob_operator.names import (
    ANNOTATION_WEIGHT_SYNC,
    LABEL_COMPONENT,
    LABEL_ENGINE,
    LABEL_RLJOB,
    labels,
    meta,
    rollout_name,
)
from rljob_operator.network import API_KEY_ENV, key_env
from rljob_operator.render_pods import (
    CONTAINER_SECURITY,
    ROLLOUT_GRACE_SECONDS,
    gang,
    headless_service,
    pod_scheduling,
    resources,
    volumes,
)
from rljob_operator.servers import (
    lora_flags,
    multi_node_command,
    server_argv,
    server_auth,
    server_env,
    vllm_weight_sync,
)
from treetrain.config import TrainConfig
from treetrain.config.schema import max_staleness


def rollout(layout: Layout, name: str, comp: Component, config: TrainConfig | None = None) -> list[dict[str, Any]]:
    """The headless Service and StatefulSet of rollout engine ``name`` (``config``: the trainer
    config, whose ``actor.lora`` with adapter sync starts the servers with LoRA)."""
    spec = layout.spec
    engine = rollout_engine(spec, name)
    sts = rollout_name(layout.name, name)
    selector = {LABEL_RLJOB: layout.name, LABEL_COMPONENT: "rollout", LABEL_ENGINE: name}
    gang_labels, gang_annotations = gang(layout)
    ppi = comp.pods.pods_per_instance
    argv = server_argv(comp.allocation, model=model_path(spec), port=engine.port, extra_args=engine.server_args)
    env: list[dict[str, Any]] = list(server_env(comp.allocation.backend))
    # The servers require the RLJob's key (operator/rljob_operator/network.py): a flag for SGLang, VLLM_API_KEY for vLLM.
    auth_flags, auth_env = server_auth(comp.allocation.backend, API_KEY_ENV)
    argv += auth_flags
    env += key_env(*api_key_ref(layout), API_KEY_ENV, *auth_env)
    disk = spec.weight_sync.method == "disk"
    if comp.allocation.backend == "vllm":
        flags, more_env = vllm_weight_sync(spec.weight_sync.method)
        argv += flags
        env += more_env
    lora = config.actor.lora if config is not None else None
    if config is not None and lora is not None and lora.sync == "adapter":
        keep = max_staleness(config.trainer.rollout, config.rollout.servers) + 2
        flags, more_env = lora_flags(comp.allocation.backend, rank=lora.rank, targets=lora.targets(), keep=keep)
        argv += flags
        env += more_env
        disk = True  # the adapters are saved under the checkpoint directory, whatever weightSync.method
    if ppi > 1:
        env.append(
            {
                "name": "POD_INDEX",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
            }
        )
        leader = f"{sts}-{{ordinal}}.{sts}.{layout.namespace}.svc"
        command = multi_node_command(argv, backend=comp.allocation.backend, pods_per_instance=ppi, leader_dns=leader)
    else:
        command = argv
    # Disk sync: the servers read the weights where the trainer writes them (same claim, same path).
    pod_volumes, mounts = volumes(layout, checkpoints=disk, read_only=True)
    gpu = spec.gpu_resource_name
    container = {
        "name": "server",
        "image": rollout_image(spec.images.rollout, comp.allocation.backend),
        "imagePullPolicy": spec.images.pull_policy,
        "command": command,
        "env": env,
        "ports": [{"name": "http", "containerPort": engine.port}],
        "resources": resources(gpu, comp.pods.gpus_per_pod, engine.resources),
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
        "metadata": meta(layout.name, layout.namespace, sts, "rollout", {LABEL_ENGINE: name}),
        "spec": {
            "serviceName": sts,
            "replicas": comp.pods.pods,
            # All servers start at once: the gang is scheduled together, and multi-pod
            # instances need every member up to initialise.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**labels(layout.name, "rollout"), LABEL_ENGINE: name, **gang_labels}},
                "spec": {
                    **pod_scheduling(layout),
                    "terminationGracePeriodSeconds": ROLLOUT_GRACE_SECONDS,
                    "containers": [container],
                    "volumes": pod_volumes,
                },
            },
        },
    }
    statefulset["spec"]["template"]["metadata"]["annotations"] = {**gang_annotations, **sync_annotations(layout, name)}
    service = headless_service(layout, sts, "rollout", selector, engine.port)
    service["metadata"]["labels"][LABEL_ENGINE] = name
    return [service, statefulset]


def sync_annotations(layout: Layout, engine: str) -> dict[str, str]:
    """What a rollout pod's side of the weight sync is (nothing in the pod reads them: the trainer
    sends the rendezvous with its first update; they show the wiring in ``kubectl describe``)."""
    ws = layout.weight_sync()
    if ws["method"] == "disk":
        return {ANNOTATION_WEIGHT_SYNC: f"disk {ws['dir']}"}
    return {
        ANNOTATION_WEIGHT_SYNC: "distributed",
        f"{GROUP}/weight-sync-rendezvous": ws["rendezvous"],
        f"{GROUP}/weight-sync-world-size": str(ws["world_size"]),
        f"{GROUP}/weight-sync-ranks": ws["ranks"][engine],
    }


def rollout_image(image: str, server: str) -> str:
    """``spec.images.rollout`` for one engine: ``{kind}`` becomes its server (sglang, vllm)."""
    return image.replace(ROLLOUT_KIND, server)
