"""Capture real metrics of a local run, for the dashboard pictures in docs/metrics.md.

    make cluster-bin && eval "$(tests/cluster/up)"
    helm install rljob-operator charts/rljob-operator -n rljob-system --create-namespace   # the CRD
    .venv/bin/python docs/img/capture.py --minutes 8 --out build/dashboard-samples.jsonl
    tests/cluster/down
    .venv/bin/python docs/img/render.py build/dashboard-samples.jsonl   # needs matplotlib

What runs, all on this machine (loopback only):

- ``rljob operator`` against the test control plane (simulated GPU nodes), with a scenario of
  RLJobs: two that run, one whose trainer fails until it is Failed, one too big to schedule, one
  suspended. Its /metrics is scraped as the ServiceMonitor would (honouring its labels).
- Two real ``treetrain train`` runs on the CPU standing in for the trainer pods of the two
  running RLJobs: the embedded default job (SmolLM2-135M-Instruct, the built-in multi-turn
  arithmetic quiz, local rollout, GRPO, tree packing) and a variant with more turns and larger
  groups, one torch thread each. Each
  serves its /metrics on a loopback port; the scraper adds the labels the PodMonitor would add
  (namespace, rljob, component, pod).

Every 2 s each target is scraped and every sample is written as one JSON line
``{"t": unix_time, "name": ..., "labels": {...}, "value": ...}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "demo"
FAIL = {"sim.treetrain.dev/fail": "true"}


# ---------------------------------------------------------------------------
# The trainers

# Overrides of the embedded default job: one torch thread each (two trainers share the cores; more
# threads than cores make OpenMP spin), and for the second RLJob longer conversations, larger groups.
COMMON: dict[str, Any] = {"trainer": {"threads": 1}}
VARIANT: dict[str, Any] = {"trainer": {"threads": 1, "taskArgs": {"turns": 5}, "groupsPerStep": 4, "groupSize": 6}}


def trainer_argv(variant: bool, port: int, workdir: Path) -> list[str]:
    import yaml

    from treetrain.trainer.config import embedded_default

    config = embedded_default()
    for section, values in (VARIANT if variant else COMMON).items():
        for key, value in values.items():
            merged = {**config[section][key], **value} if isinstance(value, dict) else value
            config[section][key] = merged
    name = "variant" if variant else "default"
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(Path(sys.executable).parent / "treetrain"), "train", str(path)]
    return [*argv, "--steps", "100000", "--no-compare", "--metrics-port", str(port),
            "--checkpoint-dir", str(workdir / f"checkpoints-{name}")]  # fmt: skip


# ---------------------------------------------------------------------------
# The operator scenario


def rljob(name: str, rollout: str, actor: str, **spec: Any) -> dict[str, Any]:
    body = json.loads(json.dumps({
        "apiVersion": "treetrain.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "Qwen/Qwen3-8B"},
            "gpusPerNode": 8,
            "rollout": {"backend": rollout},
            "actor": {"backend": actor, "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 32768}},
        },
    }))  # fmt: skip
    body["spec"].update(copy.deepcopy(spec))
    return body


def scenario(elapsed: float, done: set[str], api: Any) -> None:
    """Steps of the scenario that are due at ``elapsed`` seconds; each runs once."""
    from kubernetes import client

    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)

    def create(body: dict[str, Any]) -> None:
        custom.create_namespaced_custom_object("treetrain.dev", "v1alpha1", NAMESPACE, "rljobs", body)

    def fail_trainer(name: str) -> None:
        selector = f"treetrain.dev/rljob={name},treetrain.dev/component=actor"
        for pod in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            if pod.status.phase == "Running":
                core.patch_namespaced_pod(pod.metadata.name, NAMESPACE, {"metadata": {"labels": FAIL}})

    steps: list[tuple[float, str, Any]] = [
        (0, "agent-demo", lambda: create(rljob("agent-demo", "sglang:d2t4", "fsdp:d8"))),
        (15, "grpo-demo", lambda: create(rljob("grpo-demo", "vllm:d1t4", "fsdp:d4"))),
        (40, "flaky", lambda: create(rljob("flaky", "sglang:d1t2", "fsdp:d2", maxRestarts=2, restartBackoffSeconds=5))),
        (70, "huge", lambda: create(rljob("huge", "sglang:d1t16", "fsdp:d16", gpusPerNode=16))),
        (100, "fail-1", lambda: fail_trainer("flaky")),
        (130, "paused", lambda: create(rljob("paused", "sglang:d1t2", "fsdp:d2"))),
        (170, "fail-2", lambda: fail_trainer("flaky")),
        (220, "suspend", lambda: custom.patch_namespaced_custom_object(
            "treetrain.dev", "v1alpha1", NAMESPACE, "rljobs", "paused", {"spec": {"suspend": True}})),
        (260, "fail-3", lambda: fail_trainer("flaky")),
    ]  # fmt: skip
    for at, key, action in steps:
        if elapsed >= at and key not in done:
            done.add(key)
            action()


# ---------------------------------------------------------------------------
# Scraping


def scrape(url: str, extra: dict[str, str]) -> list[dict[str, Any]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:  # loopback only
        text = response.read().decode()
    now = time.time()
    return [
        {"t": now, "name": s.name, "labels": {**extra, **s.labels}, "value": s.value}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "dashboard-samples.jsonl")
    args = parser.parse_args()
    seconds = args.minutes * 60
    if "KUBECONFIG" not in os.environ:
        print('capture: set KUBECONFIG first: eval "$(tests/cluster/up)"', file=sys.stderr)
        return 2
    from kubernetes import client, config

    api = config.new_client_from_config()
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    metrics, liveness = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [str(Path(sys.executable).parent / "rljob"), "operator", "--bind", "127.0.0.1",
             f"--metrics-port={metrics}", f"--liveness-port={liveness}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    ]  # fmt: skip
    targets = [(f"http://127.0.0.1:{metrics}/metrics", {})]
    workdir = args.out.parent / "capture-work"
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh start: no checkpoints of an earlier capture to resume
    workdir.mkdir(parents=True)
    for rljob_name, variant in (("agent-demo", False), ("grpo-demo", True)):
        port = free_port()
        log = (workdir / f"{rljob_name}.log").open("w")
        # One thread each: two trainers, the operator and the control plane share the machine.
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(trainer_argv(variant, port, workdir), stdout=log, stderr=subprocess.STDOUT, env=env)
        )
        pod = f"{rljob_name}-trainer-0"
        labels = {"namespace": NAMESPACE, "rljob": rljob_name, "component": "actor", "pod": pod}
        targets.append((f"http://127.0.0.1:{port}/metrics", labels))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start, done = time.monotonic(), set[str]()
    try:
        with args.out.open("w") as out:
            while (elapsed := time.monotonic() - start) < seconds:
                scenario(elapsed, done, api)
                for url, extra in targets:
                    try:
                        for sample in scrape(url, extra):
                            out.write(json.dumps(sample) + "\n")
                    except OSError:
                        pass  # not up yet, or finished: a gap, as Prometheus would see it
                out.flush()
                time.sleep(2.0)
    finally:
        for proc in procs:
            proc.terminate()  # a trainer finishes its step on SIGTERM: a minute or two for the variant
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
