"""bench/async_rl.py must not rot: a tiny run of both modes, and the report's shape (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_async_bench_small_run(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "bench" / "async_rl.py"), "--steps", "2", "--staleness", "1"]
    cmd += ["--token-delay", "0.002", "--groups", "2", "--group-size", "2", "--turns", "1", "--max-new-tokens", "4"]
    cmd += ["--repeat", "1"]
    run = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ideal speed-up (R+T)/max(R,T) = " in run.stdout, run.stdout
    assert "[maxStaleness 1] step 2/2" in run.stdout, run.stdout  # progress while it runs
    rep = json.loads(out.read_text())
    assert rep["ideal_speedup"] >= 1.0 and rep["token_delay_s"] == 0.002
    sync, bounded = rep["runs"]
    assert (sync["staleness"], bounded["staleness"]) == (0, 1)  # the synchronous run always comes first
    for row in (sync, bounded):
        assert row["steps"] == 2 and len(row["rewards"]) == 2 and row["wall_s"] > 0
        for key in ("trainer_idle_fraction", "rollout_idle_fraction", "server_idle_fraction"):
            assert 0.0 <= row[key] <= 1.0, (key, row)
    assert sync["staleness_max"] == 0 and bounded["staleness_max"] <= 1
    for label in ("synchronous ", "maxStaleness 1 "):
        assert any(line.startswith(label) for line in run.stdout.splitlines()), run.stdout
