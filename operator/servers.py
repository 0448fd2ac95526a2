"""Rollout server command lines from a backend string.

``d`` in ``sglang:d2t4`` counts server *instances* (separate pods), so each server
gets data parallel 1; ``t`` and ``p`` become the server's own tensor and pipeline
parallel sizes. Full flag spellings only: SGLang accepts ``--tp`` merely as an
argparse prefix, and ``--pp`` is ambiguous there.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from treetrain.alloc import Allocation

SGLANG_DIST_PORT = 20000
VLLM_MASTER_PORT = 29501


@dataclass(frozen=True, slots=True)
class MultiNode:
    """One instance spread over several pods; rank and leader are known only in the pod."""

    nnodes: int
    rank_var: str  # shell variable holding this pod's rank inside its instance
    leader_var: str  # shell variable holding the instance leader's DNS name


def server_argv(
    allocation: Allocation, *, model: str, port: int, extra_args: list[str], multi_node: MultiNode | None = None
) -> list[str]:
    """The server's argv for one pod of one instance."""
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
        if multi_node is not None:
            argv += [
                "--nnodes", str(multi_node.nnodes),
                "--node-rank", f"${multi_node.rank_var}",
                "--dist-init-addr", f"${multi_node.leader_var}:{SGLANG_DIST_PORT}",
            ]  # fmt: skip
    elif allocation.backend == "vllm":
        argv = [
            "vllm", "serve", model,
            "--host", "0.0.0.0",
            "--port", str(port),
            "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp),
        ]  # fmt: skip
        if multi_node is not None:
            argv += [
                "--nnodes", str(multi_node.nnodes),
                "--node-rank", f"${multi_node.rank_var}",
                "--master-addr", f"${multi_node.leader_var}",
                "--master-port", str(VLLM_MASTER_PORT),
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


def multi_node_command(argv: list[str], *, backend: str, pods_per_instance: int, leader_dns: str) -> list[str]:
    """Wrap ``argv`` for instances of several pods: each pod derives its rank in the
    instance and the leader's DNS name from its StatefulSet ordinal (``$POD_INDEX``).

    ``leader_dns`` contains ``{ordinal}``, e.g. ``job-rollout-{ordinal}.job-rollout.ns.svc``.
    """
    leader = leader_dns.format(ordinal="$((POD_INDEX - RANK))")
    script = f'RANK=$((POD_INDEX % {pods_per_instance})); LEADER="{leader}"; '
    if backend == "vllm":
        # vLLM's non-leader nodes run workers only, with no API server.
        script += 'if [ "$RANK" -ne 0 ]; then set -- --headless; else set --; fi; '
    else:
        script += "set --; "
    script += "exec " + " ".join(_sh(arg) for arg in argv) + ' "$@"'
    return ["/bin/sh", "-c", script]


def _sh(arg: str) -> str:
    if arg.startswith("$"):
        return f'"{arg}"'  # a shell variable reference: expand it
    return shlex.quote(arg)
