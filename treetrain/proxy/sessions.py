"""RL sessions of the proxy: who may call it (a key per session), what each call cost (a token
budget) and what was sampled (one :class:`SampleRecord` per completion, for the trainer).

Every bound is enforced here so that no client can grow the proxy's memory without limit: open
sessions (``max_sessions``), tokens per session, idle sessions (ended after ``idle_timeout_s``)
and ended sessions whose samples nobody took (the oldest dropped beyond ``4 * max_sessions``).
And so that no one client takes every place: sessions opened over HTTP count per peer address
(``max_sessions_per_client``), and one that starts no completion within ``unused_timeout_s`` of
its creation is ended. The trainer's own sessions (no client) are bound by the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treetrain.proxy.chat import Turn
from treetrain.proxy.stats import ProxyStats

ENDED_KEPT_FACTOR = 4  # ended sessions kept (for their samples) per allowed open session
# What sets a session's token budget, as a refusal names it (the trainer's key, the proxy's field).
BUDGET_NAME = "trainer.maxEpisodeTokens, or treetrain proxy --max-session-tokens"


@dataclass(frozen=True)
class ProxyLimits:
    """Bounds of one proxy. ``max_tokens``: the largest ``max_tokens`` a call may ask (also its default).
    ``max_batch_tokens``: a sampling batch's bound in tokens (treetrain.proxy.sampler); None: none."""

    max_sessions: int = 1024
    max_session_tokens: int = 32768
    idle_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens: int = 512
    max_sessions_per_client: int = 256
    unused_timeout_s: float = 60.0
    max_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"ProxyLimits.max_batch_tokens must be >= 1 or None, got {self.max_batch_tokens}")
        for name in ("max_sessions", "max_session_tokens", "max_body_bytes", "max_tokens", "max_sessions_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProxyLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "unused_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProxyLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SampleRecord:
    """One completion as the trainer trains it: ``loss_mask`` is 1 exactly on its sampled tokens;
    ``logprobs`` are 0.0 and ``versions`` -1 on the prompt. ``text``: the reply's decoded text."""

    completion_id: str
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float | None
    text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "completion_id": self.completion_id,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "reward": self.reward,
        }


class Refused(Exception):
    """A request the store turns down: ``status`` is the HTTP code the server answers with."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class Session:
    """One agent run. Mutable fields change under the store's lock only."""

    id: str
    api_key: str
    seed: int
    meta: dict[str, Any]
    last_used: float
    client: str | None = None  # the peer address that opened it over HTTP; None: the trainer's own
    created: float = 0.0
    ended: bool = False
    calls: int = 0  # completion requests so far: the default seed of call k is seed + k
    tokens: int = 0  # prompt + sampled tokens charged to the budget (reserved while a call runs)
    turns: list[Turn] = field(default_factory=list)
    records: list[SampleRecord] = field(default_factory=list)
    reward: float | None = None  # set by a reward without completion_id


def new_session_id() -> str:
    return f"sess-{secrets.token_hex(12)}"


def new_api_key() -> str:
    return f"sk-sess-{secrets.token_hex(24)}"


def _digest(key: str) -> bytes:
    # Looked up by the key's hash: the dictionary's timing then says nothing about the key itself,
    # and the final comparison is constant-time (hmac.compare_digest).
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


