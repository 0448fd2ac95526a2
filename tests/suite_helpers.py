"""What every test directory shares (unit, cluster, vllm, images): a free loopback port, a
child's environment without the trainer's variables, and the seconds-long trainer config.

pytest puts tests/ on ``sys.path`` (tests/conftest.py lives here), so any test module imports
these as ``from suite_helpers import ...``; test modules never import each other."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What makes a process look like a trainer's run or a torchrun rank.
_RUN_VARIABLES = ("TREETRAIN_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def subprocess_env(environ: Mapping[str, str] | None = None, *, outside_a_pod: bool = False) -> dict[str, str]:
    """``environ`` (default: this process's) without the trainer's ``TREETRAIN_*`` variables and
    torchrun's ``WORLD_SIZE``/``RANK``/``LOCAL_*``, for a child that must not inherit a caller's
    run; ``outside_a_pod``: without ``KUBERNETES_*`` too (the trainer binds its metrics server to
    loopback when it is not in a pod)."""
    source = os.environ if environ is None else environ
    dropped = (*_RUN_VARIABLES, "KUBERNETES_") if outside_a_pod else _RUN_VARIABLES
    return {k: v for k, v in source.items() if not k.startswith(dropped)}


def small(tmp: Path | None = None, **trainer: Any) -> dict[str, Any]:
    """A seconds-long config: tiny model, 2 groups x 2 samples, 2 turns of 4 tokens."""
    cfg: dict[str, Any] = {
        "model": {"path": "builtin:tiny-llama", "seed": 1},
        "actor": {
            "backend": "fsdp:d1",
            "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 256, "blockSize": 16},
        },
        "trainer": {
            "steps": 3,
            "task": "builtin:parity",
            "taskArgs": {"turns": 2, "userTokens": 4, "systemTokens": 16, "maxNewTokens": 4},
            "groupsPerStep": 2,
            "groupSize": 2,
            "optimizer": {"lr": 1e-2},
            "metrics": {"enabled": False},
            "threads": 1,
            **trainer,
        },
    }
    if tmp is not None:
        cfg["checkpoint"] = {"dir": str(tmp), "intervalSteps": 2}
    return cfg


def sigterm_after_each_step(trainer: Any) -> None:
    """Make ``trainer`` receive SIGTERM right after each training step, as Kubernetes sends it
    before it kills a pod (the trainer then stops after that step, with a checkpoint)."""
    import signal

    step = trainer.train_step

    def step_then_sigterm(n: int) -> Any:
        rec = step(n)
        signal.raise_signal(signal.SIGTERM)
        return rec

    trainer.train_step = step_then_sigterm
