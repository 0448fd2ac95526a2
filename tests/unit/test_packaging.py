"""Packaging rules from docs/contracts.md: the operator side never needs torch, and every
package directory is listed in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "treetrain").rglob("__init__.py")
        if "__pycache__" not in path.parts
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert config["package-dir"]["rljob_operator"] == "operator"


def test_operator_side_imports_without_torch() -> None:
    code = (
        "import sys, treetrain, treetrain.alloc, treetrain.cli, treetrain.config, rljob_operator, rljob_operator.cli\n"
        "import rljob_operator.handlers, rljob_operator.runner, rljob_operator.plan, rljob_operator.crd\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'megatron', 'triton') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
        "import operator; assert operator.__file__ is None or 'site-packages' not in operator.__file__\n"
        "assert hasattr(operator, 'itemgetter')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("cwd", ["/", str(ROOT)])
def test_operator_dir_never_shadows_the_stdlib(cwd: str) -> None:
    # From the repo root too, where ./operator/ sits first on sys.path.
    code = "import operator, rljob_operator; print(operator.itemgetter.__module__, rljob_operator.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd)
    assert out.stdout.split() == ["operator", "rljob_operator"]
