"""RLJobs on the test cluster, as the cluster tests write and read them: the example manifest
with spec keys replaced, create/get through the API, status conditions, the simulated trainer
pods' fail and succeed labels, and deleting RLJobs until their pods are gone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from cluster_helpers import Cluster, wait_for
from kubernetes import client

from rljob_operator.models import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
# The labels tests/cluster/kwok-stages.yaml reacts to: a simulated pod succeeds or fails.
SUCCEED = {"sim.treetrain.dev/succeed": "true"}
FAIL = {"sim.treetrain.dev/fail": "true"}
SMALL = {"rollout": {"backend": "sglang:d1"}, "actor": {"backend": "fsdp:d1"}}  # 2 GPUs, 2 pods


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name}
    body["spec"].update(spec)
    return body


def custom(cluster: Cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api)


def create(cluster: Cluster, namespace: str, body: dict[str, Any]) -> None:
    custom(cluster).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def get(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = custom(cluster).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return obj


def phase_is(cluster: Cluster, namespace: str, name: str, phase: str) -> Callable[[], Any]:
    def check() -> Any:
        status = get(cluster, namespace, name).get("status") or {}
        return status if status.get("phase") == phase else None

    return check


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def pods(cluster: Cluster, namespace: str, selector: str) -> list[client.V1Pod]:
    items: list[client.V1Pod] = (
        client.CoreV1Api(cluster.api).list_namespaced_pod(namespace, label_selector=selector).items
    )
    return items


def label_pods(cluster: Cluster, namespace: str, selector: str, labels: dict[str, str]) -> None:
    for pod in pods(cluster, namespace, selector):
        client.CoreV1Api(cluster.api).patch_namespaced_pod(
            pod.metadata.name, namespace, {"metadata": {"labels": labels}}
        )


def trainer_selector(name: str, restart: int = 0) -> str:
    return f"treetrain.dev/rljob={name},treetrain.dev/component=actor,treetrain.dev/restart={restart}"


def rljob_phase(cluster: Cluster, namespace: str, name: str) -> str | None:
    obj = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    phase: str | None = (obj.get("status") or {}).get("phase")
    return phase


def delete_rljobs(cluster: Cluster, *namespaces: str) -> None:
    """Delete the RLJobs and wait until their pods are gone: the simulated GPUs are shared by the
    whole session, and the next test module needs every node free."""
    custom, core = client.CustomObjectsApi(cluster.api), client.CoreV1Api(cluster.api)
    for ns in namespaces:
        for obj in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]:
            custom.delete_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, obj["metadata"]["name"], propagation_policy="Foreground"
            )
    wait_for(
        "the RLJobs' pods gone",
        lambda: not any(core.list_namespaced_pod(ns, label_selector="treetrain.dev/rljob").items for ns in namespaces),
    )
