"""``treetrain memory --model DIR_OR_CONFIG_JSON --backend B --max-tokens N``: memory per GPU
of one engine before launch (parameters, gradients, optimizer state exact; activations an
estimate), and with ``--gpu-gib`` whether it fits and what would. With a LoRA adapter
(``--lora-rank``, or a trainer config's ``actor.lora`` through ``--config``) the base is frozen
and only the adapter has gradients and optimizer state; the output compares it with full
fine-tuning.

Exit codes: 0 (printed; with ``--gpu-gib``: it fits), 1 (``--gpu-gib`` given and the plan
does not fit: a "no", not an error), 2 (bad input)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from treetrain.alloc import AllocationError, parse
from treetrain.alloc.lora import ALL_LINEAR, LoraShape, LoraTargetError, resolve_targets
from treetrain.alloc.memory import (
    COMMON_GPU_GIB,
    DEFAULT_BLOCK_SIZE,
    DTYPE_BYTES,
    GIB,
    ROLES,
    FitChange,
    MemoryInputError,
    MemoryPlan,
    changes_that_fit,
    estimate,
    exceeds_common_gpus,
    plan_dtype,
    read_config,
    server_weight_bytes,
)

DOES_NOT_FIT = 1  # exit code: --gpu-gib given and the plan does not fit
BAD_INPUT = 2

EXAMPLES = f"""\
examples:
  treetrain memory --model examples/model-configs/qwen3-8b.json --backend megatron:d2t4 --max-tokens 32768
  treetrain memory --model /models/Qwen3-8B --backend fsdp:d8 --max-tokens 16384 --json
  treetrain memory --model qwen3-32b.json --backend megatron:t8 --max-tokens 8192 --gpu-gib 80
  treetrain memory --model examples/model-configs/qwen3-8b.json --backend fsdp:d8 --max-tokens 32768 --lora-rank 16
  treetrain memory --model examples/model-configs/qwen3-8b.json --config trainer.yaml   # its actor's layout and LoRA

