"""The checkpoint directory: ``step-NNNNNNNN/`` per saved step, a ``latest`` pointer written
atomically, the newest few kept; and ``weights/vNNNNNNNN/`` for the rollout servers."""

from __future__ import annotations

import shutil
from pathlib import Path

LATEST = "latest"


class Checkpoints:
    def __init__(self, root: str | None, *, keep: int) -> None:
        self.root = Path(root) if root else None
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        assert self.root is not None
        return self.root / f"step-{step:08d}"

    def weights_dir(self, version: int) -> Path:
        assert self.root is not None
        return self.root / "weights" / f"v{version:08d}"

    def latest(self) -> Path | None:
        if self.root is None or not (self.root / LATEST).is_file():
            return None
        path = self.root / (self.root / LATEST).read_text().strip()
        return path if path.is_dir() else None

    def commit(self, path: Path) -> None:
        """Point ``latest`` at a complete checkpoint (rank 0, after every rank wrote its part)."""
        assert self.root is not None
        tmp = self.root / (LATEST + ".tmp")
        tmp.write_text(path.name + "\n")
        tmp.replace(self.root / LATEST)  # atomic: a crash never leaves a half-written pointer
        _prune(self.root, "step-", keep=self.keep)

    def prune_weights(self) -> None:
        """Every server loaded the newest weights: older versions go."""
        assert self.root is not None
        _prune(self.root / "weights", "v", keep=1)


def _prune(root: Path, prefix: str, *, keep: int) -> None:
    """Delete all but the newest ``keep`` directories ``root/<prefix><zero-padded number>``."""
    found = sorted(p for p in root.glob(prefix + "*") if p.is_dir() and p.name[len(prefix) :].isdigit())
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
