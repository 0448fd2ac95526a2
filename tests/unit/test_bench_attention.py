"""bench/attention.py (what bench/gpu.sh runs on a GPU) must not rot: run its smoke mode on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_attention_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    cmd = [sys.executable, str(ROOT / "bench" / "attention.py"), "--smoke", "--dtype", "float32", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    text = out.read_text()
    assert "| sparse | " in text and "| yes |" in text and "| NO |" not in text
    assert text.count("causal flat (SDPA)") == 5  # one baseline row per workload
