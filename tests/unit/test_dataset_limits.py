"""Bounded datasets: rows sized by bytes against trainer.maxEpisodeTokens before any tokenizer
sees them, a scan that streams (one row and a chunk of the file in memory, never the file, an
over-long line never read whole), JSON lists read item by item, and large files read through a
memory-mapped Arrow cache keyed by the file's path, size and modification time.

The bounds are scaled down through ``ByteLimits`` and ``load_rows``' ``cache_from_bytes`` (what
the trainer passes from its config), so every file here is small.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treetrain.config.trainer_settings import DatasetSettings
from treetrain.rl.dataset import ByteLimits, DatasetError, load_rows
from treetrain.rl.dataset_cache import entry_for
from treetrain.rl.dataset_check import BYTES_PER_TOKEN, ROW_BYTES_MIN, RowRules, scan_file
from treetrain.rl.dataset_stream import ListError, json_list_items

GOOD = {"prompt": "What is 2 + 2?", "answer": "4"}
SMALL = ByteLimits(tokens=16, prompt=16 * BYTES_PER_TOKEN, row=1024)  # prompts up to 128 bytes, rows 1 KiB


def settings(path: Path) -> DatasetSettings:
    return DatasetSettings(path=str(path), shuffle=False)


def jsonl(path: Path, *rows: Any) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the trainer's dataset cache goes in these tests (never the user's ~/.cache)."""
    monkeypatch.setenv("TREETRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


def test_the_bounds_follow_max_episode_tokens() -> None:
    assert ByteLimits.for_episode(32768) == ByteLimits(32768, 32768 * BYTES_PER_TOKEN, ROW_BYTES_MIN)
    big = ByteLimits.for_episode(1 << 20)
    assert big.prompt == 8 << 20 and big.row == 4 * big.prompt  # a row holds 4 prompts' worth


# -- a prompt that cannot fit, by bytes ------------------------------------------------------


def _write(fmt: str, path: Path, prompts: list[Any]) -> Path:
    rows = [{"prompt": p, "answer": "4"} for p in prompts]
    if fmt == "jsonl":
        return jsonl(path.with_suffix(".jsonl"), *rows)
    if fmt == "json":
        out = path.with_suffix(".json")
        out.write_text(json.dumps(rows, indent=2), encoding="utf-8")
        return out
    if fmt == "csv":
        out = path.with_suffix(".csv")
        out.write_text("prompt,answer\n" + "".join(f"{p},4\n" for p in prompts), encoding="utf-8")
        return out
    if fmt == "parquet":
        out = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), out)
        return out
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WHERE = {
    "jsonl": "line 2",
    "json": "row index 1",
    "csv": "row index 1",
    "parquet": "row index 1",
    "disk": "row index 1",
}


@pytest.mark.parametrize("fmt", list(WHERE))
def test_a_prompt_past_the_byte_bound_is_refused_with_its_row(tmp_path: Path, fmt: str) -> None:
    """128 bytes fit; 129 do not; a prompt of 40 four-byte characters is 160 bytes (bytes, not
    characters, are judged)."""
    at_bound, over = "x" * 128, "\N{GRINNING FACE}" * 40
    path = _write(fmt, tmp_path / "rows", ["short", over, "y" * 129, at_bound])
    with pytest.raises(DatasetError) as info:
        load_rows(settings(path), limits=SMALL)
    message = str(info.value)
    assert message == (
        f"trainer.dataset {path}: {WHERE[fmt]}: prompt 'prompt' has 160 bytes, more than trainer.maxEpisodeTokens "
        "(16) x 8 = 128; fix: shorten or drop the row, or raise trainer.maxEpisodeTokens (and 1 more bad row)"
    )
    fits = _write(fmt, tmp_path / "fits", ["short", at_bound])
    assert [r["prompt"] for r in load_rows(settings(fits), limits=SMALL)] == ["short", at_bound]


