"""Reward calls a timeout can stop (treetrain.rl.rewards_pool): a reward stuck in one C call that
holds its interpreter's lock (sympy computing 9^(9^9)) scored 0 only when the trainer was killed;
now it costs its timeout, its worker is killed (no core left spinning), later calls are scored,
SIGTERM ends the trainer within seconds, and no worker process outlives the trainer.

The scoring runs in a child interpreter with a deadline: were a reward to hold the test's own
interpreter again, the test would fail at the deadline instead of hanging the suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from suite_helpers import subprocess_env

from treetrain.metrics import TrainerMetrics
from treetrain.rl.rewards import RewardRunner, load_reward
from treetrain.rl.rewards_pool import RewardPool, RewardStopped

# A reward that computes 9^(9^9) (hours, in one C call holding the GIL), noting its pid first.
STUCK = """
import os, pathlib, sys

def stuck(completion, row):
    if completion != "stuck":
        return 1.0
    pathlib.Path(row["mark"]).write_text(str(os.getpid()))
    return float(9 ** 9 ** 9 % 7)

def math_or_stuck(completion, row):
    if row.get("stuck"):
        return stuck("stuck", row)
    from treetrain.rl.rewards import math_reward
    return math_reward(completion, row["answer"])
"""

# Scores (completion, row) pairs in a child process and prints what happened as JSON.
CHILD = """
import json, os, sys, time
from treetrain.rl.rewards import RewardRunner, load_reward
lines = []
run = RewardRunner(load_reward(SPEC, {}), timeout_s=TIMEOUT, answer_field="answer", log=lines.append)
out = []
for completion, row in CALLS:
    began = time.monotonic()
    out.append([run.score(completion, row, "row"), time.monotonic() - began])
    if os.path.exists(MARK):  # the stuck call's worker: killed, not left spinning
        pid, gone = int(open(MARK).read()), time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z":
            if time.monotonic() > gone:
                out[-1].append("still running")
                break
            time.sleep(0.02)  # polling a condition, with a deadline
        os.remove(MARK)
print(json.dumps({"scores": out, "failures": run.failures, "lines": lines}))
run.close()
"""


def _user_module(tmp: Path) -> None:
    (tmp / "stuck_reward.py").write_text(STUCK)


def _child_env(tmp: Path) -> dict[str, str]:
    env = subprocess_env(outside_a_pod=True)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    return env


def _score_in_child(tmp: Path, spec: str, timeout_s: float, calls: list[Any]) -> dict[str, Any]:
    _user_module(tmp)
    mark = str(tmp / "stuck.pid")
    calls = [(c, {**r, "mark": mark}) for c, r in calls]
    code = f"SPEC, TIMEOUT, CALLS, MARK = {spec!r}, {timeout_s!r}, {calls!r}, {mark!r}\n" + CHILD
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=_child_env(tmp), cwd=tmp, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"scoring still running after 120 s (a reward holds the caller): {err.stdout!r} {err.stderr!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_row_whose_answer_is_9_to_9_to_9_scores_zero_at_once_and_the_run_goes_on(tmp_path: Path) -> None:
    calls = [("1", {"answer": "1"}), ("42", {"answer": "$9^{9^{9}}$"}), (r"\boxed{42}", {"answer": "42"})]
    got = _score_in_child(tmp_path, "builtin:math", 5.0, calls)  # the first call starts the workers
    _, (bad, took), (good, _) = got["scores"]
    assert (bad, good) == (0.0, 1.0) and took < 5.0 + 1.0
    assert got["failures"] == {"error": 1, "timeout": 0}
    assert (
        "reward error at row: RewardError: builtin:math: the row's answer '$9^{9^{9}}$' is too large" in got["lines"][0]
    )


def test_a_reward_stuck_in_c_is_killed_at_its_timeout_and_the_next_call_is_scored(tmp_path: Path) -> None:
    calls: list[Any] = [("warm", {}), ("stuck", {}), ("fine", {}), ("stuck", {}), ("ok", {})]
    got = _score_in_child(tmp_path, "stuck_reward:stuck", 2.0, calls)  # "warm" starts the workers
    scores = [s[0] for s in got["scores"]]
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0], got
    for stuck in (got["scores"][1], got["scores"][3]):
        assert stuck[1] < 2.0 + 1.0 and "still running" not in stuck, got  # the timeout plus a second; killed
    assert got["scores"][2][1] < 2.0, got  # a fresh worker at once
    assert got["failures"] == {"error": 0, "timeout": 2}
    assert "took longer than trainer.rewardTimeoutSeconds (2s); its worker process was killed" in got["lines"][0]


def test_the_timeouts_reach_the_metric(tmp_path: Path) -> None:
    _user_module(tmp_path)
    sys.path.insert(0, str(tmp_path))
    pool = RewardPool(max_workers=1)
    try:
        run = RewardRunner(
            load_reward("stuck_reward:stuck", {}), timeout_s=0.5, answer_field="answer", log=print, pool=pool
        )
        assert run.score("stuck", {"mark": str(tmp_path / "pid")}, "a") == 0.0
        metrics = TrainerMetrics()
        metrics.observe_agents(None, run.failures)  # what the trainer does after each step
        assert metrics.registry.get_sample_value("treetrain_reward_failures_total", {"reason": "timeout"}) == 1
    finally:
        pool.close()
        sys.path.remove(str(tmp_path))


def test_stop_ends_a_stuck_call_within_the_grace(tmp_path: Path) -> None:
    _user_module(tmp_path)
    sys.path.insert(0, str(tmp_path))
    pool = RewardPool(max_workers=1)
    mark = tmp_path / "pid"
    try:
        run = RewardRunner(
            load_reward("stuck_reward:stuck", {}), timeout_s=300, answer_field="answer", log=print, pool=pool
        )
        assert run.score("warm", {}, "a") == 1.0
        pool.stop(grace_s=0.5)  # SIGTERM's handler, in effect before the call
        began = time.monotonic()
        with pytest.raises(RewardStopped, match="SIGTERM"):
            run.score("stuck", {"mark": str(mark)}, "b")
        assert time.monotonic() - began < 0.5 + 5
    finally:
        pool.close()
        sys.path.remove(str(tmp_path))


def _gone(pids: list[int], deadline_s: float) -> list[int]:
    """The pids still running (not exited, not a zombie) after up to ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.05)  # polling a condition, with a deadline


