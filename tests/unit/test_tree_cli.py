"""`treetrain pack-stats`: frozen flags and --json keys, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


HOSTILE = [
    (b"[1, 2, \xff\xfe]\n", ":1: not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", ":1: JSON nested too deeply"),
    (b"[1, " + b"7" * 5000 + b"]\n", ":1: not JSON (Exceeds the limit (4300 digits) for integer string conversion"),
    (b"[1, -3, 4]\n", ":1: token 1 is -3; token ids are 0..2147483647"),
    (b"[1, 4294967296]\n", ":1: token 1 is 4294967296"),
    (b"[1, 2.5]\n", ':1: expected a JSON list of token ids or an object with "input_ids"'),
    (b"[1, true]\n", ':1: expected a JSON list of token ids or an object with "input_ids"'),
    (b"[1, 2]\n" + b" " * (17 << 20) + b"\n", ":2: line longer than 16 MiB"),
]


@pytest.mark.parametrize(("data", "message"), HOSTILE, ids=[m.split(": ", 1)[-1][:24] for _, m in HOSTILE])
def test_hostile_input_is_one_line_with_the_line_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, message: str
) -> None:
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(data)
    assert main(["pack-stats", str(path), "--max-tokens", "128"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err[:300]


def test_endless_input_is_refused_not_swallowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack-stats", "/dev/zero", "--max-tokens", "128"]) == 2
    assert "/dev/zero:1: line longer than 16 MiB" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--dp", "10000"), ("--dp", "0"), ("--block-size", "1000000")])
def test_sizes_out_of_range_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    # --dp 10000 took 45 s for two sequences
    path = _write(tmp_path, ["[1, 2]"])
    assert main(["pack-stats", path, "--max-tokens", "128", flag, value]) == 2
    assert f"{flag} must be in 1.." in capsys.readouterr().err


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=64) | st.sampled_from([b"[1, 2, 3]", b'{"input_ids": [4, 5]}', b"[]"]), max_size=6))
def test_any_input_packs_or_is_one_line_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[bytes]
) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    code = main(["pack-stats", str(path), "--max-tokens", "128", "--json"])
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["sequences"] >= 1
    else:
        assert code == 2 and err.startswith("treetrain pack-stats: error:") and len(err.splitlines()) == 1, err
