"""Bounds on one episode (issue 21 item 12): a task whose code hangs is stopped by SIGTERM within
seconds (not the pod's 900 s grace) and by ``trainer.episodeTimeoutSeconds``; a conversation
that never ends is cut by ``trainer.maxTurns`` and ``trainer.maxEpisodeTokens``, counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from suite_helpers import subprocess_env

from treetrain import config as C
from treetrain.rl.episodes import episode_cap
from treetrain.rl.limits import STOP_GRACE_S, EpisodeTimeoutError, TaskClock, TaskInterrupted
from treetrain.rl.task import TaskError
from treetrain.trainer.loop import Trainer

ROOT = Path(__file__).resolve().parents[2]

# A user task (written next to the test's config) that plays builtin:parity but whose respond()
# hangs once `hang_after` episodes were made (step 1 finishes, step 2 hangs), or whose
# conversations never end. `mark` is written when it hangs: the test waits for it, not a sleep.
TASK_MODULE = """
import pathlib, time
from treetrain.rl.task import ParityTask


class Episode:
    def __init__(self, task, inner, hangs):
        self.task, self.inner, self.hangs = task, inner, hangs

    def prompt(self):
        return self.inner.prompt()

    def respond(self, response):
        if self.hangs:
            pathlib.Path(self.task.mark).write_text("hung")
            if self.task.how == "spin":  # busy, and swallowing every Exception
                while True:
                    try:
                        sum(range(1000))
                    except Exception:
                        pass
            while True:
                time.sleep(3600)
        nxt, reward = self.inner.respond(response)
        if self.task.endless:
            nxt = [9, 10, 11, 12, 13, 14, 15, 16]  # the user never says goodbye
        return nxt, reward


class Task:
    def __init__(self, mark="", hang_after=-1, how="sleep", endless=False):
        self.inner = ParityTask(turns=2, user_tokens=4, system_tokens=16, max_new_tokens=4)
        self.vocab_size, self.max_new_tokens, self.stop_token_ids = 512, 4, ()
        self.mark, self.hang_after, self.how, self.endless = mark, hang_after, how, endless
        self.made = 0

    def episode(self, seed):
        self.made += 1
        return Episode(self, self.inner.episode(seed), 0 <= self.hang_after < self.made)


def make(**kwargs):
    return Task(**kwargs)
