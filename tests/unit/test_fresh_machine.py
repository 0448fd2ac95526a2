"""A fresh machine with the wrong tools is told what to install, in one line, before any build:
``make`` checks the Python version, the control-plane build checks the Go version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers import ROOT


def _fake(tmp: Path, name: str, script: str) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_make_refuses_an_old_python_with_what_to_install(tmp_path: Path) -> None:
    # A stand-in interpreter that fails the version check as Python 3.10 does (exit 1).
    python = _fake(tmp_path, "python3", 'case "$1" in -V) echo "Python 3.10.13";; *) exit 1;; esac\n')
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", f"PYTHON={python}", f"VENV={venv}", f"{venv}/bin/python"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("make: ") and "Python 3.10.13" in line]
    assert len(lines) == 1 and "needs Python >= 3.11" in lines[0] and "PYTHON=python3.11" in lines[0], done.stderr
    assert not (venv / "bin" / "python").exists()


def test_the_cluster_build_refuses_an_old_go_with_what_to_install(tmp_path: Path) -> None:
    _fake(tmp_path, "go", 'if [ "$1 $2" = "env GOVERSION" ]; then echo go1.20.3; else exit 3; fi\n')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    done = subprocess.run(
        [str(ROOT / "tests" / "cluster" / "build")], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 1
    (line,) = [line for line in done.stderr.splitlines() if "error:" in line]
    assert "go 1.20.3 is older than the go 1.26" in line and "install go >=" in line, done.stderr