def test_a_prompt_of_messages_counts_every_content(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "s" * 64}, {"role": "user", "content": "u" * 65}]
    path = jsonl(tmp_path / "a.jsonl", GOOD, {"prompt": chat, "answer": "4"})
    with pytest.raises(DatasetError, match=r"line 2: prompt 'prompt' has 129 bytes"):
        load_rows(settings(path), limits=SMALL)
    disk = _write("disk", tmp_path / "saved", [chat[:1], chat])
    with pytest.raises(DatasetError, match=r"row index 1: prompt 'prompt' has 129 bytes"):
        load_rows(settings(disk), limits=SMALL)


# -- a row too large to hold ------------------------------------------------------------------


def _peak_while(fn: Any) -> int:
    """The most memory Python held while ``fn`` ran (a DatasetError it raises is expected)."""
    tracemalloc.start()
    try:
        fn()
    except DatasetError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_an_over_long_line_is_refused_without_being_read_whole(tmp_path: Path) -> None:
    """An 8 MiB JSON line (a prompt of a huge field) and a CSV line with an 8 MiB field, against
    rows of 64 KiB: refused by line number, the others counted; the scan never holds the line."""
    limits = ByteLimits(tokens=16, prompt=128, row=64 << 10)
    huge = "w" * (8 << 20)
    lines = tmp_path / "a.jsonl"
    jsonl(lines, GOOD, GOOD, {"prompt": huge, "answer": "4"}, GOOD, {"prompt": "x", "answer": huge})
    rules = RowRules("trainer.dataset", str(lines), "prompt", "answer", "builtin:math", limits)
    with pytest.raises(DatasetError) as info:
        scan_file(lines, "json", rules)
    message = str(info.value)
    assert message.startswith(f"trainer.dataset {lines}: line 3: the row is longer than 65,536 bytes")
    assert message.endswith("fix: shorten or drop the row (and 1 more bad row)")
    assert _peak_while(lambda: scan_file(lines, "json", rules)) < 2 << 20

    csv = tmp_path / "a.csv"
    csv.write_text(f"prompt,answer\nhi,1\n{huge},2\nho,3\n")
    with pytest.raises(DatasetError, match=r"a.csv: line 3: the row is longer than 65,536 bytes"):
        load_rows(settings(csv), limits=limits)
    rules = RowRules("trainer.dataset", str(csv), "prompt", "answer", "builtin:math", limits)
    assert _peak_while(lambda: scan_file(csv, "csv", rules)) < 2 << 20


def test_a_file_of_one_over_long_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "' + "w" * 5000 + '"}\n')
    with pytest.raises(DatasetError, match=r"a.jsonl: line 1: the row is longer than 1,024 bytes.*drop the row$"):
        load_rows(settings(path), limits=SMALL)


def test_a_json_list_item_too_long_is_refused_by_row_index(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([GOOD, GOOD, {"prompt": "x", "meta": "m" * 4000}, GOOD]))
    with pytest.raises(DatasetError, match=r"a.json: row index 2: the row is longer than 1,024 bytes"):
        load_rows(settings(path), limits=SMALL)


def test_loaded_rows_whose_columns_pass_the_row_bound_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2" * 2000, "3"]}), path)
    with pytest.raises(DatasetError, match=r"a.parquet: row index 1: the row is longer than 1,024 bytes"):
        load_rows(settings(path), limits=SMALL)


# -- the scan streams ---------------------------------------------------------------------------


def test_a_json_list_is_scanned_item_by_item(tmp_path: Path) -> None:
    """A 6 MiB list of 150,000 rows: the old scan held the text and every row (over 100 MiB)."""
    path = tmp_path / "a.json"
    with path.open("w") as f:
        f.write("[" + ",\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(150_000)) + "]")
    size = path.stat().st_size
    rules = RowRules("trainer.dataset", str(path), "prompt", "answer", "builtin:math")
    out = tmp_path / "rows.jsonl"
    peak = _peak_while(lambda: scan_file(path, "json", rules, list_out=out))
    assert size > 5 << 20 and peak < size / 2, (size, peak)
    with out.open() as f:
        assert sum(1 for _ in f) == 150_000


def _items(path: Path, limit: int = 1 << 20, chunk: int = 7) -> list[Any]:
    return [value for _, _, value in json_list_items(path, limit, chunk=chunk)]


