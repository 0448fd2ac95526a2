"""Requests that survive weight updates and server failures, for the HTTP clients.

A weight update pauses the servers with mode "abort" (SGLang ``/pause_generation``, vLLM
``/pause?mode=abort``): a generation in flight ends at once with finish_reason "abort" and the
tokens and log-probs it has sampled so far. The client keeps them, waits for the weight gate to
open again, and sends the prompt plus those tokens with the tokens still allowed, until a reply
is complete. Every token is labelled with the gate's version at the send of the request that
sampled it: the gate was open then, so every server held that version. A request that reaches a
server after its pause waits there and samples with the newer weights, so a label can only be
older than the truth, never newer: the staleness counted from it is never smaller than the real one.

Why abort rather than vLLM's "keep" (freeze requests and continue them after the update): a kept
request continues with keys and values computed by the old weights, and its reply does not say at
which token the weights changed, so its tokens could not be labelled exactly. A resubmitted one
reads its whole prefix again under the new weights, and the reply of each request says which
tokens it sampled.

A server that fails a request (connection errors or 5xx after every retry) is left for the next
endpoint, the partial tokens kept; only when every endpoint failed does the request raise
RolloutError (the caller drops that group). Every wait is bounded by the client's timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from treetrain.rl.progress import RolloutStopped
from treetrain.rl.rollout.base import Generation, RolloutError, SamplingParams
from treetrain.rl.rollout.gate import WeightGate

if TYPE_CHECKING:
    from treetrain.rl.rollout.http import HTTPRollout

Target = tuple["HTTPRollout", str]  # an endpoint with the client that speaks its dialect


class ServerUnavailable(RolloutError):
    """A server that did not answer (connection errors or 5xx after every retry): another may."""


class Dispatch:
    """The round-robin position and the resubmission count of one client, shared by every thread
    that calls its ``generate``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._resubmitted = 0

    def take(self, prompts: int, targets: int) -> int:
        """Where a call of ``prompts`` prompts starts; the next call starts after them (so
        consecutive small batches still reach every server)."""
        with self._lock:
            start = self._next
            self._next = (start + prompts) % targets
            return start

    def resubmitted_one(self) -> None:
        with self._lock:
            self._resubmitted += 1

    @property
    def resubmitted(self) -> int:
        with self._lock:
            return self._resubmitted


def spread(
    targets: Sequence[Target],
    dispatch: Dispatch,
    gate: WeightGate,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    seed: int,
    timeout_s: float,
    *,
    stop: Callable[[], bool] | None = None,
) -> list[Generation]:
    """Round-robin: prompt i goes first to ``targets[(start + i) % n]`` with seed ``seed + i``, one
    request per prompt, all at once; the generations come back in prompt order. ``stop`` is asked
    every ``STOP_POLL_S`` while the requests run: True abandons them (:class:`RolloutStopped`)."""
    if not prompts:
        return []
    start = dispatch.take(len(prompts), len(targets))

    def one(i: int) -> Generation:
        first = (start + i) % len(targets)
        return generate_resumable(targets, first, prompts[i], params, seed + i, gate, dispatch, timeout_s)

    return _map_stoppable(one, len(prompts), min(64, len(prompts)), stop)


STOP_POLL_S = 0.25  # how often a waiting generate call asks whether to stop


def _map_stoppable(
    fn: Callable[[int], Generation], n: int, workers: int, stop: Callable[[], bool] | None
) -> list[Generation]:
    """``fn(0..n-1)`` on ``workers`` daemon threads, results in order; the first error (in index
    order) is raised once every call ended. Daemon threads, not an executor's: a stopped call's
    requests are abandoned, and the process must be able to exit while they still wait on a server
    (an executor's threads are joined at exit, for up to the request timeout)."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    results: list[Generation | BaseException | None] = [None] * n
    left = threading.Semaphore(0)

    def work() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = fn(i)
            except BaseException as err:  # handed to the caller
                results[i] = err
            left.release()

    for w in range(workers):
        threading.Thread(target=work, name=f"generate-{w}", daemon=True).start()
    for _ in range(n):
        while not left.acquire(timeout=STOP_POLL_S):
            if stop is not None and stop():
                raise RolloutStopped("generation requests abandoned on SIGTERM")
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if r is not None and not isinstance(r, BaseException)]


def generate_resumable(
    targets: Sequence[Target],
    first: int,
    prompt: list[int],
    params: SamplingParams,
    seed: int,
    gate: WeightGate,
    dispatch: Dispatch,
    timeout_s: float,
) -> Generation:
    """One prompt to a complete reply, from ``targets[first]`` on (the module docstring says how)."""
    order = [targets[(first + k) % len(targets)] for k in range(len(targets))]
    at = 0  # the endpoint of order in use; those before it failed this request
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    failures: list[str] = []
    while (left := params.max_new_tokens - len(tokens)) > 0:
        version = gate.wait_open(timeout_s)
        client, endpoint = order[at]
        try:
            part = client._generate_one(endpoint, prompt + tokens, replace(params, max_new_tokens=left), seed, version)
        except RolloutError as err:
            if gate.changed_since(version):
                # The update broke the request (servers that answer an abort with an error): the
                # tokens of this request are lost, those kept before it are not.
                dispatch.resubmitted_one()
                continue
            if not isinstance(err, ServerUnavailable):
                raise  # the request itself is wrong (4xx, a malformed answer): another server would refuse it too
            failures.append(str(err))
            at = _next_endpoint(at, order, failures)
            dispatch.resubmitted_one()
            continue
        tokens += part.tokens
        logprobs += part.logprobs
        versions += [version] * len(part.tokens)
        if part.finish_reason != "abort":
            return Generation(tokens=tokens, logprobs=logprobs, finish_reason=part.finish_reason, versions=versions)
        if not gate.changed_since(version):
            # Aborted with no weight update of ours (the server is shutting down, or someone else
            # aborted it): that server is not serving this request; keep its tokens, try the next.
            failures.append(f"{endpoint} aborted the request outside a weight update")
            at = _next_endpoint(at, order, failures)
        dispatch.resubmitted_one()
    return Generation(tokens=tokens, logprobs=logprobs, finish_reason="length", versions=versions)


def _next_endpoint(at: int, order: Sequence[Target], failures: list[str]) -> int:
    if at + 1 == len(order):
        raise RolloutError(f"every rollout server failed a generation request: {'; '.join(failures)}")
    return at + 1
