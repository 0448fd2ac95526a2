"""How far a step's rollout has got, and the request to stop it.

A rollout on the CPU (or a long one on servers) can run for minutes inside one step. The
trainer's ticker reads :class:`RolloutProgress` to print progress lines, and its SIGTERM handler
calls :meth:`RolloutProgress.request_stop`; local generation checks :meth:`RolloutProgress.stopped`
every few decoded tokens and raises :class:`RolloutStopped`, so a stop takes effect within a few
tokens, not after the whole batch.

Counters are plain ints under one lock: written by the rollout (any thread), read by the ticker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from treetrain.rl.limits import TaskInterrupted


class RolloutStopped(TaskInterrupted):
    """Generation stopped on request (SIGTERM); raised on every rank at the same decode step."""


class RolloutProgress:
    """Episodes finished and tokens generated in the current step, and the stop request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.episodes_total = 0
        self.episodes_done = 0
        self.tokens = 0  # tokens of generate calls that returned
        self.live_tokens = 0  # tokens of the generate call in progress (local rollout counts them as it goes)
        self.stopped = False  # a check raised RolloutStopped in this step (the ranks agreed to stop)
        # Decides whether to stop; the trainer replaces it with one that agrees across ranks.
        self.should_stop: Callable[[], bool] = self._stop.is_set

    def begin(self, episodes: int) -> None:
        """A new step's rollout of ``episodes`` episodes."""
        with self._lock:
            self.episodes_total, self.episodes_done, self.tokens, self.live_tokens = episodes, 0, 0, 0
            self.stopped = False

    def add_episodes(self, n: int) -> None:
        """More episodes to play than planned (dynamic sampling's extra groups)."""
        with self._lock:
            self.episodes_total += n

    def episodes_finished(self, n: int = 1) -> None:
        with self._lock:
            self.episodes_done += n

    def generated(self, tokens: int) -> None:
        """A generate call returned ``tokens`` new tokens (its live count is folded in)."""
        with self._lock:
            self.tokens += tokens
            self.live_tokens = 0

    def decoded(self, tokens: int) -> None:
        """``tokens`` more decoded by the generate call in progress."""
        with self._lock:
            self.live_tokens += tokens

    def snapshot(self) -> tuple[int, int, int]:
        """(episodes finished, episodes in all, tokens generated so far)."""
        with self._lock:
            return self.episodes_done, self.episodes_total, self.tokens + self.live_tokens

    def request_stop(self) -> None:
        """Stop generating at the next check (safe to call from a signal handler)."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def check(self) -> None:
        """Raise :class:`RolloutStopped` when a stop was requested (on any rank, when the
        trainer's ``should_stop`` agrees across ranks)."""
        if self.should_stop():
            self.stopped = True
            raise RolloutStopped("generation stopped by SIGTERM")
