"""A disk that fills during a checkpoint save: one line naming the directory and the space a
checkpoint needs, exit 2, the partial directory removed (it held the space), ``latest`` still on
the last good step. (It used to be two torch tracebacks, `unexpected pos ...`, exit 1, never
saying "no space", and a `step-N.partial` left behind.)

The full disk is a real one: a 3 MiB tmpfs mounted as checkpoint.dir inside a private mount
namespace (``unshare``), so nothing outside the test sees it and it goes when the process ends.
A tiny-llama checkpoint is about 2 MiB: step 1's fits, step 2's cannot fit beside it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import ROOT
from suite_helpers import small, subprocess_env


def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_last_good_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    raw = small(ckpt, steps=3)
    raw["checkpoint"]["intervalSteps"] = 1
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    train = shlex.join([sys.executable, "-m", "treetrain.cli", "train", str(config)])
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {shlex.quote(str(ckpt))} || exit 99\n"
        f"{train}; rc=$?\n"
        f"echo '--- listing'; ls -a {shlex.quote(str(ckpt))}; echo '--- latest'; cat {shlex.quote(str(ckpt))}/latest\n"
        "exit $rc\n"
    )
    # A private mount namespace (root here; --map-root-user gives one to any other user).
    unshare = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare.append("--map-root-user")
    done = subprocess.run(
        [*unshare, "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=subprocess_env(outside_a_pod=True),
        check=False,
    )
    assert done.returncode != 99, f"could not mount the small file system: {done.stderr[-2000:]}"
    out, listing = done.stdout.split("--- listing", 1)
    assert done.returncode == 2, (out[-2000:], done.stderr[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert line.startswith(f"treetrain train: error: checkpoint: no space left on the device of {ckpt}"), line
    assert "while saving step 2" in line and "a checkpoint needs about" in line and "--resume" in line, line
    names, latest = listing.split("--- latest")
    assert "step-00000002.partial" not in names and "step-00000001" in names, names
    assert latest.strip() == "step-00000001"
    assert "step 2/3 | reward" in out  # step 2 trained; its save is what failed
