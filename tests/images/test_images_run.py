"""The images `make images` built, run for real (docker run, no network): the trainer image trains
one step of the embedded default job, and the operator image starts its command without torch.

Needs the images (`make images`; `make test` builds them first): when they are missing the test
fails with that instruction. Each run goes through `tests/images/build --docker`, which uses the
daemon the images live in (starting our own dockerd for the command when none answers).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "tests" / "images" / "build"
DOCKERFILE = ROOT / "trainer-image" / "Dockerfile"
pytestmark = [pytest.mark.images, pytest.mark.slow]


def built_images() -> dict[str, str]:
    done = subprocess.run([str(BUILD), "--print"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail("the images are not built: run `make images` (tests/images/build) first", pytrace=False)
    return dict(line.split("=", 1) for line in done.stdout.split())


def docker(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUILD), "--docker", *args], capture_output=True, text=True, timeout=timeout)


def test_trainer_image_trains_one_step(tmp_path: Path) -> None:
    """`train --steps 1` in the trainer image as its own user, from its own working directory (the
    repository's operator/ folder on sys.path broke `import torch` there), with the torch that
    pyproject.toml names (2.14 lacks the torch.foreach the first optimizer step calls)."""
    image = built_images()["trainer"]
    torch_pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert torch_pin is not None
    checks = (
        "import operator, os, torch; "
        "print('operator', operator.__file__); print('cwd', os.getcwd()); print('torch', torch.__version__); "
        "assert hasattr(torch, 'foreach')"
    )
    script = f'python3 -c "{checks}" && treetrain-entrypoint train --steps 1 --no-compare --metrics-port 0'
    done = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "/bin/bash", image, "-c", script, timeout=900
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()[:3])
    assert lines["operator"].startswith("/usr/lib/python3"), lines  # the standard library's, no source tree
    assert lines["cwd"] == "/home/treetrain"
    assert lines["torch"].split("+")[0] == torch_pin.group(1)  # pyproject agrees: tests/unit/test_trainer_image.py
    assert "step 1/1 |" in done.stdout and "done: 1 steps" in done.stdout, out[-4000:]


def test_operator_image_runs_without_torch() -> None:
    image = built_images()["operator"]
    done = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c",
        "import importlib.util, os, rljob_operator.runner; "
        "assert importlib.util.find_spec('torch') is None; print('uid', os.getuid())",
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["uid", "65532"]
    done = docker("run", "--rm", "--network", "none", image, "--help", timeout=300)
    assert done.returncode == 0 and "operator" in done.stdout, done.stdout + done.stderr
