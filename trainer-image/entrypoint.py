#!/usr/bin/env python3
"""Entrypoint of the treetrain trainer image (trainer and rollout pods).

    IMAGE                                  same as `train`
    IMAGE train [CONFIG] [FLAG...]         treetrain train; under torchrun when the container has
                                           torchrun's rendezvous variables (PET_NNODES, ...). CONFIG
                                           defaults to $TREETRAIN_CONFIG, else the embedded default job.
    IMAGE rollout sglang ARG...            python3 -m sglang.launch_server ARG...
    IMAGE rollout vllm ARG...              vllm serve ARG...
    IMAGE rollout SPEC --model M [--port P] [-- ARG...]
                                           the server command line the operator plans for one pod
                                           of a single-pod instance of SPEC (e.g. sglang:d1t4)
    IMAGE COMMAND ARG...                   anything else runs unchanged (exec)

Pods made by the RLJob operator set the container's `command` (torchrun ..., python3 -m
sglang.launch_server ..., vllm serve ..., /bin/sh -c ...), which replaces this entrypoint, so the
image must have those on PATH by itself. Given the same words as arguments instead, this
entrypoint runs them unchanged, so both ways behave alike. The process is replaced (exec), so
signals reach the trainer or server directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

USAGE = __doc__ or ""
# torchrun reads PET_<FLAG> for each of its flags; the operator sets these on trainer pods.
TORCHRUN_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR")


class UsageError(ValueError):
    """Bad arguments: a message that says what is wrong and how to fix it (exit 2)."""


def resolve(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The command line to exec for the container arguments ``argv``."""
    if not argv:
        return resolve(["train"], env)
    head, rest = argv[0], list(argv[1:])
    if head in ("-h", "--help", "help"):
        raise SystemExit(_usage())
    if head == "train":
        return _train(rest, env)
    if head == "rollout":
        return _rollout(rest)
    return list(argv)


def _train(rest: list[str], env: Mapping[str, str]) -> list[str]:
    if not rest or rest[0].startswith("-"):
        config = env.get("TREETRAIN_CONFIG", "")
        rest = [config, *rest] if config else rest
    if any(env.get(name) for name in TORCHRUN_VARS):
        # The operator's trainer command, word for word.
        return ["torchrun", "-m", "treetrain.cli", "train", *rest]
    return ["treetrain", "train", *rest]


def _rollout(rest: list[str]) -> list[str]:
    if not rest:
        raise UsageError(
            "rollout: name the engine: `rollout sglang ARG...`, `rollout vllm ARG...` or `rollout SPEC --model M`"
        )
    engine, args = rest[0], rest[1:]
    if engine == "sglang":
        return ["python3", "-m", "sglang.launch_server", *args]
    if engine == "vllm":
        return ["vllm", "serve", *args]
    if ":" in engine:
        return _rollout_spec(engine, args)
    raise UsageError(f"rollout: unknown engine {engine!r}; use sglang, vllm or a backend string such as sglang:d1t4")


def _rollout_spec(spec: str, args: list[str]) -> list[str]:
    """``rollout sglang:d1t4 --model M [--port P] [-- extra...]``: the operator's own server argv."""
    from rljob_operator.servers import server_argv
    from treetrain.alloc import AllocationError, parse

    extra: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, extra = args[:cut], args[cut + 1 :]
    options = {"--model": "", "--port": "30000"}
    while args:
        flag = args.pop(0)
        if flag not in options or not args:
            raise UsageError(f"rollout {spec}: expected --model MODEL [--port PORT] [-- SERVER_ARG...], got {flag!r}")
        options[flag] = args.pop(0)
    if not options["--model"]:
        raise UsageError(f"rollout {spec}: --model MODEL is required (a path or a model name)")
    if not options["--port"].isdigit():
        raise UsageError(f"rollout {spec}: --port must be a number, got {options['--port']!r}")
    try:
        allocation = parse(spec)
    except AllocationError as err:
        raise UsageError(f"rollout: {err}") from None
    if allocation.kind != "inference":
        raise UsageError(f"rollout: {spec!r} is a training backend; give sglang:... or vllm:...")
    return server_argv(allocation, model=options["--model"], port=int(options["--port"]), extra_args=extra)


def _usage() -> str:
    return USAGE.strip() + "\n"


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        command = resolve(args, os.environ if env is None else env)
    except UsageError as err:
        print(f"trainer image: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(
            f"trainer image: error: command not found: {command[0]!r} (PATH={os.environ.get('PATH', '')})",
            file=sys.stderr,
        )
        return 127
    except PermissionError:
        print(f"trainer image: error: {command[0]!r} is not executable", file=sys.stderr)
        return 126
    raise AssertionError("unreachable: exec returned")


if __name__ == "__main__":
    sys.exit(main())
