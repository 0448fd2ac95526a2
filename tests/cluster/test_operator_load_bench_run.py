"""bench/operator_load.py must not rot: a small run through every stage (its own control plane,
the operator as a process, the idle count, the API server restart), checking only that it ends
cleanly and reports every figure. No speed is asserted: the figures belong in docs/cluster.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_operator_load_bench_small_run(tmp_path: Path) -> None:
    built = subprocess.run([str(ROOT / "tests" / "cluster" / "build"), "--print"], capture_output=True, text=True)
    assert built.returncode == 0, "the test control plane is not built: run `make cluster-bin`"
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "bench" / "operator_load.py"), "--rljobs", "3", "--idle-seconds", "5",
           "--settle-seconds", "1", "--json", str(out)]  # fmt: skip
    env = dict(os.environ, TMPDIR=str(tmp_path))  # its state directory goes here, and must be gone after
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rljobs"] == 3 and result["seconds_to_running"] > 0
    assert 0 < result["reconcile_p50_s"] <= result["reconcile_p99_s"]
    assert result["operator_peak_rss_mib"] > 0 and result["idle_writes"] == 0
    assert result["new_rljob_seen_after_restart_s"] > 0
    assert "time until all Running" in run.stdout and "idle requests / RLJob / min" in run.stdout
    assert not list(tmp_path.glob("treetrain-operator-bench-*")), "the bench left its state directory"
