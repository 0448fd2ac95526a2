"""A rollout server stand-in: SGLang's HTTP dialect with simulated generation time.

    python bench/rollout_standin.py [--token-delay 0.02] [--vocab 512] [--port 0]

It is NOT SGLang: a threaded stdlib HTTP server on 127.0.0.1 that answers the routes our SGLang
client calls, so the trainer's asynchronous rollout can be measured and tested on a CPU without a
GPU server. No model runs: each request sleeps ``token_delay_s`` per token (a condition wait, so
it costs no CPU and a pause wakes it at once), tokens come from a RNG seeded by the request's
``sampling_seed`` and prompt length, and every log-prob is ``-log(vocab - first_token)`` (a
uniform sampler's), which an untrained model's own log-probs are close to.

Routes: ``/health``, ``/health_generate``, ``/model_info`` and ``/get_model_info``
(``weight_version``: "default" until a load), ``/v1/models`` (so the kind probe says sglang),
``/generate``, ``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``,
``/flush_cache``, and its own ``/standin/stats``. As SGLang does:

- ``/pause_generation`` ``{"mode": "abort"}`` (the default) ends every in-flight ``/generate`` at
  once with the tokens it has and ``finish_reason {"type": "abort"}``; other modes (``in_place``,
  ``retract``) hold in-flight requests until ``/continue_generation`` and then go on;
- requests that arrive while paused wait for ``/continue_generation``;
- ``/update_weights_from_disk`` with ``abort_all_requests`` aborts in-flight requests too, and
  answers ``success: false`` for a path that is not a directory.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from json_http import JSONHandler


class RolloutStandin:
    """One stand-in server on 127.0.0.1 (``port`` 0: a free one); serving once constructed.
    ``max_running`` caps the requests generating at once (a real server's batch: its throughput
    is bounded); the others wait their turn. Unset: no limit.

    ``loads`` lists every accepted weight load as (path, version); ``requests``, ``aborted`` and
    ``tokens`` count ``/generate`` calls, the aborted ones and the tokens returned;
    :meth:`busy_seconds` is the wall time with at least one request generating."""

    def __init__(
        self,
        *,
        token_delay_s: float = 0.01,
        vocab: int = 512,
        first_token: int = 0,
        seed: int = 0,
        load_delay_s: float = 0.0,
        max_running: int | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
    ) -> None:
        if not 0 <= first_token < vocab:
            raise ValueError(f"first_token must be in [0, vocab): got {first_token} with vocab {vocab}")
        self.token_delay_s = token_delay_s
        self.vocab, self.first_token, self.seed = vocab, first_token, seed
        self.load_delay_s = load_delay_s
        self.max_running = max_running
        self.logprob = -math.log(vocab - first_token)
        self.weight_version = "default"
        self.loads: list[tuple[str, str]] = []
        self.requests = self.aborted = 0
        self.started: list[int] = []  # request ids (numbered as they arrive) in the order they started generating
        self._cond = threading.Condition()
        self._paused = False
        self._abort_epoch = 0  # bumped by every abort: a request that saw another epoch stops
        self._runs: list[_Run] = []  # the requests generating now
        self._queue: list[object] = []  # the requests waiting for a place in the running batch, in order
        self._tokens_done = 0  # tokens of the requests that have returned
        self._busy_since = 0.0
        self._busy = 0.0
        self._closed = False
        # host: 127.0.0.1 here; 0.0.0.0 only inside a pod's own network (tests/images/rollout-standin).
        self.server = _Server((host, port), _handler(self))
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="rollout-standin", daemon=True
        )
        self.thread.start()
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.server.server_port}"

    def __enter__(self) -> RolloutStandin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._abort_all()  # in-flight requests answer now rather than after their delay
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    @property
    def active(self) -> int:
        """Requests generating right now."""
        with self._cond:
            return len(self._runs)

    @property
    def tokens(self) -> int:
        """Tokens generated so far, those of requests still running included."""
        with self._cond:
            now = time.monotonic()
            running = (r.done if self._paused else r.made(now, self.token_delay_s) for r in self._runs)
            return self._tokens_done + sum(running)

    def busy_seconds(self) -> float:
        with self._cond:
            return self._busy + (time.monotonic() - self._busy_since if self._runs else 0.0)

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until ``predicate(self)`` holds; re-checked on every change
        of the server's state (a request's end, a pause, a load) and every 50 ms, so tests need
        no sleeps."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    # -- routes -----------------------------------------------------------------------------
    def get(self, path: str) -> tuple[int, Any]:
        if path in ("/health", "/health_generate"):
            return 200, {}
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": "standin", "is_generation": True, "weight_version": self.weight_version}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "standin", "object": "model"}]}
        if path == "/standin/stats":  # the stand-in's own: for a bench that runs it in another process
            stats = {"busy_seconds": self.busy_seconds(), "tokens": self.tokens, "loads": self.loads}
            return 200, {**stats, "requests": self.requests, "aborted": self.aborted}
        return 404, {"detail": "Not Found"}

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        body = body if isinstance(body, dict) else {}
        if path == "/generate":
            return self._generate(body)
        if path == "/pause_generation":
            with self._cond:
                self._settle()
                self._paused = True
                if body.get("mode", "abort") == "abort":
                    self._abort_all()
                self._cond.notify_all()
            return 200, {}
        if path == "/continue_generation":
            with self._cond:
                if self._paused:
                    now = time.monotonic()
                    for run in self._runs:  # held requests go on from here at the same pace
                        run.since = now
                self._paused = False
                self._cond.notify_all()
            return 200, {}
        if path == "/update_weights_from_disk":
            return self._load(body)
        if path == "/flush_cache":
            return 200, {}
        return 404, {"detail": "Not Found"}

    def _load(self, body: dict[str, Any]) -> tuple[int, Any]:
        model_path = str(body.get("model_path", ""))
        if not Path(model_path).is_dir():
            return 400, {"success": False, "message": f"no model at {model_path!r}", "num_paused_requests": 0}
        with self._cond:
            if body.get("abort_all_requests"):
                self._abort_all()
            deadline = time.monotonic() + self.load_delay_s
            while (left := deadline - time.monotonic()) > 0 and not self._closed:
                self._cond.wait(left)
            version = str(body.get("weight_version") or self.weight_version)
            self.weight_version = version
            self.loads.append((model_path, version))
            self._cond.notify_all()
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        prompt = body.get("input_ids")
        if not isinstance(prompt, list) or not prompt:
            return 400, {"error": {"message": "input_ids: a non-empty list of token ids is required"}}
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_new_tokens", 16))
        stops = set(sp.get("stop_token_ids") or ())
        rng = random.Random(f"{self.seed}:{sp.get('sampling_seed', 0)}:{len(prompt)}")
        planned: list[int] = []
        while len(planned) < n and not (planned and planned[-1] in stops):
            planned.append(rng.randrange(self.first_token, self.vocab))
        finish: dict[str, Any] = (
            {"type": "stop", "matched": planned[-1]}
            if planned and planned[-1] in stops
            else {"type": "length", "length": n}
        )
        with self._cond:
            self.requests += 1
            rid = self.requests
            while self._paused and not self._closed:  # SGLang holds requests that come while paused
                self._cond.wait()
            epoch = self._abort_epoch
            # Beyond the running batch a request queues, first come first served (as SGLang's
            # scheduler takes them); an abort ends queued ones too.
            ticket = object()
            self._queue.append(ticket)
            try:
                while (self._paused or self._full() or self._queue[0] is not ticket) and self._abort_epoch == epoch:
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may start
            run = _Run(planned=len(planned), since=time.monotonic())
            self._start(run)
            self.started.append(rid)
            try:
                # One wait per request, not one per token: woken early only by a pause or an abort.
                while run.done < run.planned:
                    if self._abort_epoch != epoch:
                        finish = {"type": "abort", "message": "Abort in waiting queue" if not run.done else "Abort"}
                        self.aborted += 1
                        break
                    if self._paused:  # in_place / retract: hold, then go on at the same pace
                        self._cond.wait()
                        continue
                    left = run.since + (run.planned - run.done) * self.token_delay_s - time.monotonic()
                    if left <= 0:
                        run.done = run.planned
                        break
                    self._cond.wait(left)
            finally:
                self._stop(run)
            version = self.weight_version
        toks = planned[: run.done]
        meta = {
            "id": f"standin-{rid}",
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(toks),
            "weight_version": version,
            "output_token_logprobs": [[self.logprob, t, None] for t in toks],
        }
        return 200, {"text": "", "output_ids": toks, "meta_info": meta}

    def _full(self) -> bool:
        return self.max_running is not None and len(self._runs) >= self.max_running

    def _start(self, run: _Run) -> None:
        if not self._runs:
            self._busy_since = time.monotonic()
        self._runs.append(run)

    def _stop(self, run: _Run) -> None:
        self._runs.remove(run)
        self._tokens_done += run.done
        if not self._runs:
            self._busy += time.monotonic() - self._busy_since
        self._cond.notify_all()

    def _settle(self) -> None:
        """Count the tokens every running request has made by now (before a pause or an abort;
        a paused server's counts stand)."""
        if self._paused:
            return
        now = time.monotonic()
        for run in self._runs:
            run.settle(now, self.token_delay_s)

    def _abort_all(self) -> None:
        self._settle()
        self._abort_epoch += 1
        self._cond.notify_all()


@dataclass(slots=True, eq=False)  # identity: two requests may hold equal counts
class _Run:
    """One generating request: ``done`` of its ``planned`` tokens were made by ``since``."""

    planned: int
    since: float
    done: int = 0

    def made(self, now: float, delay: float) -> int:
        if delay <= 0:
            return self.planned
        return min(self.planned, self.done + int((now - self.since) / delay))

    def settle(self, now: float, delay: float) -> None:
        self.done, self.since = self.made(now, delay), now


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A batch's requests all connect at once: past the default backlog of 5 the kernel drops
    # connection attempts, and each one that is dropped waits a 1 s retransmit.
    request_queue_size = 256


def _handler(standin: RolloutStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(JSONHandler):
        def do_GET(self) -> None:
            self._reply(*standin.get(self.path))

        def do_POST(self) -> None:
            try:
                body = self._body()
            except ValueError:
                self._reply(400, {"error": {"message": "the body is not JSON"}})
                return
            self._reply(*standin.post(self.path, body))

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--token-delay", type=float, default=0.02, help="seconds per generated token")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--first-token", type=int, default=0, help="lowest token id generated")
    ap.add_argument("--load-delay", type=float, default=0.0, help="seconds a weight load takes")
    ap.add_argument("--max-running", type=int, help="requests generated at once; the others wait (a batch limit)")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    standin = RolloutStandin(
        token_delay_s=args.token_delay,
        vocab=args.vocab,
        first_token=args.first_token,
        load_delay_s=args.load_delay,
        max_running=args.max_running,
        port=args.port,
    )
    print(f"rollout stand-in (SGLang dialect) on {standin.url}; Ctrl-C stops it", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        standin.close()


if __name__ == "__main__":
    main()
