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
    assert config["package-dir"]["rljob_operator"] == "operator/rljob_operator"


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
    # From the repo root too, where ./operator/ sits first on sys.path: the package is one level
    # down (operator/rljob_operator/), so the folder is no package and the stdlib's module wins.
    code = "import operator, rljob_operator; print(operator.itemgetter.__module__, rljob_operator.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd)
    assert out.stdout.split() == ["operator", "rljob_operator"]
    # What a user script run from the root does first (it failed when operator/ was the package).
    out = subprocess.run(
        [sys.executable, "-c", "import logging, operator; print(operator.add)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    )
    assert out.stdout.strip() == "<built-in function add>"
    assert not (ROOT / "operator" / "__init__.py").exists()


def _layers_contract() -> list[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["treetrain"]]
    return [" | ".join(part.strip() for part in layer.split("|")) for layer in layers["layers"]]


def _layers_in_docs() -> list[str]:
    """The diagram of docs/contracts.md's Layers section: one layer a line, before its `—`."""
    doc = (ROOT / "docs" / "contracts.md").read_text()
    section = doc[doc.index("\n## Layers\n") :]
    block = section[section.index("```text\n") + len("```text\n") : section.index("\n```", section.index("```text"))]
    return [" | ".join(p.strip() for p in line.split("—")[0].split("|")) for line in block.splitlines() if line]


def test_the_docs_layers_diagram_is_the_import_contract() -> None:
    assert _layers_in_docs() == _layers_contract(), "docs/contracts.md's Layers diagram and pyproject.toml differ"


def test_every_part_of_treetrain_sits_in_a_layer() -> None:
    """A new package or top-level module must be placed in the layers contract, not escape it."""
    parts = {p.name for p in (ROOT / "treetrain").iterdir() if (p / "__init__.py").is_file()}
    parts |= {p.stem for p in (ROOT / "treetrain").glob("*.py") if p.stem != "__init__"}
    layered = {name.strip() for layer in _layers_contract() for name in layer.split("|")}
    assert parts == layered


def test_every_operator_module_is_layered_and_documented() -> None:
    """Each module of operator/ is in the operator's layers contract and in docs/operator.md's table
    (a new module would otherwise escape both)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["rljob_operator"]]
    layered = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    modules = {p.stem for p in (ROOT / "operator" / "rljob_operator").glob("*.py") if p.stem != "__init__"}
    assert modules == layered
    doc = (ROOT / "docs" / "operator.md").read_text()
    assert [m for m in sorted(modules) if f"`{m}.py`" not in doc] == []
