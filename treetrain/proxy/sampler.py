"""One worker thread in front of a ``Generate`` callable, batching concurrent requests.

Local rollout is not thread-safe and samples a batch of prompts for about the price of one, and
an agent's ``groupSize`` concurrent runs send their calls at nearly the same moment: so requests
with equal sampling parameters (and equal explicit seeds) that arrive within ``window_s`` of the
first go to the model as ONE ``generate`` call. While a batch runs, new requests queue up and
form the next one. A failing ``generate`` fails only the requests of its batch.

Local rollout holds a batch's KV cache for every prompt padded to the longest, so a batch may
also be bounded in tokens (``max_batch_tokens``, counted as prompts x the longest prompt): a
request that would pass it waits for a later batch (one that passes it alone runs alone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

from treetrain.rl.episodes import Generate as Generate  # re-exported: the proxy's callers pass one
from treetrain.rl.rollout import Generation, RolloutError, SamplingParams, ServerUnavailable

# The token bound of a batch sampled locally: twice the default session budget (32,768 tokens).
# Remote servers batch and bound memory themselves: no bound there.
LOCAL_BATCH_TOKENS = 65536


class SamplerError(RuntimeError):
    """A batch's ``generate`` failed; ``status`` is 503 when the rollout source is unavailable, else 500."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    seed: int
    explicit_seed: bool
    future: Future[list[Generation]] = field(default_factory=Future)

    @property
    def longest(self) -> int:
        return max(map(len, self.prompts), default=0)

    @property
    def key(self) -> tuple[SamplingParams, int | None]:
        # Requests without a seed of their own share a batch (it samples with the first one's).
        return self.params, self.seed if self.explicit_seed else None


class BatchingSampler:
    """``submit`` from any thread; one daemon worker calls ``generate``. ``log`` gets one line per
    failed batch. ``max_batch_tokens``: None, no token bound."""

    def __init__(
        self,
        generate: Generate,
        *,
        window_s: float = 0.01,
        max_batch: int = 64,
        max_batch_tokens: int | None = None,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self._generate = generate
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self._log = log
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._closed = False
        self._holds = 0  # hold() contexts open: no batch starts while > 0
        self._running = False  # a generate call is under way
        self.batches = 0  # generate calls made (the tests read it)
        self._worker = threading.Thread(target=self._run, name="treetrain-proxy-sampler", daemon=True)
        self._worker.start()

    def submit(
        self, prompts: Sequence[list[int]], params: SamplingParams, seed: int, *, explicit_seed: bool = False
    ) -> Future[list[Generation]]:
        """A future of one generation per prompt. Its prompts stay in one batch."""
        req = _Request([list(p) for p in prompts], params, seed, explicit_seed)
        with self._cond:
            if self._closed:
                req.future.set_exception(SamplerError(503, "the proxy is shutting down"))
                return req.future
            self._queue.append(req)
            self._cond.notify_all()
        return req.future

    def generate(
        self, prompts: Sequence[list[int]], params: SamplingParams, seed: int, *, explicit_seed: bool = False
    ) -> list[Generation]:
        """:meth:`submit` and wait (raises :class:`SamplerError`)."""
        return self.submit(prompts, params, seed, explicit_seed=explicit_seed).result()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """No generate call runs inside: waits for the running batch, and new ones wait until the
        block ends (the trainer steps the optimizer on the model local rollout samples from)."""
        with self._cond:
            self._holds += 1
            while self._running:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Fail what is queued and stop the worker after its current batch."""
        with self._cond:
            self._closed = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for req in queued:
            req.future.set_exception(SamplerError(503, "the proxy is shutting down"))
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout_s)

    # -- the worker -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._call(batch)

    def _next_batch(self) -> list[_Request] | None:
        """The oldest request and those like it that arrive within the window (up to max_batch prompts)."""
        with self._cond:
            while (not self._queue or self._holds) and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue[0]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0 and not self._full(self._fitting(first)):
                self._cond.wait(left)
                if self._closed:
                    return None
            while self._holds and not self._closed:  # a hold() began during the window
                self._cond.wait()
            if self._closed:
                return None
            batch = self._fitting(first)
            for req in batch:
                self._queue.remove(req)
            self._running = True
            return batch

    def _fitting(self, first: _Request) -> list[_Request]:
        """``first`` and the queued requests like it, oldest first, while the batch stays within
        ``max_batch`` prompts and ``max_batch_tokens``; a request that does not fit is left out."""
        batch = [first]
        size, longest = len(first.prompts), first.longest
        for req in self._queue:
            if req is first or req.key != first.key:
                continue
            rows, width = size + len(req.prompts), max(longest, req.longest)
            if rows <= self.max_batch and (self.max_batch_tokens is None or rows * width <= self.max_batch_tokens):
                batch.append(req)
                size, longest = rows, width
        return batch

    def _full(self, batch: list[_Request]) -> bool:
        """No more prompts can join: it holds ``max_batch`` prompts, or a request waits that does not fit."""
        alike = sum(1 for r in self._queue if r.key == batch[0].key)
        return sum(len(r.prompts) for r in batch) >= self.max_batch or alike > len(batch)

    def _call(self, batch: list[_Request]) -> None:
        try:
            self._deliver(batch)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _deliver(self, batch: list[_Request]) -> None:
        prompts = [p for req in batch for p in req.prompts]
        self.batches += 1
        try:
            gens = self._generate(prompts, batch[0].params, batch[0].seed)
            if len(gens) != len(prompts):
                raise RolloutError(f"the rollout source returned {len(gens)} generations for {len(prompts)} prompts")
        except Exception as err:  # any failure of the source fails this batch only
            status = 503 if isinstance(err, ServerUnavailable | RolloutError | ConnectionError | TimeoutError) else 500
            message = f"generation failed: {type(err).__name__}: {err}"
            self._log(f"treetrain proxy: {message} ({len(prompts)} prompts)")
            for req in batch:
                req.future.set_exception(SamplerError(status, message))
            return
        at = 0
        for req in batch:
            req.future.set_result(gens[at : at + len(req.prompts)])
            at += len(req.prompts)
