"""`treetrain pack-stats`: frozen flags and --json keys, exit codes, streaming and the checks in C."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tracemalloc
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.cli import build_parser, main
from treetrain.cli import pack_stats as pack_stats_cli
from treetrain.tree import PackConfig, PackingError, pack, pack_stats

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


# -- streaming and the checks in C (issue 21) -----------------------------------------------


def _reference_sequence(raw: bytes, where: str) -> list[int]:
    """The item-by-item checks pack-stats ran before they moved into C (the messages to keep)."""
    value = json.loads(raw)
    if isinstance(value, dict):
        value = value.get("input_ids")
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise PackingError(f'{where}: expected a JSON list of token ids or an object with "input_ids": [...]')
    bad = next((i for i, t in enumerate(value) if not 0 <= t <= pack_stats_cli.MAX_TOKEN_ID), None)
    if bad is not None:
        raise PackingError(f"{where}: token {bad} is {value[bad]}; token ids are 0..{pack_stats_cli.MAX_TOKEN_ID}")
    return value


_ITEM = (
    st.integers(min_value=-(2**33), max_value=2**33)
    | st.integers(min_value=0, max_value=300)
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.none()
    | st.text(max_size=5)
    | st.lists(st.integers(0, 9), max_size=2)
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_ITEM, max_size=12),
    st.sampled_from(["list", "object", "object+true", "object+false"]),
)
def test_checks_in_c_say_what_the_item_checks_said(items: list[object], shape: str) -> None:
    if shape == "list":
        raw = json.dumps(items).encode()
    else:
        extra = {"object+true": ', "note": "true"', "object+false": ', "ok": false'}.get(shape, "")
        raw = ('{"input_ids": ' + json.dumps(items) + extra + "}").encode()
    try:
        want: list[int] | str = _reference_sequence(raw, "f:1")
    except PackingError as err:
        want = str(err)
    try:
        got: list[int] | str = list(pack_stats_cli._sequence(raw, "f:1"))
    except PackingError as err:
        got = str(err)
    assert got == want


def test_the_reader_streams(tmp_path: Path) -> None:
    # A generator: a line is read and checked only when the packer asks for it, so the first
    # rows come before a bad line further down is even read.
    path = _write(tmp_path, ["[1, 2, 3]", '{"input_ids": [4, 5]}', "not json"])
    rows = pack_stats_cli.read_jsonl(path)
    assert isinstance(rows, Iterator)
    assert [list(next(rows)), list(next(rows))] == [[1, 2, 3], [4, 5]]
    with pytest.raises(PackingError, match=":3: not JSON"):
        next(rows)


def test_memory_is_the_rows_not_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Agent-shaped samples (each turn holds the conversation so far) with six-digit token ids:
    # about 7 bytes of JSON a token. Lists of Python ints held about 36 bytes a token, and the
    # laid-out trees more (traced peak 7.3x the file); rows of C ints hold 4 (peak 0.57x).
    rng = random.Random(0)
    lines, original = [], 0
    for _ in range(12):
        history = [rng.randrange(100_000, 999_999) for _ in range(2000)]
        for _ in range(10):
            history += [rng.randrange(100_000, 999_999) for _ in range(300)]
            lines.append(json.dumps(history))
            original += len(history)
    path = _write(tmp_path, lines)
    size = Path(path).stat().st_size
    tracemalloc.start()
    try:
        assert main(["pack-stats", path, "--max-tokens", "8192", "--json"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert json.loads(capsys.readouterr().out)["original_tokens"] == original
    assert peak < 0.8 * size, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=30), min_size=1, max_size=25),
    st.sampled_from([128, 256]),
    st.integers(1, 3),
    st.booleans(),
)
def test_pack_stats_on_rows_is_pack_on_lists(seqs: list[list[int]], cap: int, dp: int, pad: bool) -> None:
    config = PackConfig(max_tokens_per_mb=cap, block_size=64, dp_size=dp, pad_to_max=pad)
    rows = [array(pack_stats_cli.TOKEN_TYPECODE, s) for s in seqs]
    assert pack_stats(rows, config) == pack(seqs, config).stats


def test_bench_small_run() -> None:
    # bench/pack_stats.py must not rot: a small run, and its check that before and after agree.
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "bench" / "pack_stats.py"), "--tokens", "50000", "--repeat", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "stats (before == after)" in run.stdout and "after " in run.stdout
