"""Counters of the proxy: the trainer exports some as Prometheus metrics (treetrain.metrics), the
proxy's own ``GET /metrics`` all of them (treetrain.proxy.exposition)."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from treetrain.metrics import FRESH_REASONS

# Request durations, from a session call (milliseconds) to a long reply of a big model (minutes).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The route label of the duration histogram: a fixed set, whatever paths clients send.
ROUTES = ("chat_completions", "completions", "responses", "sessions", "models", "metrics", "other")


class ProxyStats:
    """Thread-safe counts: responses by status code, open sessions, fresh renders by reason, prompt
    and sampled tokens, request durations by route. The HTTP threads write them; the trainer and
    ``GET /metrics`` read :meth:`snapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._fresh: Counter[str] = Counter()
        self._sessions_open = 0
        self._completion_tokens = 0
        self._prompt_tokens = 0
        self._durations = {r: [0] * (len(DURATION_BUCKETS) + 1) for r in ROUTES}  # per bucket, +Inf last
        self._duration_sums = dict.fromkeys(ROUTES, 0.0)
        # Set by the SessionStore: counting open sessions also ends the idle ones, so a snapshot
        # taken while no request comes in is still right.
        self.open_sessions: Callable[[], int] | None = None

    def response(self, status: int) -> None:
        with self._lock:
            self._requests[str(status)] += 1

    def fresh_render(self, reason: str) -> None:
        with self._lock:
            self._fresh[reason] += 1

    def tokens(self, prompt: int, completion: int) -> None:
        """A completion's prompt tokens (each choice's) and sampled tokens."""
        with self._lock:
            self._prompt_tokens += prompt
            self._completion_tokens += completion

    def request_seconds(self, route: str, seconds: float) -> None:
        route = route if route in self._durations else "other"
        at = next((i for i, bound in enumerate(DURATION_BUCKETS) if seconds <= bound), len(DURATION_BUCKETS))
        with self._lock:
            self._durations[route][at] += 1
            self._duration_sums[route] += seconds

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
                "prompt_tokens": self._prompt_tokens,
                # per route: cumulative counts per bucket of DURATION_BUCKETS (+Inf last), and the sum
                "durations": {
                    r: {"buckets": list(itertools.accumulate(c)), "sum": self._duration_sums[r]}
                    for r, c in self._durations.items()
                },
            }
