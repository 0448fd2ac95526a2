"""A trainer that talks: progress inside long steps, SIGTERM said at once and obeyed during the
rollout (exit 143, the last trained step kept and resumable), ``done:`` before the tree-vs-flat
comparison, a finished run that says so, checkpoint saves and sampled completions logged."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
import yaml
from helpers import ROOT, merge
from suite_helpers import small, subprocess_env

from treetrain import config as C
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.samples import Rollouts, Sample
from treetrain.trainer.loop import Trainer
from treetrain.trainer.run import run_training
from treetrain.trainer.samples import pick_episodes, printed, sample_records
from treetrain.trainer.ticker import Ticker

pytestmark = pytest.mark.usefixtures("trainer_env")


# -- pure parts -------------------------------------------------------------------------------


def test_the_ticker_prints_rollout_progress_then_the_phase() -> None:
    progress = RolloutProgress()
    ticker = Ticker(lambda _: None, 30.0, progress, total_steps=100)
    ticker.begin_step(7, episodes=32)
    progress.generated(1000)
    progress.decoded(234)
    progress.episodes_finished(5)
    now = time.monotonic()
    assert ticker.line(now).startswith(
        "progress: step   7/100 | rollout: 5/32 episodes finished, 1,234 tokens generated | "
    )
    ticker.enter("training")
    assert "| training (rollout took " in ticker.line(now + 1)


def test_the_ticker_says_lines_at_once_and_ticks_on_its_period() -> None:
    lines: list[str] = []
    progress = RolloutProgress()
    ticker = Ticker(lines.append, 0.3, progress, total_steps=2)
    ticker.start()
    try:
        ticker.begin_step(1, episodes=4)
        ticker.say("SIGTERM received: stopping")
        deadline = time.monotonic() + 60
        while sum(line.startswith("progress: step 1/2 | rollout") for line in lines) < 2:
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)  # polling a condition, with a deadline
        assert "SIGTERM received: stopping" in lines
    finally:
        ticker.close()


def test_the_stop_is_raised_at_a_check_and_remembered() -> None:
    progress = RolloutProgress()
    progress.check()  # no stop asked: nothing happens
    progress.request_stop()
    with pytest.raises(Exception, match="stopped by SIGTERM"):
        progress.check()
    assert progress.stopped


def test_logged_samples_spread_over_the_groups() -> None:
    assert pick_episodes([0, 0, 1, 1, 2, 2], 4) == [0, 2, 4, 1]
    rollouts = Rollouts(
        samples=[Sample(0, [1, 2, 3, 4], 2, [0.0, 0.0, 0.0, 0.0]), Sample(1, [1, 2, 5], 2, [0.0, 0.0, 0.0])],
        rewards=[1.0, 0.0],
        groups=[0, 1],
    )
    records = sample_records(3, rollouts, 2, lambda ids: "".join(chr(96 + i) for i in ids))
    assert records[0] == {
        "step": 3,
        "episode": 0,
        "group": 0,
        "reward": 1.0,
        "turns": 1,
        "prompt": "ab",
        "completion": "cd",
        "prompt_tokens": 2,
        "completion_tokens": 2,
    }
    assert printed(records[1]) == "sample (step 3, group 1, reward 0.000, 1 tokens): 'ab' -> 'e'"


# -- a whole run, in this process -------------------------------------------------------------


def test_a_run_logs_saves_and_samples_then_done_before_the_comparison(tmp_path: Path) -> None:
    raw = merge(small(tmp_path / "ckpt"), {"trainer": {"logSamples": 2, "compareFlat": True, "compareBatches": 1}})
    lines: list[str] = []
    out = _Lines(lines)
    summary = run_training(C.validate(raw), out=out)
    assert len(summary.records) == 3 and summary.comparison is not None
    header = next(line for line in lines if line.startswith("training "))
    assert "up to 4 new tokens per reply" in header
    saved = [line for line in lines if line.startswith("checkpoint: step ")]
    assert [s.split()[2] for s in saved] == ["2", "3"] and "saved to" in saved[0]
    done = next(i for i, line in enumerate(lines) if line.startswith("done: 3 steps"))
    timing = next(i for i, line in enumerate(lines) if line.startswith("timing tree vs flat"))
    speedup = next(i for i, line in enumerate(lines) if line.startswith("speedup tree vs flat"))
    assert done < timing < speedup  # the run's end is said before minutes of comparison
    assert sum(line.startswith("sample (step ") for line in lines) == 3  # one printed per step
    records = [json.loads(r) for r in (tmp_path / "ckpt" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3]
    assert {r["group"] for r in records if r["step"] == 1} == {0, 1}  # spread over the groups


def test_a_finished_run_started_again_says_so_and_trains_nothing(tmp_path: Path) -> None:
    raw = small(tmp_path / "ckpt", steps=2)
    run_training(C.validate(raw), out=_Lines([]))
    lines: list[str] = []
    again = run_training(C.validate(raw), out=_Lines(lines))
    assert again.finished_before and not again.records and not again.interrupted
    (said,) = [line for line in lines if line.startswith("nothing to train")]
    assert "step-00000002 holds step 2 and trainer.steps is 2" in said and "raise trainer.steps" in said
    assert not any(line.startswith("step ") for line in lines)


def test_sigterm_during_the_comparison_skips_it(tmp_path: Path) -> None:
    raw = merge(small(steps=1), {"trainer": {"compareFlat": True, "compareBatches": 1, "compareRounds": 50}})
    cfg = C.validate(raw)
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        trainer.run()
        real = trainer.actor.forward_backward

        def pass_then_sigterm(*args: object, **kwargs: object) -> object:
            signal.raise_signal(signal.SIGTERM)
            return real(*args, **kwargs)  # type: ignore[arg-type]

        trainer.actor.forward_backward = pass_then_sigterm  # type: ignore[method-assign]
        assert trainer.compare() is None
    finally:
        trainer.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _Lines:
    """A text stream that keeps whole lines (run_training prints to it)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        self.lines += [line for line in text.splitlines() if line]
        return len(text)

    def flush(self) -> None:
        pass


