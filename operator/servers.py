"""Rollout server command lines from a backend string.

``d`` in ``sglang:d2t4`` counts server *instances* (separate pods), so each server
gets data parallel 1; ``t`` and ``p`` become the server's own tensor and pipeline
parallel sizes. Full flag spellings only: SGLang accepts ``--tp`` merely as an
argparse prefix, and ``--pp`` is ambiguous there.
"""

from __future__ import annotations

import re

from treetrain.alloc import Allocation

SGLANG_DIST_PORT = 20000
VLLM_MASTER_PORT = 29501


def server_argv(allocation: Allocation, *, model: str, port: int, extra_args: list[str]) -> list[str]:
    """The server's argv for one instance (a multi-pod instance adds its node flags in the pod:
    :func:`multi_node_command`)."""
    tp, pp = allocation.dims.tp, allocation.dims.pp
    if allocation.backend == "sglang":
        argv = [
            "python3", "-m", "sglang.launch_server",
            "--model-path", model,
            "--host", "0.0.0.0",
            "--port", str(port),
            "--tp-size", str(tp),
            "--pp-size", str(pp),
            "--dp-size", "1",
            "--enable-metrics",
        ]  # fmt: skip
    elif allocation.backend == "vllm":
        argv = [
            "vllm", "serve", model,
            "--host", "0.0.0.0",
            "--port", str(port),
            "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp),
        ]  # fmt: skip
    else:
        raise ValueError(f"{allocation.backend} is not a rollout server backend")
    return argv + list(extra_args)


def server_env(backend: str) -> list[dict[str, object]]:
    """Environment that keeps the servers healthy under Kubernetes."""
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    if backend == "sglang":
        return [
            {"name": "SGLANG_HOST_IP", **pod_ip},
            # /health would otherwise run a generate, which blocks while weights are being
            # updated, so probes would kill servers mid-update.
            {"name": "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "value": "false"},
        ]
    return [{"name": "VLLM_HOST_IP", **pod_ip}]


# Our vLLM worker extension (treetrain/rl/vllm_worker.py, in the trainer image that also runs the
# servers): the workers join the trainer's weight-update group and receive the broadcast buckets.
VLLM_WORKER_EXTENSION = "treetrain.rl.vllm_worker.WeightSyncExtension"


def vllm_weight_sync(method: str) -> tuple[list[str], list[dict[str, object]]]:
    """(flags, env) a vLLM server needs for the trainer's weight sync (``method``: distributed
    or disk): dev mode for ``/pause``, ``/resume`` and ``/collective_rpc`` (404 without it), and
    our worker extension, whose methods ``/collective_rpc`` calls for either method: it joins
    the broadcast, loads a directory exactly (vLLM's own reload leaves a tied ``lm_head``
    stale) and reports the weight version it holds, which is how a restart is noticed."""
    env: list[dict[str, object]] = [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]
    return ["--worker-extension-cls", VLLM_WORKER_EXTENSION], env


def multi_node_command(argv: list[str], *, backend: str, pods_per_instance: int, leader_dns: str) -> list[str]:
    """Wrap ``argv`` for instances of several pods: each pod derives its rank in the instance
    and the leader's DNS name from its StatefulSet ordinal (``$POD_INDEX``), then adds the node
    flags.

    The server's argv (model path, user ``serverArgs``) is passed to the shell as arguments
    (``"$@"``), never pasted into the script: nothing a user writes is evaluated by the shell.
    ``leader_dns`` contains ``{ordinal}``, e.g. ``job-rollout-{ordinal}.job-rollout.ns.svc``;
    it is built from names the planner validated as DNS labels.
    """
    if not re.fullmatch(r"[a-z0-9.{}-]+", leader_dns):
        raise ValueError(f"leader DNS name {leader_dns!r} is not a plain DNS name")
    leader = leader_dns.format(ordinal="$((POD_INDEX - RANK))")
    script = f'RANK=$((POD_INDEX % {pods_per_instance})); LEADER="{leader}"; '
    if backend == "vllm":
        nodes = (
            f'--nnodes {pods_per_instance} --node-rank "$RANK" --master-addr "$LEADER" --master-port {VLLM_MASTER_PORT}'
        )
        # vLLM's non-leader nodes run workers only, with no API server.
        script += f'if [ "$RANK" -ne 0 ]; then exec "$@" {nodes} --headless; fi; exec "$@" {nodes}'
    else:
        script += (
            f'exec "$@" --nnodes {pods_per_instance} --node-rank "$RANK" --dist-init-addr "$LEADER:{SGLANG_DIST_PORT}"'
        )
    return ["/bin/sh", "-c", script, "rollout-server", *argv]
