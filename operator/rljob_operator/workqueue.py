"""The work queue: RLJob keys due at a time, each processed by at most one worker at once, with
holds (backoff) that only an urgent event ends."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable

Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    """Keys due at a time; each key is processed by at most one worker at once.

    Owned by the event loop that runs :meth:`run`: :meth:`add` from any other thread (a
    synchronous kopf handler runs in an executor thread) is handed to the loop, so the due
    map is only ever touched by one thread.
    """

    def __init__(self) -> None:
        self._due: dict[Key, float] = {}
        # Keys backing off (a refused child, a failing pass) until a time: an ordinary event
        # (the pass's own status write, a child's change, the resync) does not bring them
        # forward; an urgent one (the spec changed, the RLJob was deleted) does.
        self._held: dict[Key, float] = {}
        self._urgent: set[Key] = set()  # urgent adds since the key's current pass began
        self._running: set[Key] = set()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def add(self, key: Key, delay: float = 0.0, *, urgent: bool = False) -> None:
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._add, key, delay, urgent)
        else:
            self._add(key, delay, urgent)

    def _add(self, key: Key, delay: float, urgent: bool = False) -> None:
        due = time.monotonic() + delay
        if urgent:
            self._held.pop(key, None)
            if key in self._running:
                self._urgent.add(key)
        elif key in self._held:
            due = max(due, self._held[key])
        if key not in self._due or due < self._due[key]:
            self._due[key] = due
        self._wakeup.set()

    def hold(self, key: Key, delay: float) -> None:
        """Process ``key`` again in ``delay`` seconds, and not before unless an urgent add comes
        (also one that came while its pass ran). Call from the queue's loop."""
        if key in self._urgent:
            return
        until = time.monotonic() + delay
        self._held[key] = until
        self._due[key] = until
        self._wakeup.set()

    def release(self, key: Key) -> None:
        """End a hold: the key's events queue it at once again."""
        self._held.pop(key, None)

    def held(self, key: Key) -> bool:
        return key in self._held

    async def run(self, worker: Callable[[Key], Awaitable[None]], concurrency: int = 4) -> None:
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        tasks: set[asyncio.Task[None]] = set()

        async def process(key: Key) -> None:
            try:
                await worker(key)
            finally:
                self._running.discard(key)
                self._wakeup.set()

        while True:
            now = time.monotonic()
            ready = sorted((due, key) for key, due in self._due.items() if due <= now and key not in self._running)
            for _, key in ready[: max(concurrency - len(self._running), 0)]:
                del self._due[key]
                self._running.add(key)
                self._urgent.discard(key)
                task = asyncio.create_task(process(key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            future = [due for key, due in self._due.items() if key not in self._running]
            timeout = max(min(future) - now, 0.01) if future else None
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=timeout)