"""


def config(tmp: Path, task_args: dict[str, Any], **trainer: Any) -> dict[str, Any]:
    return {
        "model": {"path": "builtin:tiny-llama", "seed": 1},
        "actor": {
            "backend": "fsdp:d1",
            "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 256, "blockSize": 16},
        },
        "checkpoint": {"dir": str(tmp / "ckpt"), "intervalSteps": 50},
        "trainer": {
            "steps": 4,
            "task": "limits_task:make",
            "taskArgs": task_args,
            "groupsPerStep": 2,
            "groupSize": 2,
            "metrics": {"enabled": False},
            "threads": 1,
            **trainer,
        },
    }


def _start(tmp: Path, raw: dict[str, Any]) -> subprocess.Popen[str]:
    (tmp / "limits_task.py").write_text(TASK_MODULE)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = subprocess_env(outside_a_pod=True)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "treetrain.cli", "train", str(path), "--no-compare"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp,
        env=env,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str], deadline_s: float) -> None:
    """Until ``path`` exists (the task hung); generous: torch loads slowly on a busy machine."""
    end = time.monotonic() + deadline_s
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the trainer exited {proc.returncode} before the task hung:\n{out[-2000:]}\n{err[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"the task did not hang within {deadline_s:.0f}s")
        time.sleep(0.1)  # polling a condition, with a deadline


@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_sigterm_stops_a_hung_task_at_once_and_keeps_the_last_step(tmp_path: Path, how: str) -> None:
    mark = tmp_path / "hung"
    # Step 1 plays 4 episodes; the 5th episode (step 2) hangs in respond().
    proc = _start(tmp_path, config(tmp_path, {"mark": str(mark), "hang_after": 4, "how": how}))
    try:
        _wait_for(mark, proc, 600)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # as Kubernetes does before it kills the pod
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"SIGTERM was not obeyed within 60 s (the task hangs):\n{out[-2000:]}\n{err[-2000:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    assert took < 30, f"{took:.1f}s after SIGTERM"
    assert "Traceback" not in err, err[-2000:]
    line = next(li for li in out.splitlines() if li.startswith("SIGTERM:"))
    assert "step 2 abandoned during its rollout" in line and "respond() of episode" in line, line
    # The step trained before the hang is kept (checkpoint.intervalSteps is 50: saved for SIGTERM).
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000001"
    assert "step-00000001" in line


def test_a_hung_episode_fails_the_step_after_its_timeout(tmp_path: Path) -> None:
    mark = tmp_path / "hung"
    raw = config(tmp_path, {"mark": str(mark), "hang_after": 0, "how": "spin"}, episodeTimeoutSeconds=3)
    proc = _start(tmp_path, raw)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, (out[-2000:], err[-2000:])
    assert err.count("\n") == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("treetrain train: error: task limits_task:make: respond() of episode 0 did not return")
    assert "trainer.episodeTimeoutSeconds" in err and "budget of 3s" in err


def test_a_conversation_that_never_ends_is_capped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "limits_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines: list[str] = []
    # By turns: 5 turns per episode, every episode capped.
    raw = config(tmp_path, {"endless": True}, maxTurns=5, steps=1)
    trainer = Trainer(C.validate(raw), log=lines.append)
    try:
        rollouts = trainer.collect(0)
        assert (rollouts.capped_turns, rollouts.capped_tokens) == (4, 0)
        assert len(rollouts.samples) == 4 * 5
    finally:
        trainer.close()
    # By tokens: the prompt is 16 + 7 tokens, each turn adds a 4-token reply and an 8-token user
    # turn; no sample may pass 100 tokens.
    raw = config(tmp_path, {"endless": True}, maxEpisodeTokens=100, steps=1)
    trainer = Trainer(C.validate(raw), log=lines.append)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    (rec,) = summary.records
    assert rec.stats["episodes_capped_tokens"] == 4 and rec.stats["episodes_capped_turns"] == 0
    samples = trainer.batches[-1].sequences
    assert max(map(len, samples)) <= 100 and max(map(len, samples)) > 100 - 12
    step_line = next(line for line in lines if line.startswith("step 1/1 | reward"))  # a checkpoint line follows
    assert "episodes capped: 0 at trainer.maxTurns, 4 at trainer.maxEpisodeTokens" in step_line
    assert trainer.metrics.episodes_capped.labels(reason="tokens")._value.get() == 4


def test_a_first_prompt_with_no_room_for_a_reply_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "limits_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = Trainer(C.validate(config(tmp_path, {}, maxEpisodeTokens=24, steps=1)), log=lambda _: None)
    try:
        with pytest.raises(TaskError, match="first prompt of episode 0 has 23 tokens"):
            trainer.collect(0)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("turns", "tokens", "nxt", "want"),
    [
        (1, 30, None, None),  # over by itself
        (1, 30, [1, 2], None),  # goes on
        (5, 30, [1, 2], "turns"),  # played maxTurns
        (1, 90, [1, 2], None),  # 90 + 2 + 4 = 96 fits in 100
        (1, 95, [1, 2], "tokens"),  # 95 + 2 + 4 could pass 100
        (5, 95, [1, 2], "turns"),  # both: turns first
    ],
)
def test_episode_cap(turns: int, tokens: int, nxt: list[int] | None, want: str | None) -> None:
    assert episode_cap(turns, tokens, nxt, max_new_tokens=4, max_turns=5, max_tokens=100) == want


def test_the_clock_stops_a_call_in_the_main_thread() -> None:
    clock = TaskClock("t", timeout_s=0.5)
    begin = time.monotonic()
    with pytest.raises(EpisodeTimeoutError, match="respond"):
        clock.run("respond() of episode 0", 0.0, time.sleep, 60)
    assert time.monotonic() - begin < 30
    assert clock.run("prompt()", 0.0, lambda: 7)[0] == 7  # the timer is gone after a timeout
    with pytest.raises(EpisodeTimeoutError):  # the budget is per episode: earlier calls count
        clock.run("respond()", 0.6, lambda: 7)


def test_sigterm_gives_a_call_a_grace_then_stops_it() -> None:
    clock = TaskClock("t", timeout_s=600)
    previous = signal.signal(signal.SIGTERM, lambda *_: clock.stop_soon())
    try:
        assert clock.run("quick", 0.0, lambda: (signal.raise_signal(signal.SIGTERM), 1)[1])[0] == 1
        begin = time.monotonic()
        with pytest.raises(TaskInterrupted, match=r"hang.*SIGTERM"):
            clock.run("hang", 0.0, time.sleep, 60)  # SIGTERM came before: the grace only
        assert time.monotonic() - begin < STOP_GRACE_S + 20
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_an_overrun_is_found_when_the_call_returns() -> None:
    clock = TaskClock("t", timeout_s=0.05)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            clock.run("respond()", 0.0, time.sleep, 0.2)
        except EpisodeTimeoutError as err:
            errors.append(err)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1
