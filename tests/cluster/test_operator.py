"""The RLJob operator end to end on the real control plane (tests/cluster).

The operator runs in this process (kopf with a stop flag) under a ServiceAccount token
bound to exactly ``rljob_operator.rbac.RULES``, the rules the Helm chart ships: it is
never admin. Pods are simulated by kwok; a test makes a trainer pod succeed or fail
with the labels that tests/cluster/kwok-stages.yaml reacts to. Nothing dials a pod.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import Cluster, gpu_room, http_get, service_account_kubeconfig, wait_for
from kubernetes import client
from rljob_helpers import (
    FAIL,
    ROOT,
    SUCCEED,
    cond,
    create,
    custom,
    get,
    label_pods,
    phase_is,
    pods,
    rljob,
    trainer_selector,
)
from suite_helpers import free_port

from rljob_operator.controller import Controller
from rljob_operator.models import GROUP, PLURAL, VERSION
from rljob_operator.rbac import RULES
from rljob_operator.runner import make_controller, serve
from treetrain.config import read_yaml, validate

pytestmark = pytest.mark.cluster


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    path = ROOT / "crds" / "rljob.yaml"
    assert path.exists(), "crds/rljob.yaml is missing: run `rljob crd > crds/rljob.yaml`"
    cluster.run("kubectl", "apply", "--server-side", "-f", str(path))
    cluster.run("kubectl", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig with the token of a ServiceAccount bound to the operator's RBAC rules."""
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    return service_account_kubeconfig(cluster.api, cluster.kubeconfig, "rljob-system", "rljob-operator", RULES, path)


