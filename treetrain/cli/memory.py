"""``treetrain memory --model DIR_OR_CONFIG_JSON --backend B --max-tokens N``: memory per GPU
of one engine before launch (parameters, gradients, optimizer state exact; activations an
estimate)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treetrain.alloc import AllocationError, parse
from treetrain.alloc.memory import (
    DTYPE_BYTES,
    GIB,
    ROLES,
    MemoryInputError,
    MemoryPlan,
    estimate,
    fitting_layout,
    read_config,
    server_weight_bytes,
)

EXAMPLES = """\
examples:
  treetrain memory --model examples/model-configs/qwen3-8b.json --backend megatron:d2t4 --max-tokens 32768
  treetrain memory --model /models/Qwen3-8B --backend fsdp:d8 --max-tokens 16384 --json
  treetrain memory --model qwen3-32b.json --backend megatron:t8 --max-tokens 8192 --gpu-gib 80

Parameters, gradients and optimizer state are exact for the engine's sharding; activations
are an estimate for one micro-batch of --max-tokens tree tokens (docs/engines.md, Memory plan).
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "memory",
        help="memory per GPU of a backend layout for a model (before launch)",
        description="Memory per GPU of one engine for a model: exit 0, or 2 on bad input.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR_OR_CONFIG_JSON", help="a model directory or its config.json")
    p.add_argument("--backend", required=True, metavar="B", help="a backend string, e.g. megatron:d2t4")
    p.add_argument("--max-tokens", type=int, metavar="N", default=0, help="tree tokens of one micro-batch")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="model.dtype (default bfloat16)")
    p.add_argument("--role", default="actor", choices=ROLES, help="actor, critic or ref (no gradients)")
    p.add_argument("--recompute", action="store_true", help="gradient checkpointing on")
    p.add_argument(
        "--gpu-gib", type=float, metavar="G", help="also say whether it fits G GiB and name a layout that does"
    )
    p.add_argument("--json", action="store_true", help="one JSON object; per_rank holds the largest rank's bytes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = read_config(args.model)
        allocation = parse(args.backend)
        if allocation.kind == "inference":
            row = _server(config, args)
        else:
            if args.max_tokens < 1:
                raise MemoryInputError("--max-tokens is missing", "give the micro-batch's tree tokens, e.g. 16384")
            plan = estimate(
                config, allocation, tokens=args.max_tokens, dtype=args.dtype, role=args.role, recompute=args.recompute
            )
            row = plan.to_dict()
            if args.gpu_gib is not None:
                row["fit"] = _fit(config, plan, args)
    except (MemoryInputError, AllocationError) as err:
        print(f"treetrain memory: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(row) if args.json else _text(row))
    return 0


def _server(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    allocation = parse(args.backend)
    weights = server_weight_bytes(config, allocation, args.dtype)
    zero = {"parameters": weights, "gradients": 0, "optimizer": 0, "activations": 0, "total": weights}
    note = "weights only: the server fills the rest of each GPU with its KV cache and CUDA graphs"
    return {"per_rank": zero, "backend": str(allocation), "role": "rollout", "dtype": args.dtype, "notes": [note]}


def _fit(config: dict[str, Any], plan: MemoryPlan, args: argparse.Namespace) -> dict[str, Any]:
    limit = int(args.gpu_gib * GIB)
    out: dict[str, Any] = {"gpu_bytes": limit, "fits": plan.largest.total <= limit}
    if not out["fits"]:
        found = fitting_layout(
            config,
            plan.allocation,
            limit,
            tokens=plan.tokens,
            dtype=plan.dtype,
            role=plan.role,
            recompute=plan.recompute,
        )
        out["fits_instead"] = str(found[0]) if found else None
    return out


def _text(row: dict[str, Any]) -> str:
    lines = [
        f"{row['backend']} {row['role']} ({row['dtype']}"
        + (f", {row['max_tokens']} tree tokens)" if "max_tokens" in row else ")")
    ]
    keys = ("parameters", "gradients", "optimizer", "activations", "total")
    stages = row.get("stages") or [{"stage": 0, **row["per_rank"]}]
    lines.append(f"{'per GPU (GiB)':<14}" + "".join(f"{k:>12}" for k in keys))
    for s in stages:
        label = f"stage {s['stage']}" if len(stages) > 1 else "each rank"
        lines.append(f"{label:<14}" + "".join(f"{s[k] / GIB:>12.2f}" for k in keys))
    if "param_dtype" in row:
        lines.append(f"parameters kept in {row['param_dtype']}")
    lines += [f"note: {n}" for n in row.get("notes", [])]
    fit = row.get("fit")
    if fit is not None:
        size = f"{fit['gpu_bytes'] / GIB:.0f} GiB"
        if fit["fits"]:
            lines.append(f"fits a {size} GPU")
        else:
            other = fit.get("fits_instead")
            lines.append(
                f"does NOT fit a {size} GPU; " + (f"{other} fits" if other else "no layout up to 1024 GPUs fits")
            )
    return "\n".join(lines)
