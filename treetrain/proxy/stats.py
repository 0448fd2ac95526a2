"""Counters of the proxy that the trainer exports as Prometheus metrics (treetrain.metrics)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class ProxyStats:
    """Thread-safe counts: responses by status code, open sessions, fresh renders by reason and
    sampled tokens. The HTTP threads write them; the trainer reads :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._fresh: Counter[str] = Counter()
        self._sessions_open = 0
        self._completion_tokens = 0

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
        from treetrain.proxy.chat import FRESH_REASONS

        with self._lock:
            return {
                "requests": dict(self._requests),
                "sessions_open": self._sessions_open,
                "fresh_renders": {
                    r: self._fresh[r] for r in (*FRESH_REASONS, *sorted(set(self._fresh) - set(FRESH_REASONS)))
                },
                "completion_tokens": self._completion_tokens,
            }
