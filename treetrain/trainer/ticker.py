"""Rank 0's voice inside long steps: a progress line every ``trainer.progressSeconds`` while a step
runs, and lines the SIGTERM handler asks for, said at once.

A CPU step of the documented defaults (8 groups x 4 samples x 512 new tokens) takes minutes; without
this the trainer printed nothing for all of them. The ticker is a daemon thread that wakes every
``POLL_S``: the signal handler and the loop only set attributes (no lock a signal handler could
deadlock on), and the thread does the printing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from treetrain.rl.progress import RolloutProgress

POLL_S = 0.2  # how soon a line asked for (a SIGTERM acknowledgement) is printed


class Ticker:
    """Progress lines for the step in progress; see the module docstring."""

    def __init__(self, log: Callable[[str], None], every_s: float, progress: RolloutProgress, total_steps: int) -> None:
        self._log = log
        self.every_s = every_s
        self.progress = progress
        self.total_steps = total_steps
        self.step: int | None = None  # 1-based step in progress; None between runs
        self.phase = ""
        self._step_began = self._phase_began = self._last_line = 0.0
        self._rollout_s: float | None = None
        self._said: list[str] = []  # lines to print now (appended from the signal handler)
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="treetrain-ticker", daemon=True)
        self._thread.start()

    def begin_step(self, step: int, episodes: int) -> None:
        """Step ``step`` (1-based) starts with its rollout of ``episodes`` episodes."""
        now = time.monotonic()
        self.progress.begin(episodes)
        self._step_began = self._phase_began = self._last_line = now
        self._rollout_s = None
        self.phase = "rollout"
        self.step = step

    def enter(self, phase: str) -> None:
        """The step moves on to ``phase`` (training, weight sync, evaluation, checkpoint, ...)."""
        now = time.monotonic()
        if self.phase == "rollout":
            self._rollout_s = now - self._phase_began
        self.phase, self._phase_began = phase, now

    def end_step(self) -> None:
        self.step = None

    def say(self, line: str) -> None:
        """Print ``line`` within ``POLL_S`` (safe from a signal handler: a list append)."""
        self._said.append(line)

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S + 1.0)
        self._flush()

    def line(self, now: float) -> str:
        """The progress line of the step in progress."""
        width = len(str(self.total_steps))
        # Not "step N/M |": that is the step line's start, which scripts and tests pick out.
        head = f"progress: step {self.step:>{width}}/{self.total_steps} |"
        if self.phase == "rollout":
            done, total, tokens = self.progress.snapshot()
            what = f"rollout: {done}/{total} episodes finished, {tokens:,} tokens generated"
        else:
            took = f" (rollout took {self._rollout_s:.0f}s)" if self._rollout_s is not None else ""
            what = f"{self.phase}{took}, {now - self._phase_began:.0f}s in it"
        return f"{head} {what} | {now - self._step_began:.0f}s into the step"

    def _flush(self) -> None:
        while self._said:
            self._log(self._said.pop(0))

    def _run(self) -> None:
        while not self._closed:
            time.sleep(POLL_S)
            self._flush()
            now = time.monotonic()
            if self.step is not None and now - self._last_line >= self.every_s:
                self._last_line = now
                self._log(self.line(now))