class SessionStore:
    """The sessions of one proxy; every method is thread-safe. ``clock`` is injectable for tests."""

    def __init__(
        self,
        limits: ProxyLimits = ProxyLimits(),
        *,
        stats: ProxyStats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.stats = stats or ProxyStats()
        self.stats.open_sessions = self.open_count
        self._clock = clock
        self._lock = threading.Lock()
        self._open: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._ended: OrderedDict[str, Session] = OrderedDict()  # ended first, first
        self._unused: OrderedDict[str, Session] = OrderedDict()  # clients' open sessions with no call yet, oldest first
        self._per_client: dict[str, int] = {}  # open sessions by peer address
        self._by_key: dict[bytes, str] = {}

    # -- lifecycle ------------------------------------------------------------------------
    def create(
        self, *, seed: int | None = None, meta: dict[str, Any] | None = None, client: str | None = None
    ) -> Session:
        """A new open session; :class:`Refused` (429) when ``max_sessions`` are open, or when
        ``client`` (a peer address) has ``max_sessions_per_client`` open."""
        with self._lock:
            self._expire_idle()
            if len(self._open) >= self.limits.max_sessions:
                raise Refused(
                    429,
                    f"{len(self._open)} sessions are open, the limit (max_sessions); end one or retry later",
                    retry_after_s=1.0,
                )
            bound = self.limits.max_sessions_per_client
            if client is not None and self._per_client.get(client, 0) >= bound:
                raise Refused(
                    429,
                    f"{client} has {bound} sessions open, the limit per client (max_sessions_per_client); "
                    "end one (POST /rl/sessions/{id}/end) or retry later",
                    retry_after_s=1.0,
                )
            now = self._clock()
            session = Session(
                id=new_session_id(),
                api_key=new_api_key(),
                seed=secrets.randbits(31) if seed is None else seed,
                meta=dict(meta or {}),
                last_used=now,
                client=client,
                created=now,
            )
            self._open[session.id] = session
            if client is not None:
                self._per_client[client] = self._per_client.get(client, 0) + 1
                self._unused[session.id] = session
            self._by_key[_digest(session.api_key)] = session.id
            self._changed()
            return session

    def end(self, session_id: str) -> None:
        """End a session (no more completions); its samples stay until :meth:`discard`."""
        with self._lock:
            self._end(self._get(session_id))

    def discard(self, session_id: str) -> None:
        """Forget a session and its samples (the trainer took them). Unknown ids are ignored."""
        with self._lock:
            session = self._open.get(session_id)
            if session is not None:
                self._close(session)
            session = session or self._ended.get(session_id)
            if session is not None:
                self._ended.pop(session_id, None)
                self._by_key.pop(_digest(session.api_key), None)
                self._changed()

    # -- lookups --------------------------------------------------------------------------
    def authenticate(self, api_key: str) -> Session:
        """The session of ``api_key`` (open or ended); :class:`Refused` (401) for any other key."""
        with self._lock:
            self._expire_idle()
            sid = self._by_key.get(_digest(api_key))
            session = None if sid is None else self._open.get(sid) or self._ended.get(sid)
            if session is None or not hmac.compare_digest(session.api_key.encode(), api_key.encode("utf-8", "replace")):
                raise Refused(401, "invalid session key: create a session with POST /rl/sessions and use its api_key")
            if not session.ended:
                session.last_used = self._clock()
                self._open.move_to_end(session.id)
            return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            return self._get(session_id)

    def samples(self, session_id: str) -> list[SampleRecord]:
        with self._lock:
            return list(self._get(session_id).records)

    def session_reward(self, session_id: str) -> float | None:
        with self._lock:
            return self._get(session_id).reward

    def reward(self, session_id: str, value: float, completion_id: str | None = None) -> None:
        """Reward the whole session, or one completion of it (:class:`Refused` 404 if unknown)."""
        with self._lock:
            session = self._get(session_id)
            if completion_id is None:
                session.reward = value
                return
            for i, rec in enumerate(session.records):
                if rec.completion_id == completion_id:
                    session.records[i] = dataclasses.replace(rec, reward=value)
                    return
            raise Refused(404, f"session {session_id} has no completion {completion_id!r}")

    def open_count(self) -> int:
        with self._lock:
            self._expire_idle()
            return len(self._open)

    def __len__(self) -> int:
        """Sessions kept, open and ended."""
        with self._lock:
            return len(self._open) + len(self._ended)

    # -- completions ----------------------------------------------------------------------
    def begin(self, session: Session, prompt_len: int, n: int, max_new_tokens: int) -> tuple[int, int]:
        """Start a completion of ``n`` choices: charge the prompts, reserve their replies and
        return ``(call index, max new tokens)``; the reply length is cut to the budget left.
        :class:`Refused`: 409 when the session ended, 413 when the budget holds no reply."""
        with self._lock:
            if session.ended:
                raise Refused(409, f"session {session.id} has ended: create a new session for more completions")
            budget = self.limits.max_session_tokens
            left = budget - session.tokens
            if prompt_len >= budget:
                raise Refused(
                    413,
                    f"the prompt has {prompt_len} tokens, the session budget is {budget} ({BUDGET_NAME}): shorten it",
                )
            per_choice = left // n - prompt_len
            if per_choice < 1:
                raise Refused(
                    413,
                    f"session {session.id} used {session.tokens} of its {budget} tokens ({BUDGET_NAME}: the prompts "
                    f"and replies of all its calls); a {prompt_len}-token prompt x {n} does not fit: end the episode",
                )
            new_tokens = min(max_new_tokens, per_choice)
            session.tokens += n * (prompt_len + new_tokens)
            call = session.calls
            session.calls += 1
            self._unused.pop(session.id, None)
            session.last_used = self._clock()
            return call, new_tokens

    def finish(
        self,
        session: Session,
        reserved: int,
        turns: Sequence[Turn],
        records: Sequence[SampleRecord],
    ) -> None:
        """Record a completion's turns and samples and give back the unused reservation."""
        with self._lock:
            used = sum(len(r.input_ids) for r in records)
            session.tokens -= reserved - used
            session.turns.extend(turns)
            session.records.extend(records)
            session.last_used = self._clock()

    def release(self, session: Session, reserved: int) -> None:
        """Give back a reservation whose completion failed."""
        with self._lock:
            session.tokens -= reserved

    def turns(self, session: Session) -> list[Turn]:
        with self._lock:
            return list(session.turns)

    # -- inside the lock ------------------------------------------------------------------
    def _get(self, session_id: str) -> Session:
        self._expire_idle()
        session = self._open.get(session_id) or self._ended.get(session_id)
        if session is None:
            raise Refused(404, f"unknown session {session_id!r}: it never existed, was discarded or evicted")
        return session

    def _end(self, session: Session) -> None:
        if session.ended:
            return
        session.ended = True
        self._close(session)
        self._ended[session.id] = session
        kept = ENDED_KEPT_FACTOR * self.limits.max_sessions
        while len(self._ended) > kept:
            _, old = self._ended.popitem(last=False)
            self._by_key.pop(_digest(old.api_key), None)
        self._changed()

    def _close(self, session: Session) -> None:
        """Take an open session out of the open ones and its client's count."""
        if self._open.pop(session.id, None) is None:
            return
        self._unused.pop(session.id, None)
        if session.client is not None:
            left = self._per_client.pop(session.client, 1) - 1
            if left > 0:
                self._per_client[session.client] = left

    def _expire_idle(self) -> None:
        """End the sessions idle past the timeout (the least recently used come first), and the
        clients' sessions that started no completion within ``unused_timeout_s`` (oldest first)."""
        now = self._clock()
        self._end_oldest(self._open, lambda s: s.last_used <= now - self.limits.idle_timeout_s)
        self._end_oldest(self._unused, lambda s: s.created <= now - self.limits.unused_timeout_s)

    def _end_oldest(self, queue: OrderedDict[str, Session], expired: Callable[[Session], bool]) -> None:
        """End the sessions at the front of ``queue`` (oldest first) while they are ``expired``."""
        while queue:
            session = next(iter(queue.values()))
            if not expired(session):
                break
            self._end(session)

    def _changed(self) -> None:
        self.stats.sessions_open(len(self._open))
