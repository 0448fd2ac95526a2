"""bench/rollout.py must not rot: a small run, and its check that both modes sample alike."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_bench_small_run() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "rollout.py"), "--groups", "2", "--group-size", "2", "--turns", "2"]
    run = subprocess.run([*cmd, "--repeat", "1"], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "same samples: yes" in run.stdout
    read = re.search(r"prompt tokens read: reread ([\d,]+), kept ([\d,]+)", run.stdout)
    assert read, run.stdout
    reread, kept = (int(n.replace(",", "")) for n in read.groups())
    assert kept < reread / 2  # the second turn reads only its new tokens
