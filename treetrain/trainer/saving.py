"""A run's checkpoints as the gang writes and reads them: every rank's engine parts, rank 0's
rollout state and data position, published whole or not at all, and the newest readable one
resumed from.

A disk that fills on any rank stops every rank with one line (exit 2); the partial directory is
removed and ``latest`` still names the last good checkpoint. An unreadable checkpoint (torn by a
crash or a full disk) is reported and the next older one tried; every rank resumes from the same
step, or stops with the same line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from treetrain.engines.base import Engine
from treetrain.engines.errors import CheckpointUnreadableError, EngineConfigError
from treetrain.engines.layout import Layout
from treetrain.trainer.checkpoints import Checkpoints, no_space, space_message, tree_bytes
from treetrain.trainer.data import RunData
from treetrain.trainer.rollout import Rollout


class RunCheckpoints:
    """See the module docstring. ``engines``: what trains (the actor, a critic), saved in order."""

    def __init__(
        self,
        checkpoints: Checkpoints,
        engines: list[Engine],
        layout: Layout,
        *,
        rollout: Rollout,
        data: RunData,
        log: Callable[[str], None],
    ) -> None:
        self.checkpoints, self.engines, self.layout = checkpoints, engines, layout
        self.rollout, self.data, self.log = rollout, data, log

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Every rank writes its part into a partial directory; rank 0 publishes it whole."""
        began = time.perf_counter()
        main, root = self.layout.is_main, self.checkpoints.root
        assert root is not None
        if main:
            self.checkpoints.clear_partial(step)
        self._barrier()
        path = self.checkpoints.partial_dir(step)
        failed = ""
        try:
            self._write(path, step)
        except Exception as err:
            if not no_space(err, root):
                raise
            failed = "no space"
        if self.layout.world_size > 1:  # every rank commits, or every rank stops: no one waits in a barrier
            seen: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(seen, failed)
            failed = next((f for f in seen if f), "")
        if failed:
            self._give_up(path, step)
        self._barrier()
        if main:
            try:
                final = self.checkpoints.commit(step)
            except OSError as err:  # the rename or ``latest`` (rank 0 alone: torchrun stops the others)
                if not no_space(err, root):
                    raise
                written = tree_bytes(path)
                self.checkpoints.clear_partial(step)
                raise EngineConfigError(space_message(root, step, written, self.checkpoints.latest())) from None
            self.log(f"checkpoint: step {step} saved to {final} in {time.perf_counter() - began:.1f}s")
        self._barrier()

    def _write(self, path: Path, step: int) -> None:
        """This rank's part of checkpoint ``step``."""
        for engine in self.engines:
            engine.save(path, {"step": step})
        if self.layout.is_main:
            self.rollout.save(path)
            self.data.save(path, step)

    def _give_up(self, path: Path, step: int) -> None:
        """A save that ran out of space: its partial directory goes (it holds the space), and the
        run stops with one line saying how much a checkpoint needs."""
        root = self.checkpoints.root
        assert root is not None
        written = tree_bytes(path)
        self._barrier()
        if self.layout.is_main:
            self.checkpoints.clear_partial(step)
        self._barrier()
        raise EngineConfigError(space_message(root, step, written, self.checkpoints.latest()))

    def kept(self) -> str:
        """What a stopped run leaves to resume from, for its last line."""
        if self.checkpoints.root is None:
            return "no checkpoint.dir set, so nothing is kept"
        latest = self.checkpoints.latest()
        return f"checkpoint: {latest} (resume with --resume)" if latest else "no step finished yet: nothing to keep"

    # -- resuming --------------------------------------------------------------------------
    def restore(self, *, required: bool, restart: int) -> int:
        """The step resumed from (0: none): the newest checkpoint every rank can read.
        ``required``: --resume (no checkpoint is an error); ``restart``: the gang's restart count."""
        if self.checkpoints.pointer_is_stale():
            self.log(
                f"checkpoint: {self.checkpoints.root}/latest names a missing directory; using the newest complete one"
            )
        candidates = self.checkpoints.candidates()
        for path in candidates:
            problem = self._load(path)
            if problem is None:
                step = int(path.name.removeprefix("step-"))
                self.log(f"resumed from {path} (step {step})")
                self.checkpoints.resumed_from = path  # kept by every prune of this run
                if self.layout.is_main:
                    self.rollout.load(path)
                self.data.load(path)
                return step
            self.checkpoints.unreadable.add(path)  # the next save prunes it first
            self.log(f"checkpoint: {problem}; trying an older one")
        where = self.checkpoints.root or "(no checkpoint.dir set)"
        if candidates:
            raise EngineConfigError(
                f"no readable checkpoint in {where} ({len(candidates)} tried); fix: move them away to start over "
                "from step 0, or give this run a new checkpoint.dir"
            )
        if required:
            raise FileNotFoundError(f"--resume: no checkpoint in {where}")
        if restart > 0:
            self.log(f"restart {restart}: no checkpoint in {where} yet; starting from step 0")
        return 0

    def _load(self, path: Path) -> str | None:
        """Load ``path`` into every engine; the reason it could not be read (on any rank), or None."""
        problem = fatal = ""  # fatal: a checkpoint no older one makes right (another model, a foreign file)
        try:
            for engine in self.engines:
                engine.load(path)
        except CheckpointUnreadableError as err:
            problem = str(err)
        except (EngineConfigError, FileNotFoundError) as err:
            if self.layout.world_size == 1:
                raise
            fatal = str(err)
        if self.layout.world_size > 1:  # every rank must resume from the same step, or stop with the same line
            found: list[Any] = [None] * self.layout.world_size
            dist.all_gather_object(found, (problem, fatal))
            fatal = next((f for _, f in found if f), "")
            if fatal:
                raise EngineConfigError(fatal)
            problem = next((p for p, _ in found if p), "")
        return problem or None

    def _barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier()
