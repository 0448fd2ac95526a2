"""Rewards of dataset rows (treetrain.rl.rewards): the built-ins, user rewards by import string,
and the runner that keeps a raising or hanging reward from stopping (or stalling) a step. The
runners share one pool of worker processes (treetrain.rl.rewards_pool), closed at the end."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treetrain.rl.rewards import RewardError, RewardRunner, final_answer, load_reward
from treetrain.rl.rewards_pool import RewardPool

POOL = RewardPool(max_workers=2)


@pytest.fixture(scope="module", autouse=True)
def _pool() -> Iterator[None]:
    yield
    POOL.close()


def runner(fn: Any, timeout_s: float = 30.0, **kwargs: Any) -> tuple[RewardRunner, list[str]]:
    lines: list[str] = []
    kwargs.setdefault("pool", POOL)
    return RewardRunner(fn, timeout_s=timeout_s, answer_field="answer", log=lines.append, **kwargs), lines


@pytest.fixture(scope="module")
def math_runner() -> RewardRunner:
    return runner(load_reward("builtin:math", {}))[0]


def test_the_gsm8k_mark_ends_the_answer() -> None:
    assert final_answer("6 * 7 = 42.\n#### 42") == "42"
    assert final_answer("a #### 1 #### 2 ") == "2"
    assert final_answer(" 42 ") == "42"


@pytest.mark.parametrize(
    ("completion", "answer", "want"),
    [
        (r"So the total is \boxed{42}.", "42", 1.0),
        ("The answer is 42", "He has 6 * 7 = 42.\n#### 42", 1.0),
        ("6 * 7 = 42 apples.\n#### 42", "#### 42", 1.0),
        ("3 + 4 = 7, then #### 42", "42", 1.0),
        (r"The answer is $\frac{3}{4}$", "0.75", 1.0),
        ("1/2", r"\frac{1}{2}", 1.0),
        (r"\boxed{2^{10}}", "1024", 1.0),
        ("The answer is 41", "42", 0.0),
        ("I think 42 apples, so 12 in total", "42", 0.0),
        ("no number at all", "42", 0.0),
    ],
)
def test_math_compares_final_answers_as_mathematics(
    math_runner: RewardRunner, completion: str, answer: str, want: float
) -> None:
    assert math_runner.score(completion, {"answer": answer}, "t") == want


@pytest.mark.parametrize(
    "bomb", [r"\boxed{9^{9^{9^{9}}}}", "9**9**9**9", r"\boxed{1000000000!}", r"\boxed{10^{-100000000}}"]
)
def test_a_parse_bomb_scores_zero_within_the_timeout(math_runner: RewardRunner, bomb: str) -> None:
    # Computing 9^(9^9) in C holds the GIL for hours: the bounds refuse it before it starts.
    start = time.monotonic()
    assert math_runner.score(bomb, {"answer": "42"}, "t") == 0.0
    assert time.monotonic() - start < math_runner.timeout_s


def test_math_counts_a_row_without_an_answer_as_an_error() -> None:
    run, lines = runner(load_reward("builtin:math", {}))
    assert run.score("42", {"question": "q"}, "step 1 group 0 row 3") == 0.0
    assert run.failures == {"error": 1, "timeout": 0}
    assert len(lines) == 1 and "step 1 group 0 row 3" in lines[0] and "answerField" in lines[0]


def test_the_runner_reads_the_configured_answer_field() -> None:
    run = RewardRunner(load_reward("builtin:exact", {}), timeout_s=5, answer_field="solution", log=print, pool=POOL)
    assert run.score(" 7 ", {"solution": "#### 7", "answer": "8"}, "t") == 1.0


def test_exact_is_stripped_string_equality() -> None:
    run, _ = runner(load_reward("builtin:exact", {}))
    assert run.score("  42\n", {"answer": "#### 42"}, "t") == 1.0
    assert run.score("42.0", {"answer": "42"}, "t") == 0.0
    assert run.score("work... #### 42", {"answer": 42}, "t") == 1.0  # a number column (CSV, JSON)


def test_regex_matches_and_compares_its_answer_group() -> None:
    plain, _ = runner(load_reward("builtin:regex", {"pattern": r"<answer>.*</answer>"}))
    assert plain.score("x <answer>no</answer>", {}, "t") == 1.0
    assert plain.score("x", {}, "t") == 0.0
    named, _ = runner(load_reward("builtin:regex", {"pattern": r"ANSWER: (?P<answer>\S+)"}))
    assert named.score("so ANSWER: 42", {"answer": "#### 42"}, "t") == 1.0
    assert named.score("so ANSWER: 41", {"answer": "42"}, "t") == 0.0


@pytest.mark.parametrize(
    ("spec", "args", "phrase"),
    [
        ("builtin:regex", {}, "needs trainer.rewardArgs.pattern"),
        ("builtin:regex", {"pattern": "("}, "is not a valid regular expression"),
        ("builtin:math", {"tolerance": 1}, "builtin:math takes no rewardArgs tolerance"),
        ("builtin:chess", {}, "unknown built-in reward 'builtin:chess'"),
        ("justaname", {}, "must be builtin:NAME or package.module:function"),
        ("no_such_reward_module_xyz:score", {}, "cannot import reward module 'no_such_reward_module_xyz'"),
    ],
)
def test_a_reward_that_cannot_load_is_one_line(spec: str, args: dict[str, Any], phrase: str) -> None:
    with pytest.raises(RewardError, match=phrase) as info:
        load_reward(spec, args)
    assert "\n" not in str(info.value)


USER_MODULE = """
import os, sys, time