# -- SIGTERM during the rollout, in a real process ----------------------------------------------


class _Run:
    """``treetrain train CONFIG`` in a process whose stdout lines are read as they come."""

    def __init__(self, tmp: Path, raw: dict[str, object], *args: str) -> None:
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(raw))
        self.lines: list[tuple[float, str]] = []
        self.err_path = tmp / f"stderr-{len(list(tmp.glob('stderr-*')))}"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "treetrain.cli", "train", str(path), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                env=subprocess_env(outside_a_pod=True),
            )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, match: Callable[[str], bool], deadline_s: float) -> float:
        """When the first line ``match`` accepts was printed (waits up to ``deadline_s``)."""
        end = time.monotonic() + deadline_s
        while True:
            for when, line in list(self.lines):
                if match(line):
                    return when
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                pytest.fail(f"no such line within {deadline_s:.0f}s; stdout:\n" + "\n".join(self.text()[-40:]))
            time.sleep(0.1)  # polling a condition, with a deadline

    def sigterm_and_wait(self, limit_s: float) -> float:
        sent = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)  # as Kubernetes does before it kills the pod
        try:
            self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"SIGTERM not obeyed within {limit_s:.0f}s:\n" + "\n".join(self.text()[-20:]))
        self._reader.join(timeout=10)
        return time.monotonic() - sent

    def text(self) -> list[str]:
        return [line for _, line in self.lines]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)

    def stderr(self) -> str:
        return self.err_path.read_text()


@pytest.mark.slow
def test_the_documented_defaults_report_progress_and_stop_on_sigterm_during_rollout(tmp_path: Path) -> None:
    """SmolLM2 with the trainer's defaults (8 groups x 4 samples x up to 512 new tokens, progress
    every 30 s): a CPU step takes many minutes. A progress line comes within 30 s of the step's
    start; SIGTERM is answered at once and the process exits 143 well within 60 s."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": f"Tell a long story about {n} cats.", "answer": "x"}) + "\n" for n in range(16))
    )
    raw = {
        "model": {"path": "builtin:smollm2-135m"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "trainer": {"dataset": {"path": str(rows)}, "reward": "builtin:exact", "metrics": {"enabled": False}},
    }
    run = _Run(tmp_path, raw)
    try:
        began = run.wait_for(lambda line: line.startswith("training builtin:smollm2-135m"), 600)
        assert "8 groups x 4 samples, up to 512 new tokens per reply" in run.text()[-1]
        ticked = run.wait_for(lambda line: "| rollout: " in line, 120)
        # 30 s after the step began, plus a margin for a loaded machine (a thread's wake-up).
        assert ticked - began < 30 + 10, ticked - began
        took = run.sigterm_and_wait(60)
    finally:
        run.kill()
    lines = run.text()
    assert run.proc.returncode == 143, (lines[-10:], run.stderr()[-2000:])
    assert took < 60
    assert any(line.startswith("SIGTERM received: stopping now; step 1's rollout is abandoned") for line in lines)
    last = next(line for line in lines if line.startswith("SIGTERM: step 1 abandoned during its rollout"))
    assert "no step finished yet: nothing to keep" in last
    assert "Traceback" not in run.stderr()


@pytest.mark.slow
def test_sigterm_during_a_rollout_keeps_the_last_step_and_the_run_resumes(tmp_path: Path) -> None:
    """Step 2's long rollout is stopped by SIGTERM: step 1 (not due for a checkpoint) is saved,
    the exit code is 143, and --resume trains step 2 and nothing before it."""
    ckpt = tmp_path / "ckpt"
    long_replies = {"taskArgs": {"turns": 1, "userTokens": 4, "systemTokens": 16, "maxNewTokens": 2000}}
    raw = merge(small(steps=3, progressSeconds=0.5, **long_replies), {"checkpoint": {"dir": str(ckpt)}})
    raw["actor"]["treeTraining"]["maxTokensPerMicrobatch"] = 8192
    run = _Run(tmp_path, raw)
    try:
        run.wait_for(lambda line: line.startswith("step 1/3 | reward"), 600)
        run.wait_for(lambda line: line.startswith("progress: step 2/3 | rollout"), 300)
        assert run.sigterm_and_wait(60) < 60
    finally:
        run.kill()
    lines = run.text()
    assert run.proc.returncode == 143, (lines[-10:], run.stderr()[-2000:])
    last = next(line for line in lines if line.startswith("SIGTERM: step 2 abandoned during its rollout"))
    assert "step-00000001" in last and "--resume" in last
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    resumed = _Run(tmp_path, raw, "--resume", "--steps", "2")
    try:
        resumed.wait_for(lambda line: line.startswith("done: "), 600)
        resumed.proc.wait(timeout=120)
    finally:
        resumed.kill()
    text = resumed.text()
    assert resumed.proc.returncode == 0, (text[-10:], resumed.stderr()[-2000:])
    assert any(line.startswith("resumed from") and "step-00000001" in line for line in text)
    assert [line.split(" | ")[0] for line in text if " | reward " in line] == ["step 2/2"]
