"""Rewrite the generated blocks of the docs from the models (tests fail while one is stale):

    python docs/generate.py          # rewrite them
    python docs/generate.py --check  # exit 1 if one is stale

docs/trainer.md: the trainer config reference (treetrain.config.reference.table);
docs/rljob-reference.md: the RLJob field table (rljob_operator.crd.reference_table).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from rljob_operator.crd import reference_table
from treetrain.config.reference import table

DOCS = Path(__file__).resolve().parent
BLOCKS: dict[str, Callable[[], str]] = {"trainer.md": table, "rljob-reference.md": reference_table}


def rewrite(text: str, body: str) -> str:
    begin = text.index("-->\n", text.index("<!-- BEGIN generated")) + 4
    end = text.index("<!-- END generated -->")
    return text[:begin] + body + text[end:]


def main(argv: list[str]) -> int:
    stale = []
    for name, make in BLOCKS.items():
        path = DOCS / name
        text = path.read_text()
        new = rewrite(text, make())
        if new != text:
            stale.append(name)
            if "--check" not in argv:
                path.write_text(new)
    if stale:
        verb = "stale" if "--check" in argv else "rewritten"
        print(f"{verb}: {', '.join(stale)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
