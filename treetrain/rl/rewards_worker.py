"""The reward worker server and its workers: the far side of treetrain.rl.rewards_pool.

:func:`main` is started once by the trainer, in a fresh interpreter with the trainer's sys.path
(so none of the trainer's torch, CUDA or threads). It imports what rewards need (math-verify and
sympy, not torch), then forks one worker per request: a fork of this single-threaded process is
safe and takes milliseconds, where a fresh interpreter would import everything again.

The control socket FD (``SOCK_SEQPACKET``: one message per packet) carries:

- server -> trainer, once: ``R`` ready, or ``X`` + a line when the imports failed;
- trainer -> server: ``F`` with a socket attached: fork a worker on it; answered ``P`` + its pid
  (``E`` + a line when the fork failed); ``K`` + pid: kill that worker (the trainer's call on it
  ran past its timeout, or was abandoned);
- end of file: the trainer is gone (it exited, or was killed): every worker is killed and the
  server exits, so none is left behind. A worker dies with the server too (``PR_SET_PDEATHSIG``).

A worker reads ``("load", recipe)`` and ``("score", recipe, completion, row)`` from its socket
and answers ``("ok", None)``, ``("value", float)`` or ``("error", line)``; its own failures and
the reward's are lines, never tracebacks.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

REAP_S = 1.0  # how often the server collects workers that ended on their own


@dataclass(frozen=True)
class Recipe:
    """How a worker makes a reward: what load_reward gets, the row's answer column, and the
    trainer's sys.path (a user's ``package.module`` imports there as in the trainer)."""

    spec: str
    args: dict[str, Any] = field(default_factory=dict)
    answer_field: str = "answer"
    path: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return repr((self.spec, sorted(self.args.items()), self.answer_field, self.path))


def make_reward(recipe: Recipe) -> Any:
    """The reward function ``recipe`` names, imported here."""
    import dataclasses

    from treetrain.rl.rewards import AnswerReward, load_reward

    sys.path[:] = list(recipe.path) or sys.path
    fn = load_reward(recipe.spec, recipe.args)
    return dataclasses.replace(fn, answer_field=recipe.answer_field) if isinstance(fn, AnswerReward) else fn


def outcome(value: Any) -> tuple[str, Any]:
    """A reward's result as the trainer takes it: a finite number, or an error line."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return "value", float(value)
    return "error", f"returned {type(value).__name__} {value!r:.60}, not a finite number"


def error_line(err: BaseException) -> str:
    from treetrain.rl.user_code import first_line

    return f"{type(err).__name__}: {first_line(err)}"


def serve(conn: Any) -> None:
    """A worker's loop: one request at a time until the trainer closes the socket."""
    made: dict[str, Any] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        kind, recipe = request[0], request[1]
        try:
            fn = made.get(recipe.key)
            if fn is None:
                fn = made[recipe.key] = make_reward(recipe)
            answer = ("ok", None) if kind == "load" else outcome(fn(request[2], request[3]))
        except BaseException as err:  # the reward's own code: any failure is a line
            answer = ("error", error_line(err))
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return


def _worker(fd: int) -> None:
    """A forked worker: dies with the server, serves its socket, exits without running the
    server's cleanup (which would kill its siblings)."""
    from multiprocessing.connection import Connection

    try:
        _die_with_parent()
        serve(Connection(fd))
    finally:
        os._exit(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the server ends, however it ends."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the server ended before the call took effect
        os._exit(0)


def _preload() -> bytes:
    """Import and warm what built-in rewards use, once, so every fork has it."""
    try:
        import treetrain.rl.rewards  # noqa: F401
        from treetrain.rl.rewards_math import math_verdict

        math_verdict("1", "1")
    except BaseException as err:
        return b"X" + error_line(err).encode()[:1000]
    return b"R"


def main(argv: list[str]) -> None:
    ctl = socket.socket(fileno=int(argv[0]))
    children: set[int] = set()
    try:
        ctl.send(_preload())
        while True:
            readable, _, _ = select.select([ctl], [], [], REAP_S)
            _reap(children)
            if not readable:
                continue
            msg, fds, _, _ = socket.recv_fds(ctl, 64, 1)
            if not msg:
                return  # the trainer is gone
            if msg[:1] == b"F" and fds:
                _fork(ctl, fds[0], children)
            elif msg[:1] == b"K":
                _kill(int(msg[1:]), children)
            for fd in fds[1:]:
                os.close(fd)
    except OSError:
        return
    finally:
        for pid in list(children):
            _kill(pid, children)


def _fork(ctl: socket.socket, fd: int, children: set[int]) -> None:
    try:
        pid = os.fork()
    except OSError as err:
        os.close(fd)
        ctl.send(b"E" + f"the reward worker server could not fork a worker: {err}".encode())
        return
    if pid == 0:
        ctl.close()
        _worker(fd)
    os.close(fd)
    children.add(pid)
    ctl.send(b"P%d" % pid)


def _kill(pid: int, children: set[int]) -> None:
    """Only a worker of ours not yet collected: its pid cannot have been reused."""
    if pid in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        children.discard(pid)


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)
