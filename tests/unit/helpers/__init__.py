"""What the unit tests share: config merging, Hugging Face model directories, agent-shaped
batches, and the two ways a test runs code on several CPU ranks (spawned processes in the test,
or ``treetrain train`` under torchrun). Test modules import these from here (and what every
test directory shares from tests/suite_helpers.py), never from each other."""

from __future__ import annotations

import faulthandler
import os
import random
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from suite_helpers import free_port, subprocess_env

from treetrain import config as C

ROOT = Path(__file__).resolve().parents[3]

# The variables the CLI reads: a test of the trainer must see none of the caller's.
TRAINER_ENV = ("WORLD_SIZE", "TREETRAIN_RESTART", "TREETRAIN_ROLE", "TREETRAIN_CONFIG", *C.ENV_OVERRIDES)

# The tiny builtin model the engine tests build, with a fixed seed.
TINY_LLAMA: dict[str, Any] = {"path": "builtin:tiny-llama", "seed": 3}


# -- trainer configs ---------------------------------------------------------------------


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged in, nested mappings key by key (neither is changed)."""
    out = dict(base)
    for k, v in patch.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def save_hf_model(path: Path, model_type: str, *, seed: int | None = None, **fields: Any) -> Path:
    """A randomly initialised Hugging Face model of ``model_type`` with config ``fields``,
    saved to the directory ``path`` (weights drawn after ``torch.manual_seed(seed)`` when
    given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).save_pretrained(path)
    return path


# -- batches -----------------------------------------------------------------------------


def make_batch(seed: int = 0, vocab: int = 500) -> Any:
    """Agent-shaped sequences: a shared system prompt, branching turns, uneven lengths."""
    from treetrain.engines.batch import TokenFields, TrainBatch

    rng = random.Random(seed)
    system = [rng.randrange(8, vocab) for _ in range(20)]
    seqs = []
    for _ in range(3):
        history = system + [rng.randrange(8, vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(3):
            history = history + [rng.randrange(8, vocab) for _ in range(rng.randint(2, 7))]
            seqs.append(list(history))
    seqs.append([rng.randrange(8, vocab) for _ in range(11)])  # shares nothing
    g = torch.Generator().manual_seed(seed)
    masks, adv, old, rets = [], [], [], []
    for s in seqs:
        n = len(s) - 1
        m = torch.zeros(n)
        m[rng.randint(0, n - 1) :] = 1.0
        masks.append(m)
        adv.append(torch.full((n,), float(torch.randn((), generator=g))))
        old.append(-6.2 + 0.1 * torch.randn(n, generator=g))
        rets.append(torch.rand(n, generator=g))
    fields = TokenFields(advantages=adv, old_logprobs=old, returns=rets)
    return TrainBatch(sequences=seqs, loss_mask=masks, fields=fields)


def backward_alone(batch: Any, loss: Any, output: Callable[[list[int]], Any]) -> float:
    """Each sequence of ``batch`` alone: ``output(seq)`` (a ``MicroBatchOutput``), its loss, and
    the backward of that loss over all of the batch's loss tokens (one global mean, as the
    engines divide). Returns the mean loss."""
    total = batch.num_loss_tokens()
    value = 0.0
    for i, seq in enumerate(batch.sequences):
        out = output(seq)
        inputs = batch.fields.map(lambda v, i=i: v[i])
        mb_loss, _ = loss(out, batch.loss_mask[i], inputs)
        (mb_loss / total).backward()
        value += float(mb_loss.detach()) / total
    return value


def losses_after_resume(engine: Any, batch: Any, loss: Any, ckpt: Path) -> list[float]:
    """Save ``engine`` to ``ckpt``, then twice: one step, the loss after it, load ``ckpt``
    again. An exact resume gives the same loss both times."""
    engine.save(ckpt, {"step": 1})
    after = []
    for _ in range(2):
        engine.forward_backward(batch, loss)
        engine.step()
        after.append(engine.forward_backward(batch, loss).loss)
        engine.zero_grad()
        assert engine.load(ckpt) == {"step": 1}
    return after


# -- several ranks -----------------------------------------------------------------------


def _rank_main(
    rank: int, world: int, port: int, check: Callable[..., None], args: tuple[Any, ...], errors: Any
) -> None:
    faulthandler.enable()  # a rank that aborts in C++ (gloo) still shows where it was
    os.environ.update(
        WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    ok = False
    try:
        check(*args)
        ok = True
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if ok:
            os._exit(0)  # torch 2.15's gloo sometimes aborts in teardown after a clean run


def spawn_ranks(check: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``check(*args)`` on every rank of ``world`` spawned processes (as torchrun would:
    ``RANK``, ``WORLD_SIZE`` and a loopback rendezvous in the environment, one torch thread);
    ``check`` is a module-level function. A failed rank fails the test with every rank's
    traceback."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(
            _rank_main, args=(world, free_port(), check, args, errors), nprocs=world, start_method="spawn"
        )
    except Exception:
        found = []
        while not errors.empty():
            found.append(errors.get())
        pytest.fail("\n".join(found) or "a rank failed")


def torchrun(
    config: dict[str, Any], path: Path, *extra: str, restart: int = 0, monitor_s: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``treetrain train`` under torchrun with 2 CPU ranks (what a trainer pod runs), ``config``
    written to ``path``; rendezvous on a free loopback port. ``monitor_s``: torchrun's polling
    interval (it stops the other ranks on the first poll that finds one rank exited)."""
    path.write_text(yaml.safe_dump(config))
    env = subprocess_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port())] + (["--monitor-interval", str(monitor_s)] if monitor_s else [])
    cmd += ["-m", "treetrain.cli", "train", str(path), *extra]
    env["TREETRAIN_RESTART"] = str(restart)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, check=False)


def step_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The ``step i/n`` heads of the trainer's step lines in ``done``'s stdout."""
    return [line.split("|")[0].strip() for line in done.stdout.splitlines() if line.startswith("step ")]
