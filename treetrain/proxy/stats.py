"""Counters of the proxy that the trainer exports as Prometheus metrics (treetrain.metrics)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from treetrain.metrics import FRESH_REASONS


class ProxyStats:
    """Thread-safe counts: responses by status code, open sessions, fresh renders by reason and
    sampled tokens. The HTTP threads write them; the trainer reads :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._fresh: Counter[str] = Counter()
        self._sessions_open = 0
        self._completion_tokens = 0
        # Set by the SessionStore: counting open sessions also ends the idle ones, so a snapshot
        # taken while no request comes in is still right.
        self.open_sessions: Callable[[], int] | None = None

    def response(self, status: int) -> None:
        with self._lock:
            self._requests[str(status)] += 1

    def fresh_render(self, reason: str) -> None:
        with self._lock:
            self._fresh[reason] += 1

    def completion_tokens(self, n: int) -> None:
        with self._lock:
            self._completion_tokens += n

    def sessions_open(self, n: int) -> None:
        with self._lock:
            self._sessions_open = n

    def snapshot(self) -> dict[str, Any]:
        """A copy of every count; fresh_renders names every reason of chat.FRESH_REASONS (0 too)."""
        count = self.open_sessions
        open_now = count() if count is not None else None  # before our lock: the store's lock comes first
        with self._lock:
            return {
                "requests": dict(self._requests),
                "sessions_open": self._sessions_open if open_now is None else open_now,
                "fresh_renders": {
                    r: self._fresh[r] for r in (*FRESH_REASONS, *sorted(set(self._fresh) - set(FRESH_REASONS)))
                },
                "completion_tokens": self._completion_tokens,
            }
