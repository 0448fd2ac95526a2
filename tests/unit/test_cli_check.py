"""`treetrain check [CONFIG]`: the config, the dataset rows and the code a config names, checked
without the model (model.path here is a directory that does not exist); exit 0 with a summary,
or 2 with one line per problem. The dataset cases are in test_dataset_errors.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from treetrain.cli import build_parser, main

NO_MODEL = "/nonexistent/treetrain-model"


@pytest.fixture
def check(trainer_env: None, capsys: pytest.CaptureFixture[str]) -> Any:
    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["check", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def code_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for the modules a test's config names (names unique to this file)."""
    directory = tmp_path / "code"
    directory.mkdir()
    (directory / "check_user_code.py").write_text(
        "async def agent(client, row):\n    return 1.0\n"
        "def not_async(client, row):\n    return 1.0\n"
        "def score(completion, row):\n    return 1.0\n"
        "def make_task(**kwargs):\n    raise AssertionError('check must not build the task')\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(directory))
    return directory


def write(tmp: Path, trainer: dict[str, Any], model: str = NO_MODEL) -> str:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": model}, "trainer": {"steps": 1, **trainer}}))
    return str(path)


def rows(tmp: Path, name: str = "rows.jsonl", n: int = 3) -> str:
    path = tmp / name
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return str(path)


def test_check_flags_frozen() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    options = sorted(o for a in sub.choices["check"]._actions for o in a.option_strings)  # type: ignore[attr-defined]
    assert options == sorted(["-h", "--help"])


def test_a_good_dataset_config_passes_with_a_summary(tmp_path: Path, check: Any) -> None:
    trainer = {
        "dataset": {"path": rows(tmp_path, n=3)},
        "reward": "builtin:math",
        "eval": {"dataset": {"path": rows(tmp_path, "eval.jsonl", n=2)}},
    }
    code, out, err = check(write(tmp_path, trainer))
    assert (code, err) == (0, "")
    assert "ok (the model was not loaded)" in out
    assert "rows.jsonl: 3 rows, columns prompt, answer" in out and "eval.jsonl: 2 rows" in out
    assert "reward: builtin:math (compares replies with each row's answer)" in out


def test_an_agent_and_a_user_reward_load_and_rows_need_no_answer(tmp_path: Path, check: Any, code_dir: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi"}\n{"prompt": "yo", "answer": null}\n')
    trainer = {"dataset": {"path": str(data)}, "agent": "check_user_code:agent", "reward": "check_user_code:score"}
    code, out, err = check(write(tmp_path, trainer))
    assert (code, err) == (0, "")
    assert "agent: check_user_code:agent" in out and "reward: check_user_code:score (gets the whole row)" in out


def test_an_agent_run_the_proxy_cannot_hold_is_one_line(tmp_path: Path, check: Any, code_dir: Path) -> None:
    trainer = {
        "dataset": {"path": rows(tmp_path)},
        "agent": "check_user_code:agent",
        "groupsPerStep": 4,
        "groupSize": 4,
        "proxy": {"maxSessions": 8},
    }
    code, _, err = check(write(tmp_path, trainer))
    assert code == 2 and len(err.splitlines()) == 1 and "trainer.proxy.maxSessions (8)" in err, err


def test_the_embedded_default_passes(check: Any) -> None:
    code, out, _ = check()
    assert code == 0 and "the embedded default: ok" in out and "task: builtin:arithmetic" in out


def test_config_problems_are_one_line_each(tmp_path: Path, check: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"steps": 0, "groupSize": "many"}}))
    code, out, err = check(str(path))
    assert code == 2 and out == "", err
    assert err.splitlines() == [
        "treetrain check: model: required",
        "treetrain check: trainer.steps: input should be greater than or equal to 1, got 0",
        "treetrain check: trainer.groupSize: input should be a valid integer, got 'many'",
    ]


@pytest.mark.parametrize(
    ("trainer", "phrase"),
    [
        ({"task": "check_missing_module:make"}, "trainer.task: cannot import task module 'check_missing_module'"),
        ({"task": "check_user_code:NOT_CALLABLE"}, "has no callable 'NOT_CALLABLE'"),
        ({"agent": "check_user_code:not_async"}, "trainer.agent 'check_user_code:not_async' is not an async def"),
        ({"agent": "check_missing_module:run"}, "cannot import agent module 'check_missing_module'"),
        ({"reward": "check_missing_module:score"}, "trainer.reward: cannot import reward module"),
        ({"reward": "check_user_code:NOT_CALLABLE"}, "has no callable 'NOT_CALLABLE'"),
    ],
    ids=["task-missing", "task-not-callable", "agent-not-async", "agent-missing", "reward-missing", "reward-value"],
)
def test_code_that_does_not_load_is_one_line(
    tmp_path: Path, check: Any, code_dir: Path, trainer: dict[str, Any], phrase: str
) -> None:
    if "task" not in trainer:
        trainer = {"dataset": {"path": rows(tmp_path)}, **trainer}
    code, out, err = check(write(tmp_path, trainer))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and phrase in lines[0], err


def test_a_user_task_is_imported_not_built(tmp_path: Path, check: Any, code_dir: Path) -> None:
    code, out, err = check(write(tmp_path, {"task": "check_user_code:make_task"}))
    assert (code, err) == (0, "") and "task: check_user_code:make_task (imported" in out


def test_every_problem_is_reported_at_once(tmp_path: Path, check: Any) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": 5, "answer": "2"}\n')
    trainer = {"dataset": {"path": str(bad)}, "reward": "check_missing_module:score"}
    code, _, err = check(write(tmp_path, trainer))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert "trainer.reward: cannot import reward module" in lines[0]
    assert f"trainer.dataset {bad}: line 2: prompt 'prompt' is an int" in lines[1]


def test_the_documented_summary_is_what_check_prints(check: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "trainer.md").read_text().splitlines()
    start = doc.index("$ .venv/bin/treetrain check examples/trainer-gsm8k.yaml")
    shown = doc[start + 1 : doc.index("$ .venv/bin/treetrain check broken.yaml")]
    monkeypatch.chdir(root)  # the example's dataset paths are relative to the repository root
    code, out, err = check("examples/trainer-gsm8k.yaml")
    assert (code, err) == (0, "") and out.splitlines() == shown
