"""Checkpoints that survive crashes: written whole or not at all, read newest first with a
fallback past unreadable ones, and every failure one line (tiny model, one process)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import merge
from suite_helpers import small

from treetrain import config as C
from treetrain.cli import main
from treetrain.trainer.loop import Trainer

pytestmark = pytest.mark.usefixtures("trainer_env")


def _train(ckpt: Path, steps: int, lines: list[str] | None = None, **sections: Any) -> Any:
    """Train ``steps`` steps of the small config (``sections`` merged in), checkpointing every step."""
    raw = merge(small(ckpt), sections)
    raw["checkpoint"]["intervalSteps"] = 1
    log = lines.append if lines is not None else (lambda _: None)
    trainer = Trainer(C.validate(raw, overrides={"trainer.steps": steps}), log=log)
    try:
        return trainer.run()
    finally:
        trainer.close()


def test_a_torn_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    for torn in ("actor.pt", "actor-rank0.pt"):  # the model state, then this rank's metadata
        ckpt = tmp_path / torn
        _train(ckpt, steps=2)
        assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000001", "step-00000002"]
        newest = ckpt / "step-00000002" / torn
        newest.write_bytes(newest.read_bytes()[:100])  # a crash or a full disk mid-write
        lines: list[str] = []
        summary = _train(ckpt, steps=3, lines=lines)
        assert summary.start_step == 1, lines
        assert any("step-00000002" in line and "cannot be read" in line and "older" in line for line in lines), lines
        assert any(line.startswith(f"resumed from {ckpt / 'step-00000001'}") for line in lines)


def test_latest_naming_a_missing_directory_uses_the_newest_complete_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=2)
    (ckpt / "latest").write_text("step-00000009\n")
    lines: list[str] = []
    summary = _train(ckpt, steps=3, lines=lines)
    assert summary.start_step == 2  # not a silent restart from step 0
    assert any("latest names a missing directory" in line for line in lines)
    assert (ckpt / "latest").read_text().strip() == "step-00000003"


def test_an_interrupted_save_leaves_nothing_that_is_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=1)
    # What a crash or a full disk in the middle of saving step 2 leaves behind.
    partial = ckpt / "step-00000002.partial"
    partial.mkdir()
    (partial / "actor.pt").write_bytes(b"torn")
    lines: list[str] = []
    summary = _train(ckpt, steps=2, lines=lines)
    assert summary.start_step == 1 and not partial.exists()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-00000001", "step-00000002"]


def test_no_readable_checkpoint_is_one_line_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    _train(ckpt, steps=1)
    (ckpt / "step-00000001" / "actor.pt").write_bytes(b"")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(merge(small(ckpt), {"trainer": {"steps": 2}})))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no readable checkpoint in" in err and "Traceback" not in err
    assert (ckpt / "latest").read_text().strip() == "step-00000001"  # nothing overwritten


def test_a_checkpoint_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(small(not_a_dir)))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.dir {not_a_dir} is a file" in err and "Traceback" not in err


def test_a_binary_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(bytes(range(256)))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot read the config" in err and "Traceback" not in err


# -- no checkpoint lost (issue 21, item 9), on every engine -----------------------------------

ENGINES = ["fsdp:d1", "archon:d1", "megatron:d1"]


def _run(ckpt: Path, backend: str, steps: int, *, keep: int = 5, lines: list[str] | None = None) -> Any:
    return _train(ckpt, steps, lines, actor={"backend": backend}, trainer={"keepCheckpoints": keep})


def _step_dirs(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob("step-*"))


def _tear(step_dir: Path) -> None:
    """What a crash or a full disk leaves: every file of the checkpoint cut short."""
    for f in step_dir.iterdir():
        f.write_bytes(f.read_bytes()[:100])


@pytest.mark.parametrize("backend", ENGINES)
def test_keep_one_after_a_fallback_loses_no_checkpoint(tmp_path: Path, backend: str) -> None:
    """Good step-2, torn step-4, keepCheckpoints 1: the run falls back to step-2, trains and
    saves step-3; pruning by step number alone kept the torn step-4 and deleted both good ones."""
    ckpt = tmp_path / "ckpt"
    _run(ckpt, backend, steps=4)
    for gone in ("step-00000001", "step-00000003"):
        shutil.rmtree(ckpt / gone)
    _tear(ckpt / "step-00000004")
    assert (ckpt / "latest").read_text().strip() == "step-00000004"

    lines: list[str] = []
    summary = _run(ckpt, backend, steps=3, keep=1, lines=lines)
    assert summary.start_step == 2 and [r.step for r in summary.records] == [3], lines
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert latest.name == "step-00000003" and latest.is_dir()
    # The torn one is gone; the one just committed and the one resumed from are kept.
    assert _step_dirs(ckpt) == ["step-00000002", "step-00000003"]

    lines = []
    again = _run(ckpt, backend, steps=4, keep=1, lines=lines)  # a second resume works
    assert again.start_step == 3, lines
    assert any(line.startswith(f"resumed from {latest}") for line in lines), lines
    assert _step_dirs(ckpt) == ["step-00000003", "step-00000004"]


@pytest.mark.parametrize("backend", ENGINES)
@pytest.mark.parametrize("damage", ["empty-step-directory", "state-of-empty-dicts"])
def test_an_empty_newest_checkpoint_falls_back_like_a_torn_one(tmp_path: Path, backend: str, damage: str) -> None:
    ckpt = tmp_path / "ckpt"
    _run(ckpt, backend, steps=2)
    newest = ckpt / "step-00000002"
    if damage == "empty-step-directory":
        shutil.rmtree(newest)
        newest.mkdir()
    else:
        # The file holding the model state: one per process (megatron) or one for all (fsdp, archon).
        (state,) = [f for f in newest.iterdir() if "-rank" not in f.name or "megatron" in f.name]
        torch.save({"model": {}, "optim": {}} if "megatron" not in state.name else {}, state)
    lines: list[str] = []
    summary = _run(ckpt, backend, steps=3, lines=lines)
    assert summary.start_step == 1, lines
    assert any(str(newest) in line and "trying an older one" in line for line in lines), lines
    assert (ckpt / "latest").read_text().strip() == "step-00000003"


PRUNE = [
    # steps, keep, committed, protected, unreadable -> deleted
    ([1, 2, 3], 1, 3, {3}, set(), [1, 2]),  # the plain case: newest kept
    ([2, 3, 4], 1, 3, {3, 2}, {4}, [4]),  # after a fallback: the torn one goes, both good ones stay
    ([2, 3, 4], 1, 3, {3}, set(), [2, 4]),  # an abandoned step-4 (readable, not resumed) goes first
    ([1, 2, 3, 4, 5], 2, 5, {5, 3}, {1}, [1, 2, 4]),
    ([5], 3, 5, {5}, set(), []),
]


@pytest.mark.parametrize(("steps", "keep", "committed", "protected", "unreadable", "deleted"), PRUNE)
def test_prune_plan(
    steps: list[int], keep: int, committed: int, protected: set[int], unreadable: set[int], deleted: list[int]
) -> None:
    from treetrain.trainer.checkpoints import prune_plan  # here: the module imports without it

    plan = prune_plan(steps, keep=keep, committed=committed, protected=protected, unreadable=unreadable)
    assert plan == deleted
