"""Limits on the task's own code: a time budget per episode, and a prompt stop on SIGTERM.

The task's ``episode()``, ``prompt()`` and ``respond()`` are user code that may hang (a tool call
that never answers, a loop that never ends). :class:`TaskClock` runs each call under the
episode's remaining budget: in the main thread a ``SIGALRM`` timer raises inside the call when
the budget runs out (every ``REFIRE_S`` after, should the task swallow it), so the hung code is
stopped, not left running in a thread; the call then fails with :class:`EpisodeTimeoutError`
naming the task and the key. :meth:`TaskClock.stop_soon` (what the trainer's SIGTERM handler
calls) gives a call in progress, and every later one, ``STOP_GRACE_S`` to return, then raises
inside it too, and the call fails with :class:`TaskInterrupted`; calls that return in time let
the step finish.

Off the main thread (no signals there) a call cannot be interrupted: its time is checked when it
returns. Code that hangs in C without releasing the GIL cannot be interrupted either; the pod's
grace period still ends it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from treetrain.rl.task import TaskError

T = TypeVar("T")

STOP_GRACE_S = 2.0  # SIGTERM: how long a task call in progress may still take
REFIRE_S = 0.5  # a deadline the task swallowed is raised again this often


class EpisodeTimeoutError(TaskError):
    """The task's code spent more than ``trainer.episodeTimeoutSeconds`` on one episode."""


class TaskInterrupted(Exception):
    """SIGTERM arrived while the task's code ran, and it did not return within the grace."""


class _Deadline(BaseException):
    """Raised inside the task's code (a BaseException: ``except Exception`` does not swallow it)."""


def budget_left(timeout_s: float, spent_s: float) -> float:
    """Seconds an episode's next call may take: the budget less what its calls took so far."""
    return max(0.0, timeout_s - spent_s)


class TaskClock:
    """Runs the task's calls under a per-episode time budget; see the module docstring."""

    def __init__(self, task: str, timeout_s: float) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self._call_deadline: float | None = None  # monotonic time the running call must end by
        self._stop_at: float | None = None  # SIGTERM: monotonic time the running call is stopped at
        self.stopping = False  # SIGTERM came: every call gets STOP_GRACE_S at most

    def run(self, what: str, spent_s: float, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """``fn(*args)`` and the seconds it took; ``what`` names the call in messages
        (``respond() of episode 3``), ``spent_s`` is what the episode's earlier calls took."""
        left = budget_left(self.timeout_s, spent_s)
        start = time.monotonic()
        interruptible = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
        previous: Any = None
        self._call_deadline = start + left
        self._stop_at = start + STOP_GRACE_S if self.stopping else None
        try:
            if interruptible:
                previous = signal.signal(signal.SIGALRM, self._on_alarm)
                self._arm()
            result = fn(*args)
        except _Deadline:
            raise self._failure(what, time.monotonic() - start) from None
        finally:
            self._call_deadline = self._stop_at = None
            if interruptible:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        took = time.monotonic() - start
        if took > left:  # off the main thread: found only once the call returned
            raise self._failure(what, took, stopped=False)
        return result, took

    def stop_soon(self) -> None:
        """SIGTERM (called from its handler, in the main thread): a call in progress, and every
        later one, has ``STOP_GRACE_S`` left."""
        self.stopping = True
        if self._call_deadline is None:
            return
        self._stop_at = time.monotonic() + STOP_GRACE_S
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            self._arm()

    def _failure(self, what: str, took: float, *, stopped: bool | None = None) -> Exception:
        if stopped is None:  # interrupted: by whichever end came first
            stopped = self._stop_at is not None and time.monotonic() >= self._stop_at
        if stopped:
            return TaskInterrupted(
                f"task {self.task}: {what} had not returned {STOP_GRACE_S:g}s after SIGTERM (it ran {took:.1f}s)"
            )
        return EpisodeTimeoutError(
            f"task {self.task}: {what} did not return within the episode's budget of {self.timeout_s:g}s "
            f"(trainer.episodeTimeoutSeconds; the call ran {took:.1f}s); fix: make the task answer, or raise the key"
        )

    def _arm(self) -> None:
        ends = [t for t in (self._call_deadline, self._stop_at) if t is not None]
        if not ends:
            return
        delay = max(min(ends) - time.monotonic(), 1e-3)
        signal.setitimer(signal.ITIMER_REAL, delay, REFIRE_S)

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self._call_deadline is None:
            return  # the call has just returned
        now = time.monotonic()
        if (self._stop_at is not None and now >= self._stop_at) or now >= self._call_deadline:
            raise _Deadline
        self._arm()  # woken early (the SIGTERM grace moved the timer): wait for the nearer end