# A "trainer" whose reward hangs in C: it prints the worker's and the server's pids, then ends
# as told: close() and exit, exit without close(), or SIGKILL.
ORPHAN = """
import os, pathlib, signal, sys, threading, time
from treetrain.rl.rewards import RewardRunner, load_reward
run = RewardRunner(load_reward("stuck_reward:stuck", {}), timeout_s=300, answer_field="answer", log=len)
threading.Thread(target=run.score, args=("stuck", {"mark": MARK}, "row"), daemon=True).start()
end = time.monotonic() + 60
while not os.path.exists(MARK) or not open(MARK).read():
    assert time.monotonic() < end, "the reward never started"
    time.sleep(0.02)
worker = int(open(MARK).read())
server = int(open(f"/proc/{worker}/stat").read().split(")")[1].split()[1])  # the worker's parent
print(worker, server, flush=True)
if HOW == "close":
    run.close()
elif HOW == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["close", "exit", "sigkill"])
def test_no_worker_outlives_the_trainer(tmp_path: Path, how: str) -> None:
    _user_module(tmp_path)
    code = f"MARK, HOW = {str(tmp_path / 'pid')!r}, {how!r}\n" + ORPHAN
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_child_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (-signal.SIGKILL if how == "sigkill" else 0), done.stderr[-3000:]
    worker, server = (int(p) for p in done.stdout.splitlines()[0].split())
    assert server not in (worker, os.getpid(), 1)
    assert _gone([worker, server], 10) == []


# -- the trainer ------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_during_a_stuck_reward_ends_the_trainer_within_10_s(tmp_path: Path) -> None:
    """Step 1 scores a row whose answer is 9^(9^9) (0, counted, the run goes on); step 2's
    reward hangs in C. SIGTERM: exit 143 within 10 s, no worker left. (No checkpoint.dir: a
    save of step 1 would add its own seconds, and is tested elsewhere.)"""
    _user_module(tmp_path)
    mark = tmp_path / "stuck.pid"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": "What is 9 to the power 9 to the power 9?", "answer": "$9^{9^{9}}$"})
        + "\n"
        + json.dumps({"prompt": "What is 2 + 2?", "answer": "4", "stuck": True, "mark": str(mark)})
        + "\n"
    )
    raw = {
        "model": {"path": "builtin:smollm2-135m"},
        "trainer": {
            "steps": 2,
            "dataset": {"path": str(rows), "shuffle": False},
            "reward": "stuck_reward:math_or_stuck",
            "rewardTimeoutSeconds": 300,
            "groupsPerStep": 1,
            "groupSize": 2,
            "maxNewTokens": 4,
            "metrics": {"enabled": False},
            "threads": 1,
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen(
        [sys.executable, "-m", "treetrain.cli", "train", str(tmp_path / "config.yaml"), "--no-compare"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=_child_env(tmp_path),
    )
    try:
        end = time.monotonic() + 600
        while not mark.exists() or not mark.read_text():
            if proc.poll() is not None or time.monotonic() > end:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"the reward never hung (exit {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
            time.sleep(0.1)  # polling a condition, with a deadline
        worker = int(mark.read_text())
        server = psutil.Process(worker).ppid()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"SIGTERM not obeyed within 60 s:\n{out[-3000:]}\n{err[-3000:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (out[-3000:], err[-3000:])
    assert took < 10, f"{took:.1f}s after SIGTERM"
    assert "Traceback" not in err, err[-3000:]
    lines = out.splitlines()
    assert any(line.startswith("step 1/2 | reward 0.000") for line in lines), lines
    assert sum("reward error at step 1 group 0 row 0" in line and "too large" in line for line in lines) == 2, lines
    last = next(line for line in lines if line.startswith("SIGTERM:"))
    # The task clock's grace or the pool's (both 2 s) ends the stuck call first: either line is right.
    assert "step 2 abandoned during its rollout" in last, last
    assert "2s after SIGTERM" in last or "reward call stopped by SIGTERM" in last, last
    assert _gone([worker, server], 10) == []
