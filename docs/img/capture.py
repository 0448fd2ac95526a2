"""Capture real metrics of a local run, for the dashboard pictures in docs/metrics.md.

    make cluster-bin && eval "$(tests/cluster/up)"
    .venv/bin/python docs/img/capture.py --minutes 8 --out build/dashboard-samples.jsonl
    tests/cluster/down
    .venv/bin/python docs/img/render.py build/dashboard-samples.jsonl   # needs matplotlib

What runs, all on this machine (loopback only):

- ``rljob operator`` against the test control plane (simulated GPU nodes), with a scenario of
  RLJobs: two that run, one whose trainer fails until it is Failed, one too big to schedule, one
  suspended. Its /metrics is scraped as the ServiceMonitor would (honouring its labels).
- Two local training loops standing in for trainer pods (the trainer of issue 6 does not serve
  metrics yet): a tiny Llama (random init, CPU, fp32) trained with treetrain's tree packing and
  tree attention on synthetic RL-shaped batches from bench/workloads.py (agentic multi-turn and
  GRPO shapes), a fixed cycle of batches so the loss falls. Each exports DESIGN.md's trainer
  metrics on a loopback port; the scraper adds the labels the PodMonitor would add (namespace,
  rljob, component, pod). There is no rollout and so no reward: the Reward panel stays empty.

Every 2 s each target is scraped and every sample is written as one JSON line
``{"t": unix_time, "name": ..., "labels": {...}, "value": ...}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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
# A local training loop with the trainer's metrics


def train(port: int, workload: str, seconds: float) -> None:
    import torch
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

    sys.path.insert(0, str(ROOT / "bench"))
    from train_step import tiny_llama  # type: ignore[import-not-found]
    from workloads import agentic, grpo  # type: ignore[import-not-found]

    from treetrain.attention import TreeAttentionMeta, tree_forward
    from treetrain.logprob import TreeTensors, gather_logprobs
    from treetrain.tree import PackConfig, pack

    torch.set_num_threads(1)
    registry = CollectorRegistry()
    ratio = Gauge("treetrain_tree_token_ratio", "Tree tokens / original tokens of the last batch.", registry=registry)
    tokens = Counter("treetrain_tokens", "Tokens by kind.", ["kind"], registry=registry)
    step_time = Histogram(
        "treetrain_step_duration_seconds",
        "Optimizer step time.",
        buckets=(0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        registry=registry,
    )
    tps = Gauge("treetrain_train_tokens_per_second", "Original tokens trained per second.", registry=registry)
    steps = Counter("treetrain_steps", "Optimizer steps.", registry=registry)
    loss_g = Gauge("treetrain_loss", "Loss of the last step.", registry=registry)
    start_http_server(port, addr="127.0.0.1", registry=registry)

    vocab, block = 512, 64
    model = tiny_llama(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scale = 0.08

    def batch(seed: int) -> list[list[int]]:
        if workload == "agentic":
            seqs = agentic(1, 4, scale=scale, seed=seed)
        else:
            seqs = grpo(6, 512, 768, 8, scale=scale, seed=seed)
        return [[t % vocab for t in s] for s in seqs]

    batches = [pack(batch(seed), PackConfig(max_tokens_per_mb=2048, block_size=block)) for seed in range(6)]
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        packed = batches[step % len(batches)]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = packed.stats.original_tokens - packed.stats.num_sequences
        loss_sum = 0.0
        for tree in packed.trees:
            tensors = TreeTensors.from_tree(tree, torch.device("cpu"))
            meta = TreeAttentionMeta.from_tree(tree, backend="sparse", block_size=block, device=torch.device("cpu"))
            with tree_forward():
                logits = model(
                    input_ids=tensors.input_ids_N[None],
                    position_ids=tensors.position_ids_N[None],
                    use_cache=False,
                    tree_attention=meta,
                ).logits
            logits = logits.view(logits.shape[-2], logits.shape[-1])
            logp, _ = gather_logprobs(logits, tensors.pred_M, tensors.label_M)
            loss = -logp.sum() / total
            loss.backward()
            loss_sum += loss.detach().item()  # CPU: no device sync to worry about
        optimizer.step()
        elapsed = time.perf_counter() - t0
        stats = packed.stats
        ratio.set(stats.tree_token_ratio)
        tokens.labels(kind="original").inc(stats.original_tokens)
        tokens.labels(kind="tree").inc(stats.tree_tokens)
        tokens.labels(kind="padded").inc(stats.padded_tokens)
        step_time.observe(elapsed)
        tps.set(stats.original_tokens / elapsed)
        steps.inc()
        loss_g.set(loss_sum)
        step += 1


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
    parser.add_argument("--trainer", choices=["agentic", "grpo"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seconds = args.minutes * 60
    if args.trainer:
        train(args.port, args.trainer, seconds)
        return 0
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
    for rljob_name, workload in (("agent-demo", "agentic"), ("grpo-demo", "grpo")):
        port = free_port()
        trainer_seconds = seconds - (20 if rljob_name == "agent-demo" else 60)
        argv = [sys.executable, __file__, "--trainer", workload, "--port", str(port)]
        procs.append(subprocess.Popen([*argv, "--minutes", str(trainer_seconds / 60)]))
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
            proc.terminate()
            proc.wait(30)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