def test_json_list_items_cross_chunk_boundaries(tmp_path: Path) -> None:
    """Read 7 bytes at a time: items, strings holding brackets, commas, quotes and newlines
    escaped, and multi-byte characters all cut across reads, read back exactly."""
    rows = [
        {"prompt": 'a "quoted" [bracket], {brace}\n\\', "answer": "\N{GRINNING FACE}é"},
        {"prompt": [{"role": "user", "content": "ü" * 30}], "answer": 3.25, "meta": {"deep": [[1], [2, [3]]]}},
        {"prompt": "", "answer": None},
    ]
    path = tmp_path / "a.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, indent=3, ensure_ascii=False).encode())
    assert _items(path) == rows
    assert [text for _, text, _ in json_list_items(path, 1 << 20, chunk=5)][2].startswith("{")
    path.write_text("  [ ]  ")
    assert _items(path) == []


@pytest.mark.parametrize(
    ("text", "kind", "phrase"),
    [
        ('[{"a": 1},\n {"a": 2},]', "json", "line 2 column 11 (row index 2) is not JSON"),
        ('[{"a": 1} {"a": 2}]', "json", "line 1 column 11 is not JSON (Expecting ',' delimiter)"),
        ('[{"a": 1}] x', "json", "is not JSON (Extra data after the list)"),
        ('[{"a": 1}, {"a": "', "json", "(row index 1) is not JSON (Unterminated string"),
        ("[{'a': 1}, " + '{"a": 2}, ' * 400 + "]", "json", "(row index 0) is not JSON (Expecting property name"),
        ('[{"a": "' + "z" * 1000 + '"}]', "long", ""),  # not read whole: 256 characters are enough
        ("[" + "[" * 100_000, "deep", ""),  # Python's parser gives up past its recursion limit
        ('{"a": 1}', "json", "does not start with ["),
    ],
)
def test_json_list_items_errors(tmp_path: Path, text: str, kind: str, phrase: str) -> None:
    """A short broken item followed by much more of the file is still "not JSON", never "too long"."""
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(ListError) as info:
        _items(path, limit=256 if kind != "deep" else 1 << 20)
    assert info.value.kind == kind and phrase in str(info.value), str(info.value)


def test_a_json_list_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(b'[\n{"a": 1},\n{"a": 2},\n{"a": "\xff"}]')
    with pytest.raises(ListError, match=r"^line 4 is not UTF-8 text \(byte 0xff\)"):
        _items(path)


# -- the Arrow cache ----------------------------------------------------------------------------


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*") if p.is_dir()) if root.exists() else []


