"""Declared dependency ranges hold: every direct dependency in pyproject.toml has a lower bound, the
bound is the version in constraints/tested.txt, and that is the version installed here (`make`
installs with `-c constraints/tested.txt`), so the suite runs on the lowest version each range
allows. (`torch>=2.6` once let a trainer image with torch 2.14 start and crash in its first step on
`torch.foreach`.)"""

from __future__ import annotations

import tomllib
from importlib.metadata import version

from helpers import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        found += [Requirement(r) for r in extra]
    return found


def _tested() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            pins[canonicalize_name(name)] = Version(pinned)
    return pins


def test_every_lower_bound_is_the_tested_version_and_it_is_installed() -> None:
    tested = _tested()
    problems = []
    for req in _requirements():
        name = canonicalize_name(req.name)
        lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        if not lows:
            problems.append(f"{req}: no lower bound")
            continue
        if name not in tested:
            problems.append(f"{req}: not in constraints/tested.txt")
            continue
        if max(lows) != tested[name]:
            problems.append(f"{req}: lower bound {max(lows)} but constraints/tested.txt tests {tested[name]}")
        if Version(version(req.name)) != tested[name]:
            problems.append(f"{req.name}: {version(req.name)} installed, constraints/tested.txt says {tested[name]}")
    assert not problems, "\n".join(problems)


def test_the_constraints_name_only_direct_dependencies() -> None:
    direct = {canonicalize_name(r.name) for r in _requirements()}
    assert set(_tested()) <= direct, set(_tested()) - direct
