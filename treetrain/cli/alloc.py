"""``treetrain alloc SPEC... [--json]``: parse backend strings and show their GPUs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treetrain.alloc import AllocationError, migration_yaml, parse, plan_pods, registry

EXAMPLES = """\
examples:
  treetrain alloc sglang:d2t4 fsdp:d4t2
  treetrain alloc 'megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)' --json
  treetrain alloc fsdp:d16 --gpus-per-node 8
  treetrain alloc --migrate 'sglang:d4+fsdp:d4'

letters: d data parallel (rollout servers: server instances), t tensor, p pipeline,
c context, e expert; world size = d*t*p*c. Backends: {backends}.
"""


def backends_help() -> str:
    """``sglang, vllm (d/t/p); fsdp (d/t/c); ...``: the registry's backends grouped by what they take."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for name in registry.names():
        letters = registry.spec_of(name).letters
        groups.setdefault((letters.accepted, letters.hybrid), []).append(name)
    return "; ".join(
        f"{', '.join(group)} ({'/'.join(accepted)}{' and (attn:...|ffn:...)' if hybrid else ''})"
        for (accepted, hybrid), group in groups.items()
    )


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "alloc",
        help="parse backend strings (sglang:d2t4, fsdp:d4t2, ...) into parallel sizes and GPUs",
        description="Parse backend strings into parallel sizes and GPU counts. "
        "Exit 0 when all parse, 2 when any is invalid (the others are still printed).",
        epilog=EXAMPLES.format(backends=backends_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("specs", nargs="*", metavar="SPEC", help="backend strings, one engine each")
    p.add_argument("--json", action="store_true", help="print one JSON object per SPEC, one per line")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="also lay each SPEC out on nodes of N GPUs")
    p.add_argument(
        "--migrate",
        metavar="LEGACY",
        help="print the per-engine backend fields that replace a legacy string like 'sglang:d4+fsdp:d4'",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.migrate is None and not args.specs:
        print("treetrain alloc: error: give at least one SPEC (e.g. fsdp:d8) or --migrate LEGACY", file=sys.stderr)
        return 2
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        print("treetrain alloc: error: --gpus-per-node must be >= 1", file=sys.stderr)
        return 2
    code = 0
    if args.migrate is not None:
        try:
            print(migration_yaml(args.migrate))
        except AllocationError as err:
            print(f"treetrain alloc: error: {err}", file=sys.stderr)
            code = 2
    for spec in args.specs:
        try:
            row = describe(spec, args.gpus_per_node)
        except AllocationError as err:
            code = 2
            if args.json:
                print(json.dumps({"spec": spec, "error": str(err), "column": err.column}))
            else:
                print(f"treetrain alloc: error: {err}", file=sys.stderr)
            continue
        print(json.dumps(row) if args.json else _text(row))
    return code


def describe(spec: str, gpus_per_node: int | None) -> dict[str, Any]:
    """The JSON object for one spec (docs/contracts.md's keys, plus ``spec`` and ``canonical``)."""
    allocation = parse(spec)
    row: dict[str, Any] = {"spec": spec, **allocation.to_dict()}
    if gpus_per_node is not None:
        plan = plan_pods(allocation, gpus_per_node)
        row.update(pods=plan.pods, gpus_per_pod=plan.gpus_per_pod, nodes=plan.nodes)
    return row


def _text(row: dict[str, Any]) -> str:
    sizes = " ".join(f"{k}={row[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "etp"))
    line = f"{row['canonical']}: {row['kind']} {sizes} world_size={row['world_size']}"
    if row["kind"] == "inference":
        line += f" ({row['instances']} instances x {row['gpus_per_instance']} GPUs)"
    if "pods" in row:
        nodes = f"{row['nodes']} node" + ("s" if row["nodes"] != 1 else "")
        line += f"; {row['pods']} pods x {row['gpus_per_pod']} GPUs on {nodes}"
    return line
