"""Where the Arrow copy of a large dataset file lives: ``datasets`` converts the file once into
Arrow files there and memory-maps them, so the rows cost page cache rather than the trainer's
memory, and a later run on the unchanged file maps the same copy.

An entry is keyed by the file's resolved path, size and modification time:
``ROOT/<name>-<hash of the path>/<size>-<mtime ns>``. A new version of a file replaces the
entries of its older ones (a process that still maps one keeps reading it: unlinked files
stay readable while mapped).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from treetrain.rl.dataset_check import DatasetError

CACHE_FROM_BYTES = 64 << 20  # files this large or larger are read through the cache; smaller ones in memory


def default_root() -> Path:
    """``$TREETRAIN_CACHE/datasets`` (default ``~/.cache/treetrain/datasets``), beside the
    built-in models' conversions."""
    from treetrain.engines.builtin import cache_root

    return cache_root() / "datasets"


def entry_for(path: Path, root: Path) -> Path:
    """The cache entry of ``path`` as it is now (not created)."""
    stat = path.stat()
    ident = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return root / f"{path.name[:60]}-{ident}" / f"{stat.st_size}-{stat.st_mtime_ns}"


def prepare(path: Path, root: Path, key: str) -> Path:
    """The entry of ``path``, created, the entries of its older versions removed; one line if
    ``root`` cannot be written."""
    entry = entry_for(path, root)
    try:
        entry.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DatasetError(
            f"{key}.path {path}: cannot write its Arrow cache in {root} ({err.strerror or err}); fix: set "
            f"TREETRAIN_CACHE to a writable directory with room for about {_mib(path)} MiB"
        ) from None
    for older in entry.parent.iterdir():
        if older != entry and older.is_dir():
            shutil.rmtree(older, ignore_errors=True)
    return entry


def no_space(err: BaseException, path: Path, place: Path, key: str) -> DatasetError | None:
    """The one line for a full disk under the cache (``datasets`` wraps the OSError), else None."""
    seen: BaseException | None = err
    while seen is not None:
        # ENOSPC, or datasets' own check of the room before it writes
        if isinstance(seen, OSError) and (seen.errno == 28 or str(seen).startswith("Not enough disk space")):
            return DatasetError(
                f"{key}.path {path}: no space left for its Arrow copy in {place}; fix: free space there, or set "
                f"TREETRAIN_CACHE to a directory with room for about {_mib(path)} MiB"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def _mib(path: Path) -> int:
    """The room a copy takes, about: Arrow holds text rows in about the file's size, plus offsets."""
    return max(1, 2 * path.stat().st_size >> 20)
