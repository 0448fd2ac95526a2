"""The ``rljob`` command line: ``plan``, ``crd`` and ``operator``."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from rljob_operator.network import NetworkSettings
from rljob_operator.policy import Limits
from treetrain import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description="Tools and the operator for RLJob resources.")
    parser.add_argument("--version", action="version", version=f"rljob {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "plan",
        help="validate an RLJob manifest and show its GPUs, pods and nodes per component",
        description="Validate an RLJob manifest (a file or - for stdin) and print, per component: backend, GPUs, "
        "pods, GPUs per pod, nodes; how weights and checkpoints move; what the trainer runs (episodes, algorithm, "
        "steps, dtype, recompute). Exit 2 listing every problem when it is invalid.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help='print {"components": {...}, "total_gpus": N, ...}')
    p.add_argument("--objects", action="store_true", help="also print the child objects the operator would create")
    p.add_argument(
        "--config",
        action="store_true",
        help="also print the trainer config the operator writes (the ConfigMap NAME-config's config.yaml)",
    )
    p.add_argument(
        "--model-config",
        metavar="CONFIG_JSON",
        help="the model's Hugging Face config.json (or its directory): print each component's memory per GPU and "
        "refuse a layout that does not fit spec.gpuMemoryGiB (default: spec.model.config)",
    )
    p.set_defaults(func=_plan)

    c = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition (YAML)")
    c.set_defaults(func=_crd)

    o = sub.add_parser(
        "operator",
        help="run the operator (in a pod, or locally with KUBECONFIG)",
        description="Reconcile RLJobs. Watches all namespaces unless --namespace is given (repeatable).",
    )
    o.add_argument("-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    o.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0 disables)")
    o.add_argument("--liveness-port", type=int, default=8081, help="liveness endpoint /healthz port (0 disables)")
    o.add_argument("--max-gpus-per-rljob", type=int, default=Limits.max_gpus, metavar="N",
                   help=f"refuse RLJobs that ask for more GPUs (default {Limits.max_gpus})")  # fmt: skip
    o.add_argument("--max-pods-per-rljob", type=int, default=Limits.max_pods, metavar="N",
                   help=f"refuse RLJobs that ask for more pods (default {Limits.max_pods})")  # fmt: skip
    o.add_argument(
        "--allow-task-module",
        action="append",
        default=[],
        type=_module_name,
        metavar="MODULE",
        help="import only trainerConfig.task, .agent and .reward modules under MODULE; built-in tasks and rewards "
        "always pass (repeatable; default: any)",
    )
    o.add_argument(
        "--allow-image-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="run only spec.images under PREFIX, matched by whole path segments (repeatable; default: any)",
    )
    o.add_argument(
        "--allow-server-flag",
        action="append",
        default=[],
        type=_flag_name,
        metavar="FLAG",
        help="with allow-lists set, rollout servers take only flags that load no code; also allow FLAG in "
        "serverArgs (repeatable, e.g. --allow-server-flag=--trust-remote-code)",
    )
    o.add_argument(
        "--no-network-policy",
        action="store_true",
        help="create no NetworkPolicy per RLJob (default: one that admits only the RLJob's own pods and --metrics-from)",
    )
    o.add_argument(
        "--metrics-from",
        type=_peer,
        default=None,
        metavar="JSON",
        help="the Prometheus pods that may scrape the trainers' metrics port, as a NetworkPolicy peer: "
        '\'{"namespaceSelector": {...}, "podSelector": {...}}\' (default: none)',
    )
    o.add_argument(
        "--metrics-from-scrapes-servers",
        action="store_true",
        help="also open the rollout servers' port (their /metrics, and their whole API) to --metrics-from",
    )
    o.add_argument(
        "--bind",
        default=None,
        help="address for the metrics and liveness listeners (default: all interfaces inside a pod, "
        "where Prometheus and the kubelet reach the pod IP; loopback elsewhere)",
    )
    o.set_defaults(func=_operator)
    return parser


def _module_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a dotted module name (acme.tasks; no ':function')")
    return text


def _peer(text: str) -> dict[str, Any]:
    from rljob_operator.network import parse_peer

    try:
        return parse_peer(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _flag_name(text: str) -> str:
    if not re.fullmatch(r"--?[A-Za-z0-9][-A-Za-z0-9_]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a server flag name (--trust-remote-code; no '=VALUE')")
    return text if not text.startswith("--") else "--" + text[2:].replace("_", "-")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


def _load(path: str) -> Any:
    from treetrain.config.load import MAX_YAML_BYTES, ConfigError, read_yaml_documents

    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    with stream:
        text = stream.read(MAX_YAML_BYTES + 1)  # never more than the bound into memory
    try:
        docs = read_yaml_documents(text, path)
    except ConfigError as err:
        raise ValueError(err.problems[0][1].removeprefix(f"{path}: ")) from None
    if len(docs) != 1:
        raise ValueError(f"expected one YAML document, found {len(docs)}")
    return docs[0]


def _plan(args: argparse.Namespace) -> int:
    from rljob_operator.plan import PlanError, plan

    try:
        manifest = _load(args.file)
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"rljob plan: error: cannot read {args.file}: {err}", file=sys.stderr)
        return 2
    if _is_trainer_config(manifest):
        print(
            f"rljob plan: error: {args.file} is a trainer config (treetrain train {args.file}), not an RLJob "
            "manifest; an RLJob carries its model.path as spec.model.path and its trainer: section as "
            "spec.trainerConfig (examples/rljob.yaml)",
            file=sys.stderr,
        )
        return 2
    model_config = None
    if args.model_config is not None:
        from treetrain.alloc.memory import MemoryInputError, read_config

        try:
            model_config = read_config(args.model_config)
        except MemoryInputError as err:
            print(f"rljob plan: error: --model-config: {err}", file=sys.stderr)
            return 2
    try:
        result = plan(manifest, model_config=model_config)
    except PlanError as err:
        print(f"rljob plan: {args.file} is not a valid RLJob ({len(err.errors)} problems):", file=sys.stderr)
        for problem in err.errors:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    from treetrain.config import dump_yaml

    summary: dict[str, Any] = {
        **result.summary(),
        "weight_sync": result.weight_sync(),
        "checkpoints": result.checkpoints(),
        "trainer": result.trainer(),
    }
    if (endpoint := result.openai_endpoint()) is not None:
        summary["openai_endpoint"] = endpoint
    if not result.memory.skipped:  # a model config was given
        summary["memory"] = result.memory.summary()
    if args.objects:
        summary["objects"] = result.objects
    config_text = dump_yaml(result.config)
    if args.config:
        summary["config"] = yaml.safe_load(config_text)
    # No GPU size, but an estimate above every common GPU: said, not refused.
    for warning in result.memory.warnings:
        print(f"rljob plan: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"RLJob {result.namespace}/{result.name}: {summary['total_gpus']} GPUs")
    print(f"  {'component':<16}{'backend':<40}{'GPUs':>6}{'pods':>6}{'GPUs/pod':>10}{'nodes':>7}")
    for name, row in summary["components"].items():
        note = f"  (in {row['colocated_with']}'s pods)" if "colocated_with" in row else ""
        print(
            f"  {name:<16}{row['backend']:<40}{row['gpus']:>6}{row['pods']:>6}{row['gpus_per_pod']:>10}"
            f"{row['nodes']:>7}{note}"
        )
    for line in _notes(summary["weight_sync"], summary["checkpoints"]):
        print(line)
    print(_trainer_line(summary["trainer"]))
    for line in result.memory.lines():
        print(line)
    if "openai_endpoint" in summary:
        print(f"agent endpoint: {summary['openai_endpoint']} (trainer rank 0; the RLJob's own pods reach it)")
    if args.config:
        print(f"trainer config (ConfigMap {result.name}-config, config.yaml):")
        print(config_text, end="")
    if args.objects:
        print(yaml.safe_dump_all(result.objects, sort_keys=False))
    return 0


def _is_trainer_config(document: Any) -> bool:
    """A ``treetrain train`` config (model, actor, trainer, ... at the top) given as an RLJob."""
    from treetrain.config import TrainConfig

    if not isinstance(document, dict) or not document or {"apiVersion", "kind", "spec"} & set(document):
        return False
    sections = {info.alias or name for name, info in TrainConfig.model_fields.items()}
    rollout = document.get("rollout")
    # A bare RLJob spec has these keys too, but its rollout names a backend.
    return set(document) <= sections and not (isinstance(rollout, dict) and "backend" in rollout)


def _trainer_line(t: Mapping[str, Any]) -> str:
    """What the trainer pods run, in one line."""
    episodes = t["episodes"] + (f" on {t['dataset']}" if t["dataset"] and t["episodes"].startswith("agent") else "")
    reward = f", reward {t['reward']}" if t["reward"] else ""
    recompute = "gradient checkpointing" if t["gradient_checkpointing"] else "no gradient checkpointing"
    return (
        f"trainer: {episodes}{reward}, {t['algorithm']}, {t['steps']} steps of {t['groups_per_step']} groups x "
        f"{t['group_size']} samples; {t['dtype']}, {recompute}, micro-batches of {t['max_tokens_per_microbatch']} "
        "tokens"
    )


def _notes(sync: dict[str, Any], checkpoints: dict[str, Any]) -> list[str]:
    """How weights reach the servers, and whether checkpoints survive a restart."""
    if sync["method"] == "disk":
        lines = [f"weight sync: disk, the servers reload {sync['dir']} (claim {sync['claim']}, mounted in every pod)"]
    else:
        ranks = ", ".join(f"{name} {r}" for name, r in sync["ranks"].items())
        lines = [
            f"weight sync: distributed, rendezvous {sync['rendezvous']}, world size {sync['world_size']} ({ranks})"
        ]
    if checkpoints["persistent"]:
        lines.append(f"checkpoints: {checkpoints['dir']} on claim {checkpoints['claim']}; a restart resumes from them")
    else:
        lines.append(f"checkpoints: ephemeral: {checkpoints['why']}")
    return lines


def _crd(args: argparse.Namespace) -> int:
    from rljob_operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def default_bind(env: Mapping[str, str]) -> str:
    """All interfaces in a pod (the kubelet and Prometheus dial the pod IP), loopback elsewhere."""
    return "0.0.0.0" if env.get("KUBERNETES_SERVICE_HOST") else "127.0.0.1"


def _operator(args: argparse.Namespace) -> int:
    from rljob_operator.runner import run_operator

    code: int = run_operator(
        namespaces=args.namespace,
        metrics_port=args.metrics_port,
        liveness_port=args.liveness_port,
        bind=args.bind or default_bind(os.environ),
        limits=Limits(
            max_gpus=args.max_gpus_per_rljob,
            max_pods=args.max_pods_per_rljob,
            task_modules=tuple(args.allow_task_module),
            image_prefixes=tuple(args.allow_image_prefix),
            server_flags=tuple(args.allow_server_flag),
            network=NetworkSettings(
                enabled=not args.no_network_policy,
                metrics_from=args.metrics_from,
                scrape_servers=args.metrics_from_scrapes_servers,
            ),
        ),
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
