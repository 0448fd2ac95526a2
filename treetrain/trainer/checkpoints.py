"""The checkpoint directory: ``step-NNNNNNNN/`` per saved step, the newest few kept, a
``latest`` pointer; and ``weights/vNNNNNNNN/`` for the rollout servers.

A checkpoint is written into ``step-NNNNNNNN.partial/`` and renamed to its final name only
once every rank has written its part, then ``latest`` is replaced atomically: a crash or a
full disk mid-save leaves a ``.partial`` directory that is never read (and is removed by the
next save), never a torn ``step-N/``. Reading goes newest first and falls back to an older
checkpoint when one cannot be read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from treetrain.engines.errors import EngineConfigError

LATEST = "latest"
PREFIX = "step-"
PARTIAL = ".partial"


class Checkpoints:
    def __init__(self, root: str | None, *, keep: int) -> None:
        self.root = Path(root) if root else None
        self.keep = keep
        if self.root is not None and self.root.exists() and not self.root.is_dir():
            raise EngineConfigError(f"checkpoint.dir {self.root} is a file; fix: give a directory (it is created)")

    def partial_dir(self, step: int) -> Path:
        """Where every rank writes the checkpoint of ``step`` (a fresh directory)."""
        assert self.root is not None
        return self.root / f"{PREFIX}{step:08d}{PARTIAL}"

    def weights_dir(self, version: int) -> Path:
        assert self.root is not None
        return self.root / "weights" / f"v{version:08d}"

    def clear_partial(self, step: int) -> None:
        """Remove what an interrupted save of ``step`` left (rank 0, before anyone writes)."""
        shutil.rmtree(self.partial_dir(step), ignore_errors=True)

    def commit(self, step: int) -> Path:
        """Publish a complete checkpoint (rank 0, after every rank wrote its part): rename the
        partial directory to its final name, then point ``latest`` at it, each step atomic."""
        assert self.root is not None
        final = self.root / f"{PREFIX}{step:08d}"
        shutil.rmtree(final, ignore_errors=True)  # a step saved again (SIGTERM after an interval save)
        self.partial_dir(step).rename(final)
        _fsync_dir(self.root)
        tmp = self.root / (LATEST + ".tmp")
        with open(tmp, "w") as handle:
            handle.write(final.name + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(self.root / LATEST)
        _fsync_dir(self.root)
        _prune(self.root, keep=self.keep)
        return final

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, if it exists."""
        if self.root is None or not (self.root / LATEST).is_file():
            return None
        path = self.root / (self.root / LATEST).read_text().strip()
        return path if path.is_dir() else None

    def candidates(self) -> list[Path]:
        """Complete checkpoints to resume from, best first: the one ``latest`` names, then the
        others newest first (a ``latest`` that names a missing directory is skipped)."""
        if self.root is None:
            return []
        found = _steps(self.root)[::-1]
        latest = self.latest()
        if latest is not None and latest in found:
            found.remove(latest)
            found.insert(0, latest)
        return found

    def pointer_is_stale(self) -> bool:
        """``latest`` exists but names no checkpoint (deleted by hand, or a torn copy)."""
        return self.root is not None and (self.root / LATEST).is_file() and self.latest() is None

    def prune_weights(self) -> None:
        """Every server loaded the newest weights: older versions go."""
        assert self.root is not None
        weights = self.root / "weights"
        found = sorted(p for p in weights.glob("v*") if p.is_dir() and p.name[1:].isdigit())
        for old in found[:-1]:
            shutil.rmtree(old, ignore_errors=True)


def _steps(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    return sorted(p for p in root.glob(PREFIX + "*") if p.is_dir() and p.name[len(PREFIX) :].isdigit())


def _prune(root: Path, *, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop leftovers of interrupted saves."""
    found = _steps(root)
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob(f"{PREFIX}*{PARTIAL}"):
        shutil.rmtree(partial, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash right after cannot undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
