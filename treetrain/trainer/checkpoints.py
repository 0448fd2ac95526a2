"""The checkpoint directory: ``step-NNNNNNNN/`` per saved step, the newest few kept, a
``latest`` pointer; and ``weights/vNNNNNNNN/`` for the rollout servers.

A checkpoint is written into ``step-NNNNNNNN.partial/`` and renamed to its final name only
once every rank has written its part, then ``latest`` is replaced atomically: a crash or a
full disk mid-save leaves a ``.partial`` directory that is never read (and is removed by the
next save), never a torn ``step-N/``. Reading goes newest first and falls back to an older
checkpoint when one cannot be read.

Pruning (``keepCheckpoints``) never deletes the checkpoint just committed nor the one this run
resumed from, and deletes the ones found unreadable first: after a fallback past a torn
``step-4`` to ``step-2``, committing ``step-3`` with ``keepCheckpoints: 1`` keeps ``step-3`` and
``step-2`` and drops the torn ``step-4`` (pruning by step number alone kept the torn one and
deleted both good ones). The directory is checked when the trainer starts, before any model
loads or step trains.
"""

from __future__ import annotations

import errno
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
        self.resumed_from: Path | None = None  # never pruned while this run goes on
        self.unreadable: set[Path] = set()  # found torn by this run's restore: pruned first
        if self.root is not None:
            problem = dir_problem(self.root)
            if problem is not None:
                raise EngineConfigError(problem)

    def prepare(self) -> None:
        """Create the directory and read ``latest`` now, so that a directory that cannot be
        written, or a damaged pointer, stops the run before any model loads or step trains."""
        if self.root is None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise EngineConfigError(
                f"checkpoint.dir {self.root} cannot be created ({err.strerror or err}); fix: give a writable directory"
            ) from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise EngineConfigError(f"checkpoint.dir {self.root} is not writable; fix: give a writable directory")
        self.latest()

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
        self.unreadable.discard(final)  # written again, whole
        steps = {int(p.name[len(PREFIX) :]): p for p in _steps(self.root)}
        unreadable = {n for n, p in steps.items() if p in self.unreadable or not any(p.iterdir())}
        protected = {step} | ({_step_of(self.resumed_from)} if self.resumed_from is not None else set())
        for n in prune_plan(sorted(steps), keep=self.keep, committed=step, protected=protected, unreadable=unreadable):
            shutil.rmtree(steps[n], ignore_errors=True)
        for partial in self.root.glob(f"{PREFIX}*{PARTIAL}"):
            shutil.rmtree(partial, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, if it exists; a ``latest`` that is not text (a
        damaged file) is an error naming it."""
        if self.root is None or not (self.root / LATEST).is_file():
            return None
        pointer = self.root / LATEST
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise EngineConfigError(
                f"{pointer} is not a checkpoint name ({_reason(err)}); fix: delete it (the newest complete "
                f"checkpoint is then used) or write the name of a step directory into it, e.g. {PREFIX}00000002"
            ) from None
        if not name or "\x00" in name:
            return None
        path = self.root / name
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


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def prune_plan(steps: list[int], *, keep: int, committed: int, protected: set[int], unreadable: set[int]) -> list[int]:
    """The steps to delete after committing ``committed``: every unreadable one first, then the
    oldest readable ones beyond ``keep``. ``protected`` steps (the one just committed, the one
    this run resumed from) are never deleted and count towards ``keep``. Steps above the one
    just committed were abandoned by a run that resumed from an older one (it will write those
    steps again): they go before older ones."""
    doomed = [n for n in steps if n in unreadable and n not in protected]
    readable = [n for n in steps if n not in unreadable or n in protected]
    # Most wanted first: the protected ones, then older steps newest first, then abandoned ones.
    order = sorted(readable, key=lambda n: (n not in protected, n > committed, -n))
    return sorted(doomed + order[max(keep, len(protected & set(readable))) :])


def dir_problem(root: Path) -> str | None:
    """Why ``checkpoint.dir`` cannot hold checkpoints (it or a directory above it is a file),
    or None; nothing is created."""
    for where in (root, *root.parents):
        if where.exists() or where.is_symlink():
            if where.is_dir():
                return None
            what = "is a file" if where == root else f"is below {where}, which is a file"
            return f"checkpoint.dir {root} {what}; fix: give a directory (it is created)"
    return None


def _reason(err: BaseException) -> str:
    if isinstance(err, UnicodeDecodeError):
        return f"binary data at byte {err.start}"
    return getattr(err, "strerror", None) or str(err)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash right after cannot undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Free bytes below which a failed write is taken for a full disk: torch's writer reports ENOSPC as
# "unexpected pos ..." and safetensors as its own error type, so the errno alone does not tell.
FULL_BELOW_BYTES = 16 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(err: BaseException, where: Path) -> bool:
    """Whether a failed write under ``where`` failed for lack of space: ENOSPC or EDQUOT anywhere
    in the exception's chain, or a file system that is (nearly) full now."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        if "No space left" in str(seen) or "os error 28" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(where).free < FULL_BELOW_BYTES
    except OSError:
        return False


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is gone)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def space_message(root: Path, step: int, written: int, previous: Path | None) -> str:
    """The one line for a save that ran out of space (after its partial directory is removed)."""
    free = shutil.disk_usage(root).free
    need = max(tree_bytes(previous), written) if previous is not None else written
    size = f"about {_gib(need)} (the size of {previous.name})" if previous is not None else f"more than {_gib(need)}"
    return (
        f"checkpoint: no space left on the device of {root} while saving step {step} ({_gib(written)} written "
        f"before it filled, removed; {_gib(free)} free now); a checkpoint needs {size}; fix: free that much in "
        "checkpoint.dir (or point it at a larger volume), then resume with --resume"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
