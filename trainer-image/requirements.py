#!/usr/bin/env python3
"""Print the requirements of the project and the given extras, one per line, from pyproject.toml.

    python3 trainer-image/requirements.py pyproject.toml train,megatron,tracking

The trainer image installs these in a layer of their own, before the source is copied, so a
change to the source rebuilds only the last layer (seconds) instead of torch and its CUDA
libraries (minutes). Standard library only (tomllib: Python >= 3.11).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {', '.join(unknown)} in {pyproject} (has {', '.join(optional)})")
    out = list(project.get("dependencies", []))
    for extra in extras:
        out += [r for r in optional[extra] if r not in out]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: requirements.py PYPROJECT EXTRA[,EXTRA...]", file=sys.stderr)
        return 2
    extras = [e for e in argv[1].split(",") if e]
    print("\n".join(requirements(Path(argv[0]), extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