def test_a_large_file_is_mapped_from_its_cache_and_reused(tmp_path: Path, cache_root: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", *({"prompt": f"q{i}", "answer": str(i)} for i in range(50)))
    rows: Any = load_rows(settings(path), cache_from_bytes=1024)
    assert len(rows) == 50 and rows[49] == {"prompt": "q49", "answer": "49"}
    entry = entry_for(path, cache_root)
    assert _entries(cache_root) == [entry] and entry.name == f"{path.stat().st_size}-{path.stat().st_mtime_ns}"
    files = [f["filename"] for f in rows.cache_files]
    assert files and all(Path(f).is_relative_to(entry) for f in files)  # memory-mapped from the entry
    again: Any = load_rows(settings(path), cache_from_bytes=1024)
    assert [f["filename"] for f in again.cache_files] == files  # the same copy, not a second one

    jsonl(path, *({"prompt": f"new{i}", "answer": str(i)} for i in range(60)))  # a new version of the file
    newer: Any = load_rows(settings(path), cache_from_bytes=1024)
    assert newer[0]["prompt"] == "new0" and _entries(cache_root) == [entry_for(path, cache_root)] != [entry]

    small = jsonl(tmp_path / "small.jsonl", GOOD)
    kept: Any = load_rows(settings(small), cache_from_bytes=1024)
    assert kept.cache_files == [] and len(_entries(cache_root)) == 1  # in memory, nothing kept


def test_a_large_json_list_is_cached_as_json_lines(tmp_path: Path, cache_root: Path) -> None:
    rows = [{"prompt": f"line one\nline {i}", "answer": str(i), "meta": {"i": [i, i + 1]}} for i in range(40)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    loaded: Any = load_rows(settings(path), cache_from_bytes=1024)
    assert [dict(r) for r in loaded] == rows
    lines = entry_for(path, cache_root) / "rows.jsonl"
    assert [json.loads(line) for line in lines.read_text().splitlines()] == rows
    assert not list(lines.parent.glob("*.partial"))
    assert [dict(r) for r in load_rows(settings(path), cache_from_bytes=1024)] == rows  # reused, checked again


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TREETRAIN_CACHE", str(blocker))
    path = jsonl(tmp_path / "rows.jsonl", GOOD, GOOD)
    with pytest.raises(DatasetError) as info:
        load_rows(settings(path), cache_from_bytes=16)
    message = str(info.value)
    assert message.startswith(f"trainer.dataset.path {path}: cannot write its Arrow cache in {blocker}/datasets")
    assert "fix: set TREETRAIN_CACHE to a writable directory with room for about 1 MiB" in message


def _tree(root: Path) -> Iterator[str]:
    for dirpath, _, names in os.walk(root):
        yield from (os.path.join(dirpath, n) for n in names)


def test_an_explicit_cache_dir_keeps_a_small_file_there(tmp_path: Path, cache_root: Path) -> None:
    path = jsonl(tmp_path / "rows.jsonl", GOOD)
    rows: Any = load_rows(settings(path), cache_dir=tmp_path / "mine")
    assert rows.cache_files and all(f["filename"].startswith(str(tmp_path / "mine")) for f in rows.cache_files)
    assert not list(_tree(cache_root.parent))


def test_a_full_disk_under_the_cache_is_one_line(tmp_path: Path) -> None:
    """datasets wraps the OSError of a full disk in its own error; the cause is found and named."""
    import errno

    from treetrain.rl.dataset_cache import no_space

    path = jsonl(tmp_path / "rows.jsonl", GOOD)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as full:
            raise RuntimeError("An error occurred while generating the dataset") from full
    except RuntimeError as wrapped:
        found = no_space(wrapped, path, tmp_path / "cache", "trainer.dataset")
    assert found is not None and str(found) == (
        f"trainer.dataset.path {path}: no space left for its Arrow copy in {tmp_path / 'cache'}; fix: free space "
        "there, or set TREETRAIN_CACHE to a directory with room for about 1 MiB"
    )
    assert no_space(RuntimeError("a malformed row"), path, tmp_path, "trainer.dataset") is None


def test_the_dataset_task_judges_a_prompt_by_bytes_before_its_tokenizer() -> None:
    """A row that changed after the load check (the task holds whatever rows it is given): the
    bound holds again before the prompt is rendered; the tokenizer is never called."""
    from treetrain.config.trainer_settings import TrainerSettings
    from treetrain.rl.dataset import DataCursor, DatasetTask
    from treetrain.rl.rewards import RewardRunner, load_reward

    class NoTokenizer:  # a stand-in: the test is that rendering never starts
        eos_token_id = 0

        def __len__(self) -> int:
            return 8

        def get_vocab(self) -> dict[str, int]:
            return {}

        def apply_chat_template(self, *_: Any, **__: Any) -> str:
            raise AssertionError("the tokenizer was asked to render a prompt past the byte bound")

    t = TrainerSettings(
        dataset=DatasetSettings(path="rows.jsonl", shuffle=False),
        reward="builtin:exact",
        max_episode_tokens=16,
        max_new_tokens=8,
    )
    runner = RewardRunner(load_reward("builtin:exact", {}), timeout_s=5, answer_field="answer", log=print)
    rows = [{"prompt": "é" * 65, "answer": "4"}]  # 65 characters, 130 bytes
    task = DatasetTask(rows, t, NoTokenizer(), runner, DataCursor(1, 1, shuffle=False, seed=0))
    with pytest.raises(DatasetError, match=r"^trainer.dataset rows.jsonl: row index 0: prompt 'prompt' has 130 bytes"):
        task.episode_at(0, 0, seed=0)