Parameters, gradients and optimizer state are exact for the engine's sharding; activations
are an estimate for one micro-batch of --max-tokens tree tokens (docs/engines.md, Memory plan).
--dtype auto (the trainer's default) is planned as bfloat16: the trainer resolves it to
bfloat16 on GPUs. A 16-bit dtype keeps fp32 master weights on every engine and layout.
With LoRA (--lora-rank, or --config's actor.lora) the base is frozen in the compute dtype
(no gradients, no optimizer state) and the fp32 adapter has both; the output says the
trainable parameters and optimizer bytes per rank against full fine-tuning.

exit codes: 0 printed (with --gpu-gib: it fits), {DOES_NOT_FIT} --gpu-gib given and it does not fit
(the output names the changes that would fit), {BAD_INPUT} bad input.
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "memory",
        help="memory per GPU of a backend layout for a model (before launch)",
        description=f"Memory per GPU of one engine for a model: exit 0, {DOES_NOT_FIT} when it does not fit "
        f"--gpu-gib, {BAD_INPUT} on bad input.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR_OR_CONFIG_JSON", help="a model directory or its config.json")
    p.add_argument(
        "--config",
        metavar="CONFIG",
        help="a trainer config YAML: its actor.backend, maxTokensPerMicrobatch, model.dtype, gradientCheckpointing "
        "and actor.lora, where the flags do not say",
    )
    p.add_argument("--backend", metavar="B", help="a backend string, e.g. megatron:d2t4")
    p.add_argument("--max-tokens", type=int, metavar="N", default=0, help="tree tokens of one micro-batch")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", *sorted(DTYPE_BYTES)],
        help="model.dtype (default auto, planned as bfloat16 like the trainer on GPUs)",
    )
    p.add_argument("--role", default="actor", choices=ROLES, help="actor, critic or ref (no gradients)")
    p.add_argument("--recompute", action="store_true", default=None, help="gradient checkpointing on")
    p.add_argument("--lora-rank", type=int, metavar="R", help="plan a LoRA adapter of rank R (actor.lora.rank)")
    p.add_argument(
        "--lora-targets",
        metavar="T",
        help=f"{ALL_LINEAR} (the default) or a comma-separated list, e.g. q_proj,v_proj (actor.lora.targetModules)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="B",
        help=f"the attention block (actor.treeTraining.blockSize, default {DEFAULT_BLOCK_SIZE}): a suggested "
        "--max-tokens is a multiple of lcm(B, t*c)",
    )
    p.add_argument(
        "--gpu-gib",
        type=float,
        metavar="G",
        help=f"say whether it fits G GiB and, if not, what would (exit {DOES_NOT_FIT} when it does not fit)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object; per_rank holds the largest rank's bytes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.gpu_gib is not None and not args.gpu_gib > 0:
            raise MemoryInputError(f"--gpu-gib {args.gpu_gib} is not > 0", "give the GPU's memory in GiB, e.g. 80")
        if args.block_size < 1:
            raise MemoryInputError(f"--block-size {args.block_size} is not >= 1", "give the attention block, e.g. 128")
        lora = _settings(args)
        config = read_config(args.model)
        if args.backend is None:
            raise MemoryInputError("--backend is missing", "give --backend B, or --config with actor.backend")
        allocation = parse(args.backend)
        if allocation.kind == "inference":
            row = _server(config, args)
        else:
            if args.max_tokens < 1:
                raise MemoryInputError("--max-tokens is missing", "give the micro-batch's tree tokens, e.g. 16384")
            settings = {"tokens": args.max_tokens, "dtype": args.dtype, "role": args.role, "recompute": args.recompute}
            plan = estimate(config, allocation, **settings, lora=lora)
            row = plan.to_dict()
            if lora is not None:
                row["lora"] = _lora_row(plan, estimate(config, allocation, **settings))
            if args.dtype == "auto":
                row["notes"].insert(0, f"dtype auto is planned as {plan.dtype} (what the trainer picks on GPUs)")
            if args.gpu_gib is not None:
                row["fit"] = _fit(config, plan, args)
            elif exceeds_common_gpus(plan.largest.total):
                row["warnings"] = [
                    f"{plan.largest.total / GIB:.1f} GiB per GPU is more than every common GPU size "
                    f"({', '.join(map(str, COMMON_GPU_GIB))} GiB); give --gpu-gib G to see what would fit"
                ]
    except (MemoryInputError, AllocationError) as err:
        print(f"treetrain memory: error: {err}", file=sys.stderr)
        return BAD_INPUT
    print(json.dumps(row) if args.json else _text(row))
    fit = row.get("fit")
    return DOES_NOT_FIT if fit is not None and not fit["fits"] else 0


def _settings(args: argparse.Namespace) -> LoraShape | None:
    """Fill the flags a trainer config (``--config``) gives, and return the adapter to plan
    (``--lora-rank``/``--lora-targets``, else the config's ``actor.lora``; None: full fine-tuning)."""
    lora: LoraShape | None = None
    if args.config is not None:
        from treetrain import config as config_mod

        try:
            cfg, _ = config_mod.load(args.config, env=dict(os.environ))
        except config_mod.ConfigError as err:
            where, message = err.problems[0]
            every = f"; `treetrain check {args.config}` lists all {len(err.problems)}" if len(err.problems) > 1 else ""
            raise MemoryInputError(f"{args.config}: {where}: {message}", f"correct the config{every}") from None
        args.backend = args.backend or cfg.actor.backend
        args.max_tokens = args.max_tokens or cfg.actor.tree_training.max_tokens_per_mb
        args.dtype = args.dtype or cfg.model.dtype
        args.recompute = cfg.model.gradient_checkpointing if args.recompute is None else args.recompute
        if cfg.actor.lora is not None and args.role == "actor":  # the critic and ref train no adapter
            lora = cfg.actor.lora.shape()
    args.dtype, args.recompute = args.dtype or "auto", bool(args.recompute)
    if args.lora_rank is None:
        if args.lora_targets is not None and lora is None:
            raise MemoryInputError("--lora-targets needs --lora-rank", "give --lora-rank R, e.g. 16")
        if args.lora_targets is not None and lora is not None:
            lora = LoraShape(lora.rank, _targets(args.lora_targets))
        return lora
    if args.lora_rank < 1:
        raise MemoryInputError(f"--lora-rank {args.lora_rank} is not >= 1", "give the adapter's rank, e.g. 16")
    targets = _targets(args.lora_targets) if args.lora_targets is not None else lora.targets if lora else None
    return LoraShape(args.lora_rank, targets or resolve_targets(ALL_LINEAR))


def _targets(text: str) -> tuple[str, ...]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return resolve_targets(names[0] if names == [ALL_LINEAR] else names)
    except LoraTargetError as err:
        what = str(err).split("; valid")[0].removeprefix("targetModules ")
        raise MemoryInputError(f"--lora-targets {what}", _valid_targets(err)) from None


def _valid_targets(err: LoraTargetError) -> str:
    _, _, valid = str(err).partition("; valid: ")
    return (
        f"use {ALL_LINEAR} or a comma-separated list of {valid.removeprefix(ALL_LINEAR + ', ')}" if valid else str(err)
    )


def _lora_row(plan: MemoryPlan, full: MemoryPlan) -> dict[str, Any]:
    """The adapter's figures per rank (the largest rank) beside full fine-tuning's."""
    assert plan.lora is not None
    mine, whole = plan.largest, full.largest
    return {
        "rank": plan.lora.rank,
        "targets": list(plan.lora.targets),
        "trainable_per_rank": mine.trainable,
        "optimizer_per_rank": mine.optimizer,
        "full_trainable_per_rank": whole.trainable,
        "full_optimizer_per_rank": whole.optimizer,
        "full_static_per_rank": whole.static,
        "full_total_per_rank": whole.total,
        "static_saved_per_rank": whole.static - mine.static,
    }


def _server(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    allocation = parse(args.backend)
    weights = server_weight_bytes(config, allocation, args.dtype)
    zero = {"parameters": weights, "gradients": 0, "optimizer": 0, "activations": 0, "total": weights}
    note = "weights only: the server fills the rest of each GPU with its KV cache and CUDA graphs"
    return {
        "per_rank": zero,
        "backend": str(allocation),
        "role": "rollout",
        "dtype": plan_dtype(args.dtype),
        "notes": [note],
    }


def _fit(config: dict[str, Any], plan: MemoryPlan, args: argparse.Namespace) -> dict[str, Any]:
    limit = int(args.gpu_gib * GIB)
    out: dict[str, Any] = {"gpu_bytes": limit, "fits": plan.largest.total <= limit}
    if not out["fits"]:
        changes = changes_that_fit(config, plan, limit, block_size=args.block_size)
        out["changes"] = [{"change": c.change, "value": c.value, "total": c.total, "line": _line(c)} for c in changes]
        layout = next((c.value for c in changes if c.change == "layout"), None)
        out["fits_instead"] = layout  # the layout of the same engine that fits (None: none up to 1024 GPUs)
    return out


def _line(c: FitChange) -> str:
    """One suggestion: what to set (the flag here, the config key in the trainer), and its total."""
    size = f"{c.total / GIB:.1f} GiB"
    if c.change == "recompute":
        return f"gradient checkpointing: --recompute (model.gradientCheckpointing: true), {size}"
    if c.change == "dtype":
        return f"bfloat16: --dtype {c.value} (model.dtype: {c.value}), {size}"
    if c.change == "tokens":
        return (
            f"{c.value} tree tokens per micro-batch: --max-tokens {c.value} "
            f"(actor.treeTraining.maxTokensPerMicrobatch: {c.value}), {size}"
        )
    gpus = c.plan.allocation.world_size
    return f"the layout {c.value} ({gpus} GPUs): --backend {c.value}, {size}"


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
        lines.append(_precision_line(row))
    if row.get("lora") and "full_trainable_per_rank" in row["lora"]:
        lines.append(_lora_line(row["lora"]))
    lines += [f"note: {n}" for n in row.get("notes", [])]
    lines += [f"warning: {w}" for w in row.get("warnings", [])]
    fit = row.get("fit")
    if fit is not None:
        size = f"{fit['gpu_bytes'] / GIB:g} GiB"
        if fit["fits"]:
            lines.append(f"fits a {size} GPU")
        elif fit["changes"]:
            lines.append(f"does NOT fit a {size} GPU; each of these would:")
            lines += [f"  {c['line']}" for c in fit["changes"]]
        else:
            lines.append(
                f"does NOT fit a {size} GPU, and no single change (recompute, bfloat16, fewer tokens, a layout up to 1024 GPUs) makes it fit"
            )
    return "\n".join(lines)


def _lora_line(lora: dict[str, Any]) -> str:
    mine, full = lora["trainable_per_rank"], lora["full_trainable_per_rank"]
    saved = lora["static_saved_per_rank"]
    share = saved / lora["full_static_per_rank"] if lora["full_static_per_rank"] else 0.0
    return (
        f"LoRA rank {lora['rank']}: {mine / 1e6:.2f} M trainable parameters and {lora['optimizer_per_rank'] / GIB:.2f} "
        f"GiB optimizer state per rank; full fine-tuning {full / 1e6:.2f} M and "
        f"{lora['full_optimizer_per_rank'] / GIB:.2f} GiB; {saved / GIB:.2f} GiB less static memory per rank "
        f"({share:.0%})"
    )


def _precision_line(row: dict[str, Any]) -> str:
    params, dtype = row["param_dtype"], row["dtype"]
    if row.get("lora"):
        return f"base frozen in {params} (no gradients, no optimizer state), adapter in float32"
    if row.get("fp32_master_weights"):
        return f"parameters kept in {params}, fp32 master weights in the optimizer"
    if params != dtype:
        return f"parameters kept in {params} (fp32 master weights), computed in {dtype}"
    return f"parameters kept in {params}"