class RunningOperator:
    """kopf in a background thread of this process, stoppable and restartable."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self.controller: Controller | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.controller = make_controller(str(self.kubeconfig))
        self._stop = threading.Event()
        ready = threading.Event()
        controller = self.controller

        def main() -> None:
            asyncio.run(serve(controller, namespaces=[], stop_flag=self._stop, ready_flag=ready))

        self._thread = threading.Thread(target=main, name="rljob-operator", daemon=True)
        self._thread.start()
        assert ready.wait(60), "the operator did not become ready in 60 s"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the operator did not stop in 60 s"


@pytest.fixture(scope="module")
def operator(crd: None, operator_kubeconfig: Path) -> Iterator[RunningOperator]:
    op = RunningOperator(operator_kubeconfig)
    op.start()
    yield op
    op.stop()


# ---------------------------------------------------------------------------
# Helpers


def events(cluster: Cluster, namespace: str, name: str) -> list[str]:
    items = (
        client.CoreV1Api(cluster.api)
        .list_namespaced_event(namespace, field_selector=f"involvedObject.kind=RLJob,involvedObject.name={name}")
        .items
    )
    return [e.reason for e in items]


# ---------------------------------------------------------------------------
# Tests


def test_example_runs_then_succeeds(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    apply = cluster.run("kubectl", "apply", "-n", namespace, "-f", str(ROOT / "examples" / "rljob.yaml"))
    assert "created" in apply.stdout
    status = wait_for("demo Running", phase_is(cluster, namespace, "demo", "Running"))
    assert status["gpus"] == 16 and status["observedGeneration"] == 1
    assert status["allocation"]["rollout"]["pods"] == 2 and status["allocation"]["rollout"]["gpusPerPod"] == 4
    assert status["allocation"]["actor"]["worldSize"] == 8
    for kind in ("Valid", "Scheduled", "Running"):
        assert cond(status, kind)["status"] == "True", status["conditions"]

    # Children: deterministic names, labels, owner references; pods on simulated GPU nodes.
    owner = get(cluster, namespace, "demo")["metadata"]["uid"]
    sts = client.AppsV1Api(cluster.api).read_namespaced_stateful_set("demo-rollout", namespace)
    job = client.BatchV1Api(cluster.api).read_namespaced_job("demo-trainer", namespace)
    for obj in (sts, job):
        assert obj.metadata.labels["treetrain.dev/rljob"] == "demo"
        assert obj.metadata.labels["app.kubernetes.io/managed-by"] == "rljob-operator"
        assert [r.uid for r in obj.metadata.owner_references] == [owner]
    assert job.spec.completion_mode == "Indexed" and job.spec.parallelism == 1
    all_pods = pods(cluster, namespace, "treetrain.dev/rljob=demo")
    assert len(all_pods) == 3
    nodes = {n.metadata.name: n for n in client.CoreV1Api(cluster.api).list_node().items}
    for pod in all_pods:
        assert pod.status.phase == "Running" and pod.spec.node_name in nodes
        assert int(nodes[pod.spec.node_name].status.allocatable["nvidia.com/gpu"]) >= 4
    env = {e.name: e.value for e in job.spec.template.spec.containers[0].env if e.value is not None}
    assert env["PET_MASTER_ADDR"] == f"demo-trainer-0.demo-trainer.{namespace}.svc"
    # The rollout servers are in the mounted config, with their kind; the trainer reads that
    # ConfigMap (as the API server stored the RLJob, defaults filled in) without a complaint.
    cm = client.CoreV1Api(cluster.api).read_namespaced_config_map("demo-config", namespace)
    config = validate(read_yaml(cm.data["config.yaml"], "config.yaml"))
    assert [(s.url, s.kind, s.gpus) for s in config.rollout.servers] == [
        (f"http://demo-rollout-{i}.demo-rollout.{namespace}.svc:30000", "sglang", 4) for i in range(2)
    ]
    # Weights go by distributed broadcast (no shared storage): the rendezvous is trainer pod 0, on a
    # port of the trainer's headless Service, and the rollout pods say their side of it.
    sync = config.rollout.weight_sync
    assert (sync.method, sync.master_address, sync.master_port) == (
        "distributed",
        f"demo-trainer-0.demo-trainer.{namespace}.svc",
        29600,
    )
    service = client.CoreV1Api(cluster.api).read_namespaced_service("demo-trainer", namespace)
    assert ("weight-sync", 29600) in [(p.name, p.port) for p in service.spec.ports]
    notes = sts.spec.template.metadata.annotations
    assert notes["treetrain.dev/weight-sync-rendezvous"] == f"{sync.master_address}:29600"
    assert (notes["treetrain.dev/weight-sync-world-size"], notes["treetrain.dev/weight-sync-ranks"]) == ("9", "1-8")
    # No checkpoint volume: said in the status and once as an event.
    ephemeral = cond(status, "CheckpointsEphemeral")
    assert (ephemeral["status"], ephemeral["reason"]) == ("True", "NoCheckpointVolume")
    assert events(cluster, namespace, "demo").count("NoCheckpointVolume") == 1

    label_pods(cluster, namespace, trainer_selector("demo"), SUCCEED)
    status = wait_for("demo Succeeded", phase_is(cluster, namespace, "demo", "Succeeded"))
    assert status["completionTime"] and cond(status, "Succeeded")["status"] == "True"
    wait_for("rollout torn down", lambda: not pods(cluster, namespace, "treetrain.dev/component=rollout"))
    assert {"PhaseRunning", "PhaseSucceeded"} <= set(events(cluster, namespace, "demo"))


def test_trainer_failure_restarts_then_fails(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    create(cluster, namespace, rljob("flaky", maxRestarts=1, restartBackoffSeconds=1))
    wait_for("flaky Running", phase_is(cluster, namespace, "flaky", "Running"))
    label_pods(cluster, namespace, trainer_selector("flaky", 0), FAIL)

    def restarted() -> Any:
        status = get(cluster, namespace, "flaky").get("status") or {}
        return status.get("restarts") == 1 and status.get("phase") == "Running"

    wait_for("flaky restarted and Running again", restarted)
    jobs = client.BatchV1Api(cluster.api).list_namespaced_job(namespace).items
    assert [j.metadata.name for j in jobs] == ["flaky-trainer-r1"]
    # No checkpoint volume: the new gang starts over, and says so; its rank 0 is the new rendezvous.
    assert "starting from step 0" in get(cluster, namespace, "flaky")["status"]["message"]
    cm = client.CoreV1Api(cluster.api).read_namespaced_config_map("flaky-config", namespace)
    config = validate(read_yaml(cm.data["config.yaml"], "config.yaml"))
    assert config.rollout.weight_sync.master_address == f"flaky-trainer-r1-0.flaky-trainer.{namespace}.svc"
    assert len(pods(cluster, namespace, trainer_selector("flaky", 1))) == 1

    label_pods(cluster, namespace, trainer_selector("flaky", 1), FAIL)
    status = wait_for("flaky Failed", phase_is(cluster, namespace, "flaky", "Failed"))
    assert status["restarts"] == 1
    assert "after 1 restarts (maxRestarts 1)" in status["message"]
    assert "exited with 1" in status["message"]
    assert cond(status, "Failed")["reason"] == "TrainerFailed"
    assert "TrainerFailed" in events(cluster, namespace, "flaky")


def test_disk_weight_sync_mounts_a_shared_claim_in_vllm_rollout_pods(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    """Disk sync with a ReadWriteMany claim: the rollout pods mount it at the trainer's path, and vLLM
    pods run in dev mode (pause and collective_rpc); the checkpoints outlive the pod."""
    core = client.CoreV1Api(cluster.api)
    pv = f"{namespace}-ckpt"
    core.create_persistent_volume(
        {
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "manual",
                "hostPath": {"path": f"/tmp/{pv}"},  # never mounted: the nodes are simulated
                "claimRef": {"namespace": namespace, "name": "ckpt"},
            },
        }
    )
    try:
        core.create_namespaced_persistent_volume_claim(
            namespace,
            {
                "metadata": {"name": "ckpt"},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "manual",
                    "volumeName": pv,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        spec = {
            "rollout": {"backend": "vllm:d2t4"},
            "weightSync": {"method": "disk"},
            "checkpoint": {"volume": {"claimName": "ckpt"}},
        }
        create(cluster, namespace, rljob("disk", **spec))
        status = wait_for("disk Running", phase_is(cluster, namespace, "disk", "Running"))
        assert cond(status, "CheckpointsEphemeral")["status"] == "False"
        rollout = pods(cluster, namespace, "treetrain.dev/rljob=disk,treetrain.dev/component=rollout")
        assert len(rollout) == 2
        for pod in rollout:
            claims = {v.name: v.persistent_volume_claim for v in pod.spec.volumes}
            assert claims["checkpoints"].claim_name == "ckpt"
            (server,) = pod.spec.containers
            assert ("checkpoints", "/checkpoints", True) in [
                (m.name, m.mount_path, m.read_only) for m in server.volume_mounts
            ]
            assert {e.name: e.value for e in server.env}["VLLM_SERVER_DEV_MODE"] == "1"
        cm = core.read_namespaced_config_map("disk-config", namespace)
        assert validate(read_yaml(cm.data["config.yaml"], "config.yaml")).rollout.weight_sync.method == "disk"
        assert "NoCheckpointVolume" not in events(cluster, namespace, "disk")
    finally:
        core.delete_persistent_volume(pv)


def test_oversized_job_reports_unschedulable(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    # Each pod asks for 16 GPUs; the simulated nodes have 8.
    create(cluster, namespace, rljob("huge", gpusPerNode=16, rollout={"backend": "sglang:d1t16"},
                                     actor={"backend": "fsdp:d16"}))  # fmt: skip

    def unschedulable() -> Any:
        status = get(cluster, namespace, "huge").get("status") or {}
        c = next((c for c in status.get("conditions", []) if c["type"] == "Scheduled"), None)
        return status if c and c["reason"] == "Unschedulable" and c["message"].startswith("2 of 2 pods") else None

    status = wait_for("Unschedulable in status", unschedulable)
    message = cond(status, "Scheduled")["message"]
    assert "each asks for 16 nvidia.com/gpu" in message and "Insufficient nvidia.com/gpu" in message
    assert status["phase"] == "Pending"


def test_invalid_backend_rejected_by_schema(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    bad = rljob("typo", actor={"backend": "fsdp.d4"})
    with pytest.raises(client.ApiException) as info:
        create(cluster, namespace, bad)
    assert info.value.status == 422
    assert "actor.backend must be fsdp:..., megatron:... or archon:..." in info.value.body


def test_invalid_layout_sets_valid_false(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    create(cluster, namespace, rljob("badlayout", actor={"backend": "fsdp:d4p2"}))
    status = wait_for("Valid=False", phase_is(cluster, namespace, "badlayout", "Failed"))
    valid = cond(status, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "spec.actor.backend" in valid["message"] and "fsdp does not support pipeline parallel" in valid["message"]
    assert not pods(cluster, namespace, "treetrain.dev/rljob=badlayout")
    assert not client.AppsV1Api(cluster.api).list_namespaced_stateful_set(namespace).items

    # Fixing the spec starts it.
    custom(cluster).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "badlayout", {"spec": {"actor": {"backend": "fsdp:d8"}}}
    )
    status = wait_for("badlayout Running after the fix", phase_is(cluster, namespace, "badlayout", "Running"))
    assert cond(status, "Valid")["status"] == "True" and status["observedGeneration"] == 2


TRAINER_MISTAKES = [
    ("misplaced", {"trainerConfig": {"steps": 10, "lr": 1e-6}},
     "spec.trainerConfig.lr: unknown key; did you mean spec.trainerConfig.optimizer.lr?"),
    ("unaligned", {"actor": {"backend": "fsdp:d8", "treeTraining": {"maxTokensPerMicrobatch": 1000}}},
     "spec.actor.treeTraining.maxTokensPerMicrobatch: 1000 must be a multiple of 128"),
    ("noengine", {"actor": {"backend": "fsdp:c2d4"}},
     "spec.actor.backend: context parallelism is not supported by the FSDP engine"),
    ("notask", {"trainerConfig": {"task": "builtin:chess"}}, "spec.trainerConfig.task: unknown built-in task"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "spec", "message"), TRAINER_MISTAKES, ids=[m[0] for m in TRAINER_MISTAKES])
def test_what_the_trainer_would_refuse_is_refused_before_anything_is_created(
    cluster: Cluster, namespace: str, operator: RunningOperator, name: str, spec: dict[str, Any], message: str
) -> None:
    # The API server keeps the unknown trainerConfig key (preserve-unknown-fields): the operator
    # refuses it with the trainer's own message, so a typo never costs GPU time in a pod.
    create(cluster, namespace, rljob(name, **spec))
    status = wait_for(f"{name} Valid=False", phase_is(cluster, namespace, name, "Failed"))
    valid = cond(status, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert message in valid["message"], valid["message"]
    labels = f"treetrain.dev/rljob={name}"
    assert not pods(cluster, namespace, labels)
    core, apps, batch = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)
    for listed in (
        core.list_namespaced_config_map(namespace, label_selector=labels),
        core.list_namespaced_service(namespace, label_selector=labels),
        apps.list_namespaced_stateful_set(namespace, label_selector=labels),
        batch.list_namespaced_job(namespace, label_selector=labels),
    ):
        assert not listed.items, [o.metadata.name for o in listed.items]


def test_an_emoji_in_a_spec_string_reaches_running(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    # Sent as JSON with surrogate escapes, the API server's YAML reader refused every apply (400).
    create(cluster, namespace, rljob("emoji", model={"path": "org/model-😀-é"}))
    wait_for("emoji Running", phase_is(cluster, namespace, "emoji", "Running"))
    cm = client.CoreV1Api(cluster.api).read_namespaced_config_map("emoji-config", namespace)
    assert validate(read_yaml(cm.data["config.yaml"], "config.yaml")).model.path == "org/model-😀-é"


def test_a_child_the_api_server_refuses_is_a_condition_not_silence(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    # A ResourceQuota of no StatefulSets: the API server refuses the rollout StatefulSet (403),
    # whatever admission checks (an invalid nodeSelector value, the 422 this used, is refused by
    # plan now). The quota is lifted before the healthy RLJob below.
    core = client.CoreV1Api(cluster.api)
    quota = {"metadata": {"name": "no-sts"}, "spec": {"hard": {"count/statefulsets.apps": "0"}}}
    core.create_namespaced_resource_quota(namespace, quota)
    wait_for("the quota counted", lambda: core.read_namespaced_resource_quota("no-sts", namespace).status.hard)
    create(cluster, namespace, rljob("poison"))

    def refused() -> Any:
        status = get(cluster, namespace, "poison").get("status") or {}
        c = next((c for c in status.get("conditions", []) if c["type"] == "ReconcileError"), None)
        return c if c and c["status"] == "True" else None

    c = wait_for("ReconcileError=True", refused)
    assert c["reason"] == "ChildRefused" and "HTTP 403" in c["message"] and "exceeded quota" in c["message"], c
    assert "ChildRefused" in events(cluster, namespace, "poison")
    core.delete_namespaced_resource_quota("no-sts", namespace)
    # The operator keeps serving the others.
    create(cluster, namespace, rljob("healthy"))
    wait_for("healthy Running", phase_is(cluster, namespace, "healthy", "Running"))


def test_a_service_or_configmap_deleted_by_hand_comes_back_at_once(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    # They were not watched: they came back only at the 30 s resync (13-27 s observed).
    create(cluster, namespace, rljob("handsoff"))
    wait_for("handsoff Running", phase_is(cluster, namespace, "handsoff", "Running"))
    core = client.CoreV1Api(cluster.api)
    core.delete_namespaced_service("handsoff-trainer", namespace)
    core.delete_namespaced_config_map("handsoff-config", namespace)
    started = time.monotonic()

    def back() -> Any:
        names = {s.metadata.name for s in core.list_namespaced_service(namespace).items}
        names |= {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        return {"handsoff-trainer", "handsoff-config"} <= names or None

    wait_for("Service and ConfigMap recreated", back, timeout=25)  # under the 30 s resync: the watch did it
    print(f"recreated after {time.monotonic() - started:.1f} s")


def test_an_idle_rljob_costs_reads_only(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    # 180 idle RLJobs made ~65 requests/s: an apply (PATCH) per child, a status PATCH and a Job
    # POST answered 409 on every pass. Now a pass over an unchanged RLJob only reads.
    create(cluster, namespace, rljob("idle"))
    wait_for("idle Running", phase_is(cluster, namespace, "idle", "Running"))
    controller = operator.controller
    assert controller is not None
    # Count this namespace's requests and passes only (other tests' RLJobs may still be busy).
    verbs: list[str] = []
    passes: list[str] = []
    call, reconcile_one = controller.kube._call, controller.reconcile_one

    def counting_call(verb: str, kind: str, method: str, path: str, **kwargs: Any) -> Any:
        if f"/namespaces/{namespace}/" in path:
            verbs.append(verb)
        return call(verb, kind, method, path, **kwargs)

    def counting_pass(ns: str, name: str) -> float | None:
        try:
            return reconcile_one(ns, name)
        finally:
            if ns == namespace:
                passes.append(name)

    controller.kube._call = counting_call  # type: ignore[method-assign]
    controller.reconcile_one = counting_pass  # type: ignore[method-assign]
    try:
        # One pass at a time per RLJob: once this one is done, the pass that wrote Running is too.
        controller.queue.add((namespace, "idle"))
        wait_for("a first counted pass", lambda: passes)
        verbs.clear()
        first = len(passes)
        for n in range(first + 1, first + 4):  # passes with nothing to do, as the resync makes them
            controller.queue.add((namespace, "idle"))
            wait_for(f"counted pass {n}", lambda n=n: len(passes) >= n)  # type: ignore[misc]
    finally:
        del controller.kube._call, controller.reconcile_one
    writes = [v for v in verbs if v not in ("get", "list")]
    assert not writes and verbs.count("list") >= 3 * 5, verbs
    assert get(cluster, namespace, "idle")["status"]["phase"] == "Running"


def test_rljobs_run_in_a_restricted_namespace(cluster: Cluster, operator: RunningOperator) -> None:
    # The "restricted" Pod Security Standard refused every pod before (the RLJob stayed Pending).
    name = "restricted-psa"
    meta = client.V1ObjectMeta(name=name, labels={"pod-security.kubernetes.io/enforce": "restricted"})
    core = client.CoreV1Api(cluster.api)
    core.create_namespace(client.V1Namespace(metadata=meta))
    try:
        create(cluster, name, rljob("locked"))
        wait_for("locked Running under restricted Pod Security", phase_is(cluster, name, "locked", "Running"))
    finally:
        core.delete_namespace(name)


def test_an_object_it_did_not_create_is_never_taken_over(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    # RLJob "app" used to take over ConfigMap "app-config": its owner, then garbage-collected with it.
    core = client.CoreV1Api(cluster.api)
    theirs = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="app-config"), data={"keep": "me"})
    core.create_namespaced_config_map(namespace, theirs)
    create(cluster, namespace, rljob("app"))

    def refused() -> Any:
        status = get(cluster, namespace, "app").get("status") or {}
        c = next((c for c in status.get("conditions", []) if c["type"] == "ReconcileError"), None)
        return c if c and c["status"] == "True" else None

    c = wait_for("ReconcileError for the taken name", refused)
    assert "ConfigMap app-config already exists" in c["message"] and "rename the RLJob" in c["message"], c
    cm = core.read_namespaced_config_map("app-config", namespace)
    assert cm.data == {"keep": "me"} and not cm.metadata.owner_references
    custom(cluster).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "app")
    wait_for("RLJob app gone", lambda: not any(
        o["metadata"]["name"] == "app"
        for o in custom(cluster).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
    ))  # fmt: skip
    assert core.read_namespaced_config_map("app-config", namespace).data == {"keep": "me"}


def test_kubectl_explain_shows_the_trainer_config(cluster: Cluster, crd: None) -> None:
    # spec.trainerConfig's schema is generated from the trainer's own models.
    out = cluster.run("kubectl", "explain", f"{PLURAL}.spec.trainerConfig.optimizer").stdout
    assert "lr" in out and "maxGradNorm" in out and "warmupSteps" in out, out
    out = cluster.run("kubectl", "explain", f"{PLURAL}.spec.actor.treeTraining").stdout
    assert "maxTokensPerMicrobatch" in out and "blockSize" in out, out


def test_an_unknown_attention_backend_is_refused_by_the_api_server(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    bad = rljob("flash", actor={"backend": "fsdp:d8", "treeTraining": {"attention": "flash"}})
    with pytest.raises(client.ApiException) as info:
        create(cluster, namespace, bad)
    assert info.value.status == 422
    message = json.loads(info.value.body)["message"]
    assert "spec.actor.treeTraining.attention" in message and '"flex"' in message, message


def test_suspend_and_resume(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    create(cluster, namespace, rljob("pausable"))
    wait_for("Running", phase_is(cluster, namespace, "pausable", "Running"))
    patch = custom(cluster).patch_namespaced_custom_object
    patch(GROUP, VERSION, namespace, PLURAL, "pausable", {"spec": {"suspend": True}})
    status = wait_for("Suspended", phase_is(cluster, namespace, "pausable", "Suspended"))
    assert cond(status, "Suspended")["status"] == "True"
    wait_for("pods removed", lambda: not pods(cluster, namespace, "treetrain.dev/rljob=pausable"))
    assert get(cluster, namespace, "pausable")["metadata"]["name"] == "pausable"

    patch(GROUP, VERSION, namespace, PLURAL, "pausable", {"spec": {"suspend": False}})
    status = wait_for("Running again", phase_is(cluster, namespace, "pausable", "Running"))
    assert cond(status, "Suspended")["status"] == "False"
    assert len(pods(cluster, namespace, "treetrain.dev/rljob=pausable")) == 3


def test_delete_garbage_collects_children(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    create(cluster, namespace, rljob("gone"))
    wait_for("Running", phase_is(cluster, namespace, "gone", "Running"))
    custom(cluster).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")
    core, apps, batch = client.CoreV1Api(cluster.api), client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)

    def all_gone() -> bool:
        left = [
            *core.list_namespaced_pod(namespace).items,
            *apps.list_namespaced_stateful_set(namespace).items,
            *batch.list_namespaced_job(namespace).items,
            *core.list_namespaced_service(namespace, label_selector="treetrain.dev/rljob").items,
            *core.list_namespaced_config_map(namespace, label_selector="treetrain.dev/rljob").items,
        ]
        return not left

    wait_for("children garbage-collected", all_gone)


def test_operator_restart_converges_without_duplicates(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    operator.stop()
    try:
        create(cluster, namespace, rljob("survivor"))
        operator.start()
        # Kill it again right after it started creating children, then start once more.
        wait_for("first child", lambda: client.AppsV1Api(cluster.api).list_namespaced_stateful_set(namespace).items)
        operator.stop()
    finally:
        operator.start()
    wait_for("Running", phase_is(cluster, namespace, "survivor", "Running"))
    apps, batch = client.AppsV1Api(cluster.api), client.BatchV1Api(cluster.api)
    assert [s.metadata.name for s in apps.list_namespaced_stateful_set(namespace).items] == ["survivor-rollout"]
    assert [j.metadata.name for j in batch.list_namespaced_job(namespace).items] == ["survivor-trainer"]
    assert len(pods(cluster, namespace, "treetrain.dev/rljob=survivor")) == 3


def test_ttl_deletes_finished_rljob(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    create(cluster, namespace, rljob("shortlived", ttlSecondsAfterFinished=2))
    wait_for("Running", phase_is(cluster, namespace, "shortlived", "Running"))
    label_pods(cluster, namespace, trainer_selector("shortlived"), SUCCEED)
    wait_for("Succeeded", phase_is(cluster, namespace, "shortlived", "Succeeded"))

    def deleted() -> bool:
        try:
            get(cluster, namespace, "shortlived")
        except client.ApiException as exc:
            return exc.status == 404
        return False

    wait_for("RLJob deleted by its TTL", deleted, timeout=30)


@pytest.mark.slow
def test_fifty_rljobs_converge(cluster: Cluster, namespace: str, operator: RunningOperator) -> None:
    # 50 RLJobs of 2 GPUs need 100 free GPUs: add simulated nodes like the launcher's, enough
    # for what the session's earlier tests may still hold while their namespaces go away.
    with gpu_room(cluster.api, 100, "scale-gpu", cidr_offset=0):
        _fifty_rljobs_converge(cluster, namespace)


def _fifty_rljobs_converge(cluster: Cluster, namespace: str) -> None:
    try:
        names = [f"scale-{i:02d}" for i in range(50)]
        started = time.monotonic()
        for name in names:
            create(cluster, namespace, rljob(name, rollout={"backend": "sglang:d1"}, actor={"backend": "fsdp:d1"}))

        def all_running() -> Any:
            items = custom(cluster).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
            running = [o for o in items if (o.get("status") or {}).get("phase") == "Running"]
            return len(running) == len(names)

        wait_for("50 RLJobs Running", all_running, timeout=240)
        elapsed = time.monotonic() - started
        print(f"\n50 RLJobs (100 pods, 100 GPUs) created and Running in {elapsed:.1f} s")
        assert len(pods(cluster, namespace, "treetrain.dev/component=rollout")) == 50
        assert len(pods(cluster, namespace, "treetrain.dev/component=actor")) == 50
    finally:
        for name in names:
            custom(cluster).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        wait_for("pods gone", lambda: not pods(cluster, namespace, "treetrain.dev/rljob"), timeout=120)


def test_rljob_operator_command_for_one_namespace(
    cluster: Cluster, namespace: str, operator: RunningOperator, operator_kubeconfig: Path
) -> None:
    """`rljob operator` as a process, with KUBECONFIG (a laptop), one namespace, metrics and liveness."""
    import os
    import subprocess
    import sys

    metrics, liveness = free_port(), free_port()
    operator.stop()  # one operator at a time
    env = dict(os.environ, KUBECONFIG=str(operator_kubeconfig))
    rljob_bin = str(Path(sys.executable).parent / "rljob")
    args = [rljob_bin, "operator", "--namespace", namespace, "--bind", "127.0.0.1",
            "--metrics-port", str(metrics), "--liveness-port", str(liveness)]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("liveness 200", lambda: http_get(f"http://127.0.0.1:{liveness}/healthz")[0] == 200, timeout=60)
        create(cluster, namespace, rljob("cli"))
        wait_for("cli Running", phase_is(cluster, namespace, "cli", "Running"))
        # The metrics follow the status patch within the same reconcile pass: poll, don't race it.
        text = wait_for(
            "Running in /metrics",
            lambda: (
                (r := http_get(f"http://127.0.0.1:{metrics}/metrics"))[0] == 200
                and 'rljob_jobs{phase="Running"} 1.0' in r[1]
                and r[1]
            ),
        )
        assert f'rljob_gpus_requested{{component="actor",namespace="{namespace}",rljob="cli"}} 8.0' in text
        assert "rljob_reconcile_duration_seconds_bucket" in text
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
        operator.start()
    assert "Forbidden" not in output and "Traceback" not in output, output[-3000:]


def with_extra_engine(name: str, engine_chars: int) -> dict[str, Any]:
    """A 3-GPU RLJob with one extra vLLM engine whose name is ``engine_chars`` characters long."""
    return rljob(
        name,
        rollout={"backend": "sglang:d1"},
        actor={"backend": "fsdp:d1"},
        additionalRollouts=[{"name": "e" * engine_chars, "backend": "vllm:d1"}],
    )


def test_the_longest_names_admission_accepts_get_their_pods(
    cluster: Cluster, namespace: str, operator: RunningOperator
) -> None:
    """Issue 21 item 6 on the real controllers: a 30-character RLJob with a 13-character extra engine
    is the longest admission accepts, and the StatefulSet controller really creates its pods (its
    ``controller-revision-hash`` label may then be 63 characters); one character more is refused
    with ``Valid=False`` and a message saying what to cut, not left Pending with an empty status."""
    apps = client.AppsV1Api(cluster.api)
    longest = "l" * 30
    create(cluster, namespace, with_extra_engine(longest, 13))
    wait_for(f"{longest} Running", phase_is(cluster, namespace, longest, "Running"), timeout=120)
    sts_name = f"{longest}-rollout-{'e' * 13}"
    revision = wait_for(
        "the extra engine's controller revision",
        lambda: apps.read_namespaced_stateful_set(sts_name, namespace).status.update_revision,
    )
    assert len(sts_name) + 1 + 10 == 63 and len(revision) <= 63  # the hash is at most 10 characters
    extra = wait_for(
        "the extra engine's pod",
        lambda: [
            p for p in pods(cluster, namespace, f"treetrain.dev/rljob={longest}") if p.metadata.name == f"{sts_name}-0"
        ],
    )
    assert extra[0].metadata.labels["controller-revision-hash"] == revision

    too_long = "m" * 30
    create(cluster, namespace, with_extra_engine(too_long, 14))

    def refused() -> Any:
        status = get(cluster, namespace, too_long).get("status") or {}
        valid = next((c for c in status.get("conditions") or [] if c["type"] == "Valid"), None)
        return status if valid and valid["status"] == "False" else None

    status = wait_for(f"{too_long} refused", refused)
    assert "63" in cond(status, "Valid")["message"] and "additionalRollouts[0].name" in cond(status, "Valid")["message"]
    assert not apps.list_namespaced_stateful_set(namespace, label_selector=f"treetrain.dev/rljob={too_long}").items
