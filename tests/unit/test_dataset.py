"""Dataset runs (treetrain.rl.dataset): rows from every local format, offline; the row order
(no row twice in an epoch, resumable, replacement groups apart); the dataset task's episodes."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from treetrain.config.trainer_settings import DatasetSettings, TrainerSettings
from treetrain.rl.dataset import (
    REPLACEMENT_FACTOR,
    DataCursor,
    DatasetError,
    DatasetTask,
    load_rows,
    prompt_messages,
    render_prompt,
    stop_token_ids,
)
from treetrain.rl.rewards import RewardRunner, load_reward

ROOT = Path(__file__).resolve().parents[2]
N = 12


def _make_data() -> Any:
    spec = importlib.util.spec_from_file_location("gsm8k_make_data", ROOT / "examples" / "gsm8k" / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_data = _make_data()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return dict(make_data.write(tmp_path_factory.mktemp("data"), n=N, seed=3))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("hf-cache"))


def settings(path: Path | str, **kw: Any) -> DatasetSettings:
    return DatasetSettings(path=str(path), prompt_field="question", **kw)


@pytest.mark.parametrize("fmt", make_data.FORMATS)
def test_every_format_loads_the_same_rows(files: dict[str, Path], cache: str, fmt: str) -> None:
    rows = load_rows(settings(files[fmt]), cache_dir=cache)
    want = make_data.rows(N, seed=3)
    assert len(rows) == N
    assert [dict(rows[i]) for i in range(N)] == want
    assert want[0]["answer"].splitlines()[-1].startswith("#### ")


def test_the_committed_example_data_is_make_data_output() -> None:
    for name, n, seed in (("train", 64, 0), ("test", 16, 1)):
        lines = (ROOT / "examples" / "gsm8k" / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == make_data.rows(n, seed), f"rerun make_data.py ({name})"


def test_a_dataset_dict_picks_the_split(tmp_path: Path, cache: str) -> None:
    import datasets

    d = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"question": ["a", "b"], "answer": ["1", "2"]}),
            "test": datasets.Dataset.from_dict({"question": ["c"], "answer": ["3"]}),
        }
    )
    d.save_to_disk(str(tmp_path / "d"))
    assert [r["question"] for r in load_rows(settings(tmp_path / "d", split="test"))] == ["c"]
    with pytest.raises(DatasetError, match=r"split 'validation' is not in .*; its splits: train, test"):
        load_rows(settings(tmp_path / "d", split="validation"))


def test_without_a_cache_dir_the_rows_stay_readable(files: dict[str, Path], tmp_path: Path) -> None:
    rows = load_rows(settings(files["csv"]))  # its Arrow copy is gone: the rows are in memory
    assert len(rows) == N and rows[N - 1] == make_data.rows(N, seed=3)[N - 1]


def test_a_single_file_is_the_split_train(files: dict[str, Path], cache: str) -> None:
    with pytest.raises(DatasetError, match="holds one split: train"):
        load_rows(settings(files["jsonl"], split="test"), cache_dir=cache)


def test_a_hub_id_is_refused_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError) as info:
        load_rows(settings("openai/gsm8k"))
    message = str(info.value)
    assert "treetrain reads local datasets only: download it first" in message
    assert "save_to_disk(DIR)" in message and "trainer.dataset.path to DIR" in message


@pytest.mark.parametrize(
    ("make", "phrase"),
    [
        (lambda d: d / "nope.jsonl", "no such file or directory"),
        (lambda d: _write(d / "rows.txt", "x"), "unknown format .txt"),
        (lambda d: _write(d / "empty.jsonl", ""), "the file is empty"),
        (lambda d: _write(d / "bad.jsonl", "{not json\n"), "line 1 is not JSON"),
        (lambda d: (d / "plain").mkdir() or d / "plain", "save_to_disk did not write"),
    ],
)
def test_unreadable_paths_are_one_line(tmp_path: Path, cache: str, make: Callable[[Path], Path], phrase: str) -> None:
    with pytest.raises(DatasetError, match=phrase) as info:
        load_rows(settings(make(tmp_path)), cache_dir=cache)
    assert "\n" not in str(info.value)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_columns_name_the_columns_there(files: dict[str, Path], cache: str) -> None:
    with pytest.raises(DatasetError) as info:
        load_rows(DatasetSettings(path=str(files["csv"]), answer_field="solution"), cache_dir=cache)
    message = str(info.value)
    assert "no column 'prompt', 'solution'" in message and "its columns are question, answer" in message


def test_a_column_of_messages_loads_as_chat(tmp_path: Path, cache: str) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?", "name": "kid"}]
    lines = [{"prompt": chat, "answer": "4"}, {"prompt": chat[1:], "answer": "4"}]
    _write(tmp_path / "chat.jsonl", "".join(json.dumps(r) + "\n" for r in lines))
    s = DatasetSettings(path=str(tmp_path / "chat.jsonl"))
    rows = load_rows(s, cache_dir=cache)
    assert prompt_messages(rows[0], s) == [{"role": "system", "content": "be brief"}, chat[1]]
    assert prompt_messages(rows[1], s) == [chat[1]]


def test_prompt_messages() -> None:
    s = DatasetSettings(path="x")
    assert prompt_messages({"prompt": "hi"}, s) == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_messages({"prompt": chat}, s) == chat
    padded = [{"role": "user", "content": "hi", "name": None}]  # a column of messages fills unset keys
    assert prompt_messages({"prompt": padded}, s) == [{"role": "user", "content": "hi"}]
    for bad, phrase in [
        (None, "no prompt"),
        ([], "empty list"),
        ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'"),
    ]:
        with pytest.raises(DatasetError, match=phrase):
            prompt_messages({"prompt": bad}, s)


# -- the row order ----------------------------------------------------------------------------


def rows_of(cursor: DataCursor, steps: range, groups: int) -> list[int]:
    return [cursor.row_index(s, g) for s in steps for g in range(groups)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_no_row_twice_within_an_epoch(shuffle: bool) -> None:
    c = DataCursor(10, 3, shuffle=shuffle, seed=5)
    order = rows_of(c, range(10), 3)  # 30 slots: three epochs
    epochs = [order[i : i + 10] for i in range(0, 30, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    if shuffle:
        assert epochs[0] != list(range(10)) and epochs[0] != epochs[1]
        assert rows_of(DataCursor(10, 3, shuffle=True, seed=6), range(10), 3) != order
    else:
        assert epochs[0] == list(range(10))
    assert rows_of(DataCursor(10, 3, shuffle=shuffle, seed=5), range(10), 3) == order  # deterministic


def test_resume_continues_with_the_next_rows() -> None:
    c = DataCursor(10, 3, shuffle=True, seed=1)
    state = json.loads(json.dumps(c.state(4)))
    assert state == {
        "version": 1, "next_step": 4, "next_row": 12, "rows": 10, "groups_per_step": 3, "shuffle": True, "seed": 1,
    }  # fmt: skip
    again = DataCursor.from_state(state, 10, 3, shuffle=True, seed=1)
    assert again.note is None
    assert rows_of(again, range(4, 9), 3) == rows_of(c, range(4, 9), 3)
    with pytest.raises(ValueError, match="before this cursor's first step"):
        again.row_index(3, 0)


def test_a_new_groups_per_step_continues_from_the_next_row() -> None:
    c = DataCursor(10, 3, shuffle=True, seed=1)
    wider = DataCursor.from_state(c.state(4), 10, 5, shuffle=True, seed=1)
    # Slots 12, 13, ... in order, now five a step.
    assert rows_of(wider, range(4, 7), 5) == [c._row("main", slot) for slot in range(12, 27)]
    state = wider.state(7)
    assert state["next_row"] == 27 and state["groups_per_step"] == 5


def test_a_changed_dataset_is_noted() -> None:
    state = DataCursor(10, 3, shuffle=True, seed=1).state(2)
    moved = DataCursor.from_state(state, 14, 3, shuffle=True, seed=2)
    assert moved.note is not None and "had 10 rows and has 14" in moved.note and "order is a new one" in moved.note
    assert all(0 <= r < 14 for r in rows_of(moved, range(2, 12), 3))
    with pytest.raises(DatasetError, match="not a version-1 data cursor"):
        DataCursor.from_state({"version": 9}, 10, 3, shuffle=True, seed=1)


def test_replacement_groups_take_their_own_stream() -> None:
    c = DataCursor(10, 2, shuffle=True, seed=0)
    main = rows_of(c, range(3), 2)
    extra = [c.row_index(s, g) for s in range(5) for g in range(2, 2 + REPLACEMENT_FACTOR * 2)]
    assert rows_of(c, range(3), 2) == main  # replacements never shift the steps' rows
    assert sorted(extra[:10]) == list(range(10)) and sorted(extra[10:20]) == list(range(10))
    plain = DataCursor(10, 2, shuffle=False, seed=0)
    assert plain.row_index(0, 2) == plain.row_index(0, 2) and 0 <= plain.row_index(7, 9) < 10


# -- the dataset task ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from treetrain.engines.builtin import load_tokenizer

    return load_tokenizer("builtin:smollm2-135m")


def test_the_dataset_task_plays_one_row_per_group(tokenizer: Any) -> None:
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]
    t = TrainerSettings(dataset=settings("x", shuffle=False), reward="builtin:exact", max_new_tokens=32)
    lines: list[str] = []
    reward = RewardRunner(load_reward("builtin:exact", {}), timeout_s=10, answer_field="answer", log=lines.append)
    task = DatasetTask(rows, t, tokenizer, reward, DataCursor(6, 2, shuffle=False, seed=0))
    assert task.max_new_tokens == 32 and task.vocab_size == len(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in task.stop_token_ids and tokenizer.eos_token_id in task.stop_token_ids
    with pytest.raises(ValueError, match="episode_at"):
        task.episode(0)
    ep = task.episode_at(1, 1, seed=7)  # slot 3
    prompt = ep.prompt()
    want = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 3 + 1?"}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )
    assert prompt == want and prompt[0] != prompt[1]
    assert task.episode_at(1, 1, seed=8).prompt() == prompt  # a group's episodes share the row
    assert ep.respond([*tokenizer.encode("4", add_special_tokens=False), im_end]) == (None, 1.0)
    assert ep.respond(tokenizer.encode("5", add_special_tokens=False)) == (None, 0.0)
    assert lines == []


def test_render_prompt_keeps_one_bos(tokenizer: Any) -> None:
    class Doubling:
        bos_token_id = 1

        def apply_chat_template(self, *_: Any, **__: Any) -> str:
            return "<s>hi"

        def encode(self, text: str, add_special_tokens: bool) -> list[int]:
            return [1, 1, 5]

    assert render_prompt(Doubling(), [{"role": "user", "content": "hi"}]) == [1, 5]
    assert stop_token_ids(tokenizer)[0] == tokenizer.eos_token_id


def test_play_episodes_asks_a_dataset_task_by_step_and_group() -> None:
    from treetrain.rl.episodes import play_episodes
    from treetrain.rl.rollout import Generation

    asked: list[tuple[int, int]] = []

    class Episode:
        def __init__(self, row: int) -> None:
            self.row = row

        def prompt(self) -> list[int]:
            return [1, 2, self.row]

        def respond(self, response: list[int]) -> tuple[None, float]:
            return None, float(self.row)

    class RowTask:
        vocab_size, max_new_tokens, stop_token_ids = 64, 2, ()

        def episode(self, seed: int) -> Episode:
            raise AssertionError("a dataset task is asked by step and group")

        def episode_at(self, step: int, group: int, seed: int) -> Episode:
            asked.append((step, group))
            return Episode(10 + group)

    def generate(prompts: list[list[int]], params: Any, seed: int) -> list[Generation]:
        return [Generation(tokens=[3], logprobs=[0.0], finish_reason="stop", versions=[0]) for _ in prompts]

    out = play_episodes(RowTask(), generate, TrainerSettings(), 5, [0, 0, 1, 1], turn_seed=lambda turn: turn)
    assert asked == [(5, 0), (5, 0), (5, 1), (5, 1)]
    assert out.rewards == [10.0, 10.0, 11.0, 11.0]
