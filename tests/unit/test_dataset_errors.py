"""Bring-your-own-data errors: every broken dataset is one line naming the file, the line (JSON
lines) or row index (Parquet, CSV, a JSON list) and the fix, exit 2, before the model loads, from
`treetrain check` and `treetrain train` alike; and `treetrain check` itself.

The model never loads: `train` runs with model.path a directory that does not exist, so any step
that reached the tokenizer or the weights would fail with that path instead of the dataset's line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from treetrain.cli import main
from treetrain.config.trainer_settings import DatasetSettings
from treetrain.rl.dataset import DataCursor, DatasetError, DatasetTask, load_rows
from treetrain.rl.dataset_check import MAX_DEPTH, too_deep
from treetrain.rl.rewards import reads_answer

GOOD = {"prompt": "What is 2 + 2?", "answer": "4"}
NO_MODEL = "/nonexistent/treetrain-model"


def jsonl(path: Path, *rows: Any) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_config(tmp: Path, dataset: Path, *, eval_dataset: Path | None = None, **trainer: Any) -> Path:
    raw: dict[str, Any] = {
        "model": {"path": NO_MODEL},
        "checkpoint": {"dir": str(tmp / "ckpt")},
        "trainer": {"steps": 1, "dataset": {"path": str(dataset)}, "reward": "builtin:math", **trainer},
    }
    if eval_dataset is not None:
        raw["trainer"]["eval"] = {"dataset": {"path": str(eval_dataset)}}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def cli(trainer_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # `train` sets it if unset: keep the process as it was

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()  # what writing the fixtures printed is not the command's
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _parquet(path: Path, **columns: list[Any]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _saved(path: Path, **columns: list[Any]) -> Path:
    import datasets

    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return path


# (file name, what writes it, the text the one line holds besides the path)
BROKEN: dict[str, tuple[str, Callable[[Path], Path], str]] = {
    "absent-prompt": ("a.jsonl", lambda p: jsonl(p, GOOD, GOOD, {"answer": "1"}), "line 3: no prompt"),
    "null-prompt": ("a.jsonl", lambda p: jsonl(p, GOOD, {"prompt": None, "answer": "1"}), "line 2: no prompt"),
    "int-prompt": ("a.jsonl", lambda p: jsonl(p, {"prompt": 7, "answer": "1"}), "line 1: prompt 'prompt' is an int"),
    "dict-prompt": ("a.jsonl", lambda p: jsonl(p, GOOD, {"prompt": {"q": 1}, "answer": "1"}), "line 2: prompt"),
    "list-of-strings": ("a.jsonl", lambda p: jsonl(p, {"prompt": ["hi"], "answer": "1"}), "line 1: prompt"),
    "bytes-prompt": ("a.parquet", lambda p: _parquet(p, prompt=[b"hi"], answer=["1"]), "row index 0: prompt"),
    "role-root": (
        "a.jsonl",
        lambda p: jsonl(p, GOOD, {"prompt": [{"role": "root", "content": "x"}], "answer": "1"}),
        "line 2: prompt 'prompt' message 0 has role 'root'",
    ),
    "no-answer": ("a.jsonl", lambda p: jsonl(p, GOOD, GOOD, GOOD, {"prompt": "x"}), "line 4: no answer"),
    "list-answer": (
        "a.jsonl",
        lambda p: jsonl(p, GOOD, {"prompt": "x", "answer": ["4"]}),
        "line 2: answer 'answer' is a list",
    ),
    "empty": ("a.jsonl", lambda p: (p.write_bytes(b""), p)[1], "the file is empty (0 bytes)"),
    "blank-lines": ("a.jsonl", lambda p: (p.write_text("\n  \n\n"), p)[1], "holds only blank lines"),
    "not-json": ("a.jsonl", lambda p: jsonl(p, GOOD, "{'prompt': 'x'}"), "line 2 is not JSON"),
    "not-utf8": (
        "a.jsonl",
        lambda p: (p.write_bytes(json.dumps(GOOD).encode() + b'\n{"prompt": "\xff"}\n'), p)[1],
        "line 2 is not UTF-8",
    ),
    "nested-100000": (
        "a.jsonl",
        lambda p: jsonl(p, GOOD, '{"prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        f"line 2 nests deeper than {MAX_DEPTH} levels",
    ),
    "unclosed-100000": (  # invalid JSON too deep for Python's own parser: still the depth line
        "a.jsonl",
        lambda p: jsonl(p, GOOD, '{"prompt": ' + "[" * 100_000),
        f"line 2 nests deeper than {MAX_DEPTH} levels",
    ),
    "quotes-after-brackets": (  # a line whose string never ends: scanned once (a rescan per quote would hang)
        "a.jsonl",
        lambda p: jsonl(p, GOOD, '{"prompt": ' + "[" * 70 + '"' + '\\"' * 500_000),
        f"line 2 nests deeper than {MAX_DEPTH} levels",
    ),
    "csv-empty-prompt": ("a.csv", lambda p: (p.write_text("prompt,answer\nhi,1\n,2\n"), p)[1], "row index 1"),
    "csv-not-utf8": ("a.csv", lambda p: (p.write_bytes(b"prompt,answer\nhi,1\n\xff,2\n"), p)[1], "line 3 is not UTF-8"),
    "saved-dir-role": (
        "saved",
        lambda p: _saved(p, prompt=[[{"role": "tool", "content": "x"}]], answer=["1"]),
        "row index 0",
    ),
    "json-list": ("a.json", lambda p: (p.write_text(json.dumps([GOOD, {"answer": "1"}])), p)[1], "row index 1"),
    "parquet-int-prompt": ("a.parquet", lambda p: _parquet(p, prompt=[7, 8], answer=["1", "2"]), "row index 0: prompt"),
    "parquet-struct-prompt": (
        "a.parquet",
        lambda p: _parquet(p, prompt=[{"q": "x"}, {"q": "y"}], answer=["1", "2"]),
        "row index 0: prompt 'prompt' is an object",
    ),
    "parquet-role-root": (
        "a.parquet",
        lambda p: _parquet(
            p, prompt=[[{"role": "user", "content": "x"}], [{"role": "root", "content": "x"}]], answer=["1", "2"]
        ),
        "row index 1: prompt 'prompt' message 0 has role 'root'",
    ),
    "json-list-nested-100000": (  # a JSON list is read item by item: the deep item never reaches pyarrow
        "a.json",
        lambda p: (
            p.write_text(
                '[{"prompt": "x", "answer": "1"}, {"prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}]"
            ),
            p,
        )[1],
        f"row index 1 nests deeper than {MAX_DEPTH} levels",
    ),
    "parquet-null-answer": (
        "a.parquet",
        lambda p: _parquet(p, prompt=["a", "b", "c"], answer=["1", None, "3"]),
        "row index 1: no answer",
    ),
}


@pytest.mark.parametrize("command", ["check", "train"])
@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_dataset_is_one_line_and_exit_2_before_the_model(
    tmp_path: Path, cli: Any, command: str, case: str
) -> None:
    name, make, phrase = BROKEN[case]
    data = make(tmp_path / name)
    code, out, err = cli(command, str(write_config(tmp_path, data)))
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"trainer.dataset {data}: " in lines[0] and phrase in lines[0] and "fix: " in lines[0], lines[0]
    assert NO_MODEL not in err and "tokenizer" not in err and "model: " not in out  # never reached the model


@pytest.mark.parametrize("command", ["check", "train"])
def test_the_eval_dataset_is_checked_the_same_way(tmp_path: Path, cli: Any, command: str) -> None:
    good, bad = jsonl(tmp_path / "train.jsonl", GOOD), jsonl(tmp_path / "eval.jsonl", GOOD, {"prompt": "x"})
    code, _, err = cli(command, str(write_config(tmp_path, good, eval_dataset=bad)))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"trainer.eval.dataset {bad}: line 2: no answer" in err and "trainer.eval.dataset.answerField" in err


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_prompt_that_cannot_fit_max_episode_tokens_is_refused_by_its_bytes(
    tmp_path: Path, cli: Any, command: str
) -> None:
    """Judged by bytes before any tokenizer loads: 8 a token of maxEpisodeTokens (16 here)."""
    data = jsonl(tmp_path / "a.jsonl", GOOD, {"prompt": "y" * 129, "answer": "1"}, {"prompt": "y" * 128, "answer": "1"})
    code, out, err = cli(command, str(write_config(tmp_path, data, maxEpisodeTokens=16, maxNewTokens=8)))
    assert code == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert err == (
        f"treetrain {command}{': error' if command == 'train' else ''}: trainer.dataset {data}: line 2: prompt "
        "'prompt' has 129 bytes, more than trainer.maxEpisodeTokens (16) x 8 = 128; fix: shorten or drop the row, "
        "or raise trainer.maxEpisodeTokens\n"
    )
    assert NO_MODEL not in err and "tokenizer" not in err


def test_many_bad_rows_name_the_first_and_count_the_rest(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "a.jsonl", GOOD, {"prompt": 1}, GOOD, {"prompt": 2}, {"prompt": 3})
    with pytest.raises(DatasetError, match=r"line 2: .* \(and 2 more bad rows\)$"):
        load_rows(DatasetSettings(path=str(data)), answer_for=None)


def test_a_missing_column_names_the_columns_there(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "a.jsonl", {"question": "q", "answer": "1"})
    with pytest.raises(DatasetError, match="no column 'prompt'; its columns are question, answer"):
        load_rows(DatasetSettings(path=str(data)))


# -- what is not a problem ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reward", "args", "needed"),
    [
        ("builtin:math", {}, True),
        ("builtin:exact", {}, True),
        ("builtin:regex", {"pattern": r"(?P<answer>\d+)"}, True),
        ("builtin:regex", {"pattern": r"\d+"}, False),  # matching alone scores: no answer read
        ("my_rewards:score", {}, False),  # a user reward gets the whole row
        (None, {}, False),  # an agent run without a reward
    ],
)
def test_which_rewards_need_an_answer(reward: str | None, args: dict[str, Any], needed: bool) -> None:
    assert reads_answer(reward, args) is needed


def test_rows_without_answers_load_when_nothing_reads_them(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "a.jsonl", {"prompt": "x"}, {"prompt": "y", "answer": {"any": "shape"}})
    assert len(load_rows(DatasetSettings(path=str(data)), answer_for=None)) == 2


def test_string_and_message_prompts_mix_and_numbers_are_answers(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"}]
    data = jsonl(tmp_path / "a.jsonl", {"prompt": "1 + 1?", "answer": 2}, {"prompt": chat, "answer": "4"})
    rows = load_rows(DatasetSettings(path=str(data)), answer_for="builtin:math")
    assert [r["prompt"] for r in rows] == ["1 + 1?", chat]


def test_a_blank_line_datasets_cannot_read_is_named(tmp_path: Path) -> None:
    """datasets skips blank lines, except in a file whose column types change between rows."""
    data = jsonl(tmp_path / "a.jsonl", GOOD, "", {"prompt": "x", "answer": 5})
    with pytest.raises(DatasetError, match=r"line 2 is blank, .* fix: remove the blank lines$") as info:
        load_rows(DatasetSettings(path=str(data)))
    assert "\n" not in str(info.value)
    assert len(load_rows(DatasetSettings(path=str(jsonl(tmp_path / "b.jsonl", GOOD, "", GOOD))))) == 2


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert not too_deep(json.dumps({"prompt": "[" * 500 + '{"\\"'}).encode(), MAX_DEPTH)
    assert not too_deep(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode(), MAX_DEPTH)
    assert too_deep(("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode(), MAX_DEPTH)
    assert too_deep(("{}" * 100 + '{"a": [{"b": ' * 40 + "1" + "}]" * 40 + "}").encode(), MAX_DEPTH)
    # Unbalanced (invalid JSON): the brackets left open count as levels.
    assert too_deep(b"[" * 100, MAX_DEPTH) and not too_deep(b"]" * 100 + b"[[", MAX_DEPTH)


def test_a_row_that_breaks_mid_run_names_its_index() -> None:
    class Tokenizer:
        eos_token_id = 0

        def __len__(self) -> int:
            return 8

        def get_vocab(self) -> dict[str, int]:
            return {}

    from treetrain.config.trainer_settings import TrainerSettings
    from treetrain.rl.rewards import RewardRunner, load_reward

    t = TrainerSettings(dataset=DatasetSettings(path="rows.jsonl", shuffle=False), reward="builtin:exact")
    runner = RewardRunner(load_reward("builtin:exact", {}), timeout_s=5, answer_field="answer", log=print)
    task = DatasetTask([GOOD, {"prompt": 5}], t, Tokenizer(), runner, DataCursor(2, 1, shuffle=False, seed=0))
    with pytest.raises(DatasetError, match=r"^trainer.dataset rows.jsonl: row index 1: prompt 'prompt' is an int"):
        task.episode_at(1, 0, seed=0)


def test_train_maps_a_dataset_error_raised_at_any_step_to_exit_2(
    cli: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import treetrain.trainer.run as run

    def fail(*_: Any, **__: Any) -> Any:
        raise DatasetError("trainer.dataset rows.jsonl: row index 7: no prompt; fix: give every row a prompt")

    monkeypatch.setattr(run, "run_training", fail)
    code, _, err = cli("train", str(write_config(tmp_path, jsonl(tmp_path / "a.jsonl", GOOD))))
    assert (
        code == 2
        and err
        == "treetrain train: error: trainer.dataset rows.jsonl: row index 7: no prompt; fix: give every row a prompt\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "phrase"),
    [
        ('{"version": 1, "next_step": -3, "next_row": 0}', "checkpoint data.json is not a version-1 data cursor"),
        ("{not json", "data.json cannot be read"),
    ],
)
def test_a_resumed_run_whose_data_position_is_damaged_is_one_line(
    tmp_path: Path, cli: Any, damage: str, phrase: str
) -> None:
    """A real run writes a checkpoint; its data.json is then damaged: the resumed run stops with
    one line and exit 2, no traceback. A tiny random model with SmolLM2's tokenizer keeps it short."""
    from helpers import save_hf_model

    from treetrain.engines.builtin import load_tokenizer

    model = save_hf_model(
        tmp_path / "model",
        "llama",
        seed=0,
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    load_tokenizer("builtin:smollm2-135m").save_pretrained(model)
    data = jsonl(tmp_path / "a.jsonl", GOOD, {"prompt": "What is 3 + 3?", "answer": "6"}, GOOD)
    config = write_config(
        tmp_path, data, groupsPerStep=1, groupSize=2, maxNewTokens=2, metrics={"enabled": False}, threads=1
    )
    raw = yaml.safe_load(config.read_text())
    raw["model"] = {"path": str(model), "seed": 0}
    config.write_text(yaml.safe_dump(raw))
    code, out, err = cli("train", str(config))
    assert code == 0, (out, err)
    (tmp_path / "ckpt" / "step-00000001" / "data.json").write_text(damage)
    code, out, err = cli("train", str(config), "--resume", "--steps", "2")
    # transformers draws a progress bar on stderr as it loads the weights (reported, not this test's)
    lines = [line for line in err.strip().splitlines() if not line.startswith(("Loading weights", "\rLoading"))]
    assert code == 2 and len(lines) == 1 and phrase in lines[0], (out, err)
    assert lines[0].startswith("treetrain train: error: ") and "Traceback" not in out + err
