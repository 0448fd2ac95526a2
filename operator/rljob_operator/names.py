"""Names and labels of an RLJob's children: the constants every layer shares and the child names
derived from the RLJob's name. Pure strings; imports nothing but the API group.

Children of RLJob ``NAME`` (all in its namespace):

    NAME-config                 ConfigMap: the trainer config (config.yaml)
    NAME-api-key                Secret: the rollout servers' key (operator/rljob_operator/network.py)
    NAME-network                NetworkPolicy: only this RLJob's pods (and Prometheus) get in
    NAME-rollout[-ENGINE]       headless Service + StatefulSet per rollout engine
    NAME-trainer                headless Service + Indexed Job for the trainer gang (actor,
                                and critic/ref colocated in the same pods); with trainer.agent
                                the Service also has the port ``openai`` (trainer.proxy.port):
                                the OpenAI-compatible endpoint that trainer rank 0 serves
"""

from __future__ import annotations

from typing import Any

from rljob_operator.models import GROUP

MANAGED_BY = "rljob-operator"
LABEL_RLJOB = f"{GROUP}/rljob"
LABEL_COMPONENT = f"{GROUP}/component"
LABEL_ENGINE = f"{GROUP}/engine"
LABEL_RESTART = f"{GROUP}/restart"
LABEL_GANG = f"{GROUP}/gang"
# A ceiling only: admission checks every name and label value the children, and the pods their
# controllers create, would carry (a long engine name can pass 63 with a short RLJob name).
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


def labels(rljob: str, component: str) -> dict[str, str]:
    """The labels every child of RLJob ``rljob`` carries."""
    return {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/name": "treetrain",
        LABEL_RLJOB: rljob,
        LABEL_COMPONENT: component,
    }


def meta(rljob: str, namespace: str, name: str, component: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": {**labels(rljob, component), **(extra or {})}}


def config_map_name(rljob: str) -> str:
    return f"{rljob}-config"


def api_key_secret_name(rljob: str) -> str:
    return f"{rljob}-api-key"


def network_policy_name(rljob: str) -> str:
    return f"{rljob}-network"


def rollout_name(rljob: str, component: str) -> str:
    """The StatefulSet and Service of rollout engine ``component`` ("rollout", "rollout-small")."""
    return f"{rljob}-{component}"


def trainer_service_name(rljob: str, role: str = "actor") -> str:
    return f"{rljob}-trainer" if role == "actor" else f"{rljob}-{role}"


def trainer_job_name(rljob: str, role: str, restart: int) -> str:
    """Each restart of the trainer gang is a new Job, so the old one can be deleted safely."""
    base = trainer_service_name(rljob, role)
    return base if restart == 0 else f"{base}-r{restart}"
