"""Reward calls in worker processes that a timeout can stop: the trainer's side.

A reward can hang where no thread could stop it: sympy computing ``9^{9^{9}}`` holds the GIL in
one C call, so a timeout in the trainer's threads never fires and SIGTERM's handler never runs.
:class:`RewardPool` runs each call in a worker process instead, and the trainer only waits on
a socket, in slices, with a deadline; a call past its deadline has its worker killed (and a fresh
one forked for the next call), so a stuck reward costs one timeout, never a core for good.

Workers are forked by a server process started once per pool (treetrain.rl.rewards_worker): a
fresh interpreter without torch or threads, so forking it is safe where forking the trainer is
not, and a new worker costs milliseconds. When the trainer exits, however it exits, the server
sees its socket close, kills its workers and exits: no process is left behind.

:meth:`RewardPool.stop` (the trainer's SIGTERM handler) gives calls in progress ``STOP_GRACE_S``
(as the task's own calls get), then they raise :class:`RewardStopped`; :meth:`RewardPool.close`
ends every process at once.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from treetrain.rl.limits import STOP_GRACE_S, TaskInterrupted
from treetrain.rl.rewards_worker import Recipe

POLL_S = 0.05  # a waiting call looks at SIGTERM's stop this often (an answer wakes it at once)
START_S = 60.0  # the worker server's imports, a fork, a reward module's import: infrastructure, not the reward's time
CLOSE_S = 5.0  # close(): how long the server gets to kill its workers and exit
MAX_WORKERS = max(2, min(8, os.cpu_count() or 2))  # calls at once; more wait for a worker
QUEUE_SLACK_S = 5.0  # a busy worker is free within its call's timeout; this covers its kill and a fork

Outcome = tuple[str, Any]  # ("value", float) or ("error", line)


class RewardTimeout(Exception):
    """A call ran past its timeout (its worker was killed), or found no worker in time."""


class RewardStopped(TaskInterrupted):
    """SIGTERM: the call did not end within the grace."""


class PoolError(Exception):
    """The workers could not be started or ended during a call; the message is one line."""


class _Server:
    """The worker server process and its control socket (see treetrain.rl.rewards_worker)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The trainer's import path, set once the interpreter has started (as the trainer's own
        # was): treetrain, and a `package.module:function`, import there as here.
        path = [p or os.getcwd() for p in sys.path]
        boot = f"import sys; sys.path[:] = {path!r}; from treetrain.rl.rewards_worker import main; main(sys.argv[1:])"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", boot, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the trainer's to handle, not the workers'
            )
        finally:
            theirs.close()
        self.ctl = mine
        self.lock = threading.Lock()
        self.ready = False
        self.broken = False  # a message exchange was cut short: the pool starts another server

    def fork(self, deadline: float, stopped: Callable[[], bool]) -> tuple[int, Connection]:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self.lock:
                try:
                    if not self.ready:
                        answer = self._answer(deadline, stopped)
                        if answer[:1] != b"R":
                            raise PoolError(f"the reward worker server could not start: {answer[1:].decode()}")
                        self.ready = True
                    socket.send_fds(self.ctl, [b"F"], [theirs.fileno()])
                    answer = self._answer(deadline, stopped)
                except (OSError, ValueError) as err:  # the server's socket broke, or was closed by close()
                    self.broken = True
                    raise PoolError(f"the reward worker server failed: {err}") from None
                except BaseException:
                    self.broken = True
                    raise
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        if answer[:1] != b"P":
            mine.close()
            raise PoolError(answer[1:].decode())
        return int(answer[1:]), Connection(mine.detach())

    def _answer(self, deadline: float, stopped: Callable[[], bool]) -> bytes:
        while True:
            if stopped():
                raise RewardStopped("the reward worker server was still starting when SIGTERM's grace ended")
            if time.monotonic() >= deadline:
                raise PoolError(f"the reward worker server did not answer within {START_S:g}s")
            readable, _, _ = select.select([self.ctl], [], [], POLL_S)
            if readable:
                answer = self.ctl.recv(4096)
                if not answer:
                    raise PoolError(f"the reward worker server exited (code {self.proc.wait()})")
                return answer

    def kill(self, pid: int) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.ctl.send(b"K%d" % pid)

    def close(self) -> None:
        """End of file on the control socket: the server kills its workers and exits."""
        with contextlib.suppress(OSError):
            self.ctl.close()
        try:
            self.proc.wait(CLOSE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its workers die with it (PR_SET_PDEATHSIG)
            self.proc.wait()


def _close_all(servers: list[_Server]) -> None:
    for server in servers:
        server.close()
    servers.clear()


@dataclass(eq=False)
class _Worker:
    pid: int
    conn: Connection
    server: _Server
    loaded: set[str] = field(default_factory=set)


class RewardPool:
    """Worker processes for reward calls; see the module docstring. Thread-safe; started on
    first use (or by :meth:`start`), ended by :meth:`close` or when it is collected."""

    def __init__(self, max_workers: int = MAX_WORKERS) -> None:
        self.max_workers = max_workers
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy = 0
        self._servers: list[_Server] = []  # the current one last; closed with the pool
        self._server_lock = threading.Lock()
        self._stop_at: float | None = None  # SIGTERM: calls end by then (a plain store: signal-safe)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._servers)

    def start(self) -> None:
        """Start the worker server now (it imports while the trainer loads its model)."""
        self._server()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM (from its handler): calls in progress, and later ones, end within ``grace_s``."""
        if self._stop_at is None:
            self._stop_at = time.monotonic() + grace_s

    def close(self) -> None:
        """Kill every worker and the server; waiting calls end at once."""
        self._closed = True
        self._stop_at = time.monotonic()
        with self._cond:
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in idle:
            worker.conn.close()
        with self._server_lock:
            self._finalizer()

    def call(self, recipe: Recipe, completion: str, row: dict[str, Any], timeout_s: float) -> Outcome:
        """The reward's outcome for one reply. Raises RewardTimeout past ``timeout_s`` in the
        reward (a wait for a free worker, with ``max_workers`` calls running, gets as long plus
        QUEUE_SLACK_S), PoolError when no worker could run it, RewardStopped after SIGTERM's grace."""
        worker = self._acquire(time.monotonic() + timeout_s + QUEUE_SLACK_S, timeout_s)
        healthy = False
        try:
            if recipe.key not in worker.loaded:  # importing the reward is not the reward's time
                answer = self._exchange(worker, ("load", recipe), START_S, "importing the reward took longer than")
                if answer[0] == "error":
                    healthy = True
                    return answer
                worker.loaded.add(recipe.key)
            try:
                request = pickle.dumps(("score", recipe, completion, row))
            except Exception as err:  # the row holds something pickle cannot carry
                healthy = True
                return "error", f"the row cannot be sent to the reward's worker process: {err}"
            answer = self._exchange(worker, request, timeout_s, "took longer than trainer.rewardTimeoutSeconds")
            healthy = True
            return answer
        finally:
            self._release(worker, healthy)

    # -- the workers -------------------------------------------------------------------------
    def _stopped(self) -> bool:
        return self._stop_at is not None and time.monotonic() >= self._stop_at

    def _acquire(self, deadline: float, timeout_s: float) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError("the reward workers were shut down")
                if self._stopped():
                    raise RewardStopped("reward call not started: the trainer is stopping (SIGTERM)")
                while self._idle:
                    worker = self._idle.pop()
                    server = worker.server
                    current = self._servers[-1] if self._servers else None
                    if server is current and not server.broken and server.proc.poll() is None:
                        self._busy += 1
                        return worker
                    worker.conn.close()  # of a server that ended or was replaced
                if self._busy < self.max_workers:
                    self._busy += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RewardTimeout(
                        f"no reward worker came free within trainer.rewardTimeoutSeconds ({timeout_s:g}s) "
                        f"+ {QUEUE_SLACK_S:g}s: {self.max_workers} calls were running"
                    )
                self._cond.wait(min(left, POLL_S))
        try:
            server = self._server()
            pid, conn = server.fork(time.monotonic() + START_S, self._stopped)
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify()
            raise
        return _Worker(pid, conn, server)

    def _server(self) -> _Server:
        with self._server_lock:
            if self._closed:
                raise PoolError("the reward workers were shut down")
            current = self._servers[-1] if self._servers else None
            if current is None or current.broken or current.proc.poll() is not None:
                if current is not None:
                    current.close()
                    self._servers.remove(current)
                try:
                    self._servers.append(_Server())
                except OSError as err:
                    raise PoolError(f"cannot start the reward worker server: {err}") from None
            return self._servers[-1]

    def _exchange(self, worker: _Worker, request: Any, limit_s: float, late: str) -> Outcome:
        """Send ``request`` (a tuple, or one already pickled), wait for the answer: in slices,
        so SIGTERM's stop is seen, up to ``limit_s``."""
        deadline = time.monotonic() + limit_s
        try:
            if isinstance(request, bytes):
                worker.conn.send_bytes(request)
            else:
                worker.conn.send(request)
            while not worker.conn.poll(POLL_S):
                if self._stopped():
                    raise RewardStopped("reward call stopped by SIGTERM (its worker was killed)")
                if time.monotonic() >= deadline:
                    raise RewardTimeout(f"{late} ({limit_s:g}s); its worker process was killed")
            answer: Outcome = worker.conn.recv()
        except (EOFError, OSError):
            if self._closed:
                raise PoolError("the reward workers were shut down during the call") from None
            raise PoolError("the reward's worker process ended during the call (a crash, or os._exit)") from None
        return answer

    def _release(self, worker: _Worker, healthy: bool) -> None:
        with self._cond:
            self._busy -= 1
            keep = healthy and not self._closed
            if keep:
                self._idle.append(worker)
            self._cond.notify()
        if not keep:
            worker.conn.close()
            if not worker.server.broken:
                worker.server.kill(worker.pid)