def score(completion, row, bonus=0.0):
    return float(completion == row["answer"]) + bonus

def where(completion, row):
    # The worker process: not the caller's, and without torch.
    return float(os.getpid()) if "torch" not in sys.modules else -1.0

def boom(completion, row):
    if completion == "boom":
        raise ZeroDivisionError("no")
    return 1.0

def hang(completion, row):
    if completion == "hang":
        time.sleep(120)
    return 1.0

async def later(completion, row):
    return 0.25

def crash(completion, row):
    if completion == "crash":
        os._exit(3)
    return 1.0

def weird(completion, row):
    return {"nan": float("nan"), "text": "yes", "inf": math.inf}[completion]

import math
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module(name)
    yield name, module


def test_an_import_string_gets_the_row_and_reward_args(user_module: Any) -> None:
    name, _ = user_module
    run, _ = runner(load_reward(f"{name}:score", {"bonus": 0.5}))
    assert run.score("42", {"answer": "42"}, "t") == 1.5
    import os

    pid = runner(load_reward(f"{name}:where", {}))[0].score("", {}, "t")
    assert pid > 0 and pid != os.getpid()  # run in a worker process, which never imports torch
    assert runner(load_reward(f"{name}:later", {}))[0].score("x", {}, "t") == 0.25  # async def works too
    with pytest.raises(RewardError, match=f"reward module '{name}' has no callable 'missing'"):
        load_reward(f"{name}:missing", {})


def test_a_raising_reward_scores_zero_is_counted_and_the_next_call_is_fine(user_module: Any) -> None:
    name, _ = user_module
    run, lines = runner(load_reward(f"{name}:boom", {}))
    assert run.score("boom", {}, "step 3 group 1 row 7") == 0.0
    assert run.failures == {"error": 1, "timeout": 0}
    assert lines == ["reward error at step 3 group 1 row 7: ZeroDivisionError: no; scored 0.0"]
    assert run.score("fine", {}, "t") == 1.0 and run.failures["error"] == 1


@pytest.mark.parametrize("value", ["nan", "text", "inf"])
def test_a_result_that_is_not_a_finite_number_is_an_error(user_module: Any, value: str) -> None:
    name, _ = user_module
    run, lines = runner(load_reward(f"{name}:weird", {}))
    assert run.score(value, {}, "t") == 0.0
    assert run.failures["error"] == 1 and "not a finite number" in lines[0]


def test_a_hanging_reward_times_out_and_does_not_block_the_next(user_module: Any) -> None:
    name, _ = user_module
    run, lines = runner(load_reward(f"{name}:hang", {}), timeout_s=0.3)
    start = time.monotonic()
    assert run.score("hang", {}, "step 1 group 0 row 0") == 0.0
    assert time.monotonic() - start < 10
    assert run.failures == {"error": 0, "timeout": 1}
    assert "reward timeout at step 1 group 0 row 0" in lines[0] and "rewardTimeoutSeconds" in lines[0]
    assert run.score("fine", {}, "t") == 1.0


def test_a_worker_that_dies_is_an_error_and_the_next_call_gets_a_fresh_one(user_module: Any) -> None:
    name, _ = user_module
    run, lines = runner(load_reward(f"{name}:crash", {}))
    assert run.score("crash", {}, "step 1 group 0 row 2") == 0.0
    assert run.failures == {"error": 1, "timeout": 0}
    assert lines == [
        "reward error at step 1 group 0 row 2: the reward's worker process ended during the call (a crash, or "
        "os._exit); scored 0.0"
    ]
    assert run.score("fine", {}, "t") == 1.0


def test_a_row_that_cannot_reach_the_worker_is_an_error(user_module: Any) -> None:
    name, _ = user_module
    run, lines = runner(load_reward(f"{name}:boom", {}))
    assert run.score("x", {"answer": lambda: 1}, "row 4") == 0.0
    assert "reward error at row 4: the row cannot be sent to the reward's worker process" in lines[0]
    assert run.score("x", {}, "t") == 1.0


def test_a_worker_server_that_dies_is_started_again(user_module: Any) -> None:
    name, _ = user_module
    pool = RewardPool(max_workers=1)
    try:
        run, lines = runner(load_reward(f"{name}:score", {}), pool=pool)
        assert run.score("1", {"answer": "1"}, "a") == 1.0
        server = pool._servers[-1].proc
        server.kill()  # as the kernel's OOM killer would; its worker dies with it
        server.wait(30)
        assert run.score("1", {"answer": "1"}, "b") == 1.0 and lines == []
        assert pool._servers[-1].proc is not server
    finally:
        pool.close()


def test_calls_past_the_workers_wait_for_a_free_one(user_module: Any) -> None:
    name, _ = user_module
    one = RewardPool(max_workers=1)
    try:
        run, _ = runner(load_reward(f"{name}:hang", {}), timeout_s=0.5, pool=one)
        out: list[float] = []
        hung = threading.Thread(target=lambda: out.append(run.score("hang", {}, "a")))
        hung.start()
        # Waits for the one worker: it is killed at the hung call's timeout, and the call runs.
        assert run.score("fine", {}, "b") == 1.0
        hung.join(60)
        assert out == [0.0] and run.failures == {"error": 0, "timeout": 1}
    finally:
        one.close()


def test_scores_from_many_threads_are_counted_once_each(user_module: Any) -> None:
    name, _ = user_module
    run, _ = runner(load_reward(f"{name}:boom", {}))
    out: list[float] = []
    threads = [threading.Thread(target=lambda: out.append(run.score("boom", {}, "t"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == [0.0] * 8 and run.failures["error"] == 8 and not math.isnan(sum(out))
