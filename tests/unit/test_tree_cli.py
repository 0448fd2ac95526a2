"""`treetrain pack-stats`: frozen flags and --json keys, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treetrain.cli import build_parser, main

JSON_KEYS = [
    "file",
    "sequences",
    "trees",
    "original_tokens",
    "tree_tokens",
    "padded_tokens",
    "tree_token_ratio",
    "padding_ratio",
    "max_tokens_per_mb",
    "rank_tree_tokens",
]


def _write(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_flags_are_frozen() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    options = sorted(o for a in sub.choices["pack-stats"]._actions for o in a.option_strings)  # type: ignore[attr-defined]
    assert options == sorted(["--block-size", "--dp", "--json", "--max-tokens", "-h", "--help"])


def test_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, ["[1, 2, 3, 4]", '{"input_ids": [1, 2, 5, 6]}', "[1, 7, 8]", ""])
    assert main(["pack-stats", path, "--max-tokens", "256", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert list(row) == JSON_KEYS
    assert row["tree_tokens"] == 8 and row["original_tokens"] == 11 and row["trees"] == 1
    assert row["tree_token_ratio"] == pytest.approx(8 / 11, abs=1e-6)
    assert row["padded_tokens"] == 120  # padded to one 128-token block, not to --max-tokens


def test_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, ["[1, 2, 3]", "[1, 2, 4]"])
    assert main(["pack-stats", path, "--max-tokens", "128", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    # two ranks need two micro-batches: the pair is split, so nothing is shared
    assert "2 sequences -> 2 trees over 2 ranks" in out and "tree_token_ratio  1.0000" in out
    assert main(["pack-stats", path, "--max-tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "2 sequences -> 1 tree over 1 rank\n" in out and "tree_token_ratio  0.6667" in out


@pytest.mark.parametrize(
    ("lines", "args", "message"),
    [
        (["[1, 2]"], ["--max-tokens", "100"], "--max-tokens (100) must be a multiple of 128 (lcm of --block-size=128"),
        (["[1, 2]", "not json"], ["--max-tokens", "128"], ":2: not JSON"),
        (
            ['{"ids": [1]}'],
            ["--max-tokens", "128"],
            ':1: expected a JSON list of token ids or an object with "input_ids"',
        ),
        (["[1, 2]", "[]"], ["--max-tokens", "128"], "sequence 1 is empty"),
        (
            ["[1, 2]", str(list(range(200)))],
            ["--max-tokens", "128"],
            "sequence 1 has 200 tokens, more than --max-tokens=128",
        ),
        ([""], ["--max-tokens", "128"], "no sequences"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], args: list[str], message: str
) -> None:
    path = _write(tmp_path, lines)
    assert main(["pack-stats", path, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treetrain pack-stats: error:") and message in err
    assert "Traceback" not in err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack-stats", "/nonexistent/x.jsonl", "--max-tokens", "128"]) == 2
    assert "No such file" in capsys.readouterr().err
