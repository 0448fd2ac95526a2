"""The HTTP side shared by the SGLang and vLLM clients: the transport, the API key, retries,
health checks, spreading prompts over servers, and the requests of distributed weight sync."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import sys
import threading
import time
import urllib.parse
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from treetrain.rl.rollout.adapters import AdapterSlots, listed_names, served_version, sync_adapter
from treetrain.rl.rollout.base import (
    _NO_ENDPOINTS,
    UNKNOWN,
    Generation,
    RolloutClient,
    RolloutError,
    SamplingParams,
    Unknown,
)
from treetrain.rl.rollout.gate import WeightGate
from treetrain.rl.rollout.resubmit import Dispatch, ServerUnavailable, spread

_T = TypeVar("_T")
_R = TypeVar("_R")

Transport = Callable[[str, str, dict[str, Any] | None, float], tuple[int, Any]]


# The rollout servers' API key (the operator sets it in trainer and rollout pods from the RLJob's
# Secret): sent as a bearer token on every request when set. SGLang checks it on every route but
# /health* and /metrics, vLLM on its /v1 routes only.
API_KEY_ENV = "TREETRAIN_ROLLOUT_API_KEY"


def auth_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` from :data:`API_KEY_ENV`, or nothing when it is unset or empty."""
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


class DeadlineExceeded(TimeoutError):
    """A request that had no complete answer within its deadline (the whole request, not one read)."""


def http_json(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
    """One JSON request; returns (status, parsed body or text). ``timeout`` bounds the whole
    request, connection to the last byte: a server that trickles its answer is cut off at the
    deadline (:class:`DeadlineExceeded`), where a per-read timeout would wait for ever. Connection
    errors raise OSError (DeadlineExceeded is one). Rollout servers are dialled directly, never
    through an HTTP proxy from the environment."""
    parts = urllib.parse.urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "", parts.port, timeout=timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **auth_headers()}
    expired = threading.Event()
    held: list[socket.socket] = []

    def cut() -> None:  # at the deadline: wake the read blocked on this socket
        expired.set()
        for sock in held:  # the connection's own: http.client drops conn.sock once the answer is read
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()  # bounded by ``timeout`` itself
        held.append(conn.sock)
        if expired.is_set():
            cut()
        conn.request(method, target, body=data, headers=headers)
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
    except (OSError, http.client.HTTPException) as err:
        if expired.is_set():
            raise DeadlineExceeded(f"no complete answer within {timeout:g}s") from None
        if isinstance(err, OSError):
            raise
        raise ConnectionError(f"{type(err).__name__}: {err}") from None  # a torn answer is a connection error
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():
        raise DeadlineExceeded(f"no complete answer within {timeout:g}s")
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _in_parallel(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``fn`` on every item at once, one thread each: a slow server costs its own time, not the sum.
    Every call finishes before the first error (in item order) is raised."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


@dataclass(kw_only=True)
class HTTPRollout(RolloutClient):
    """Shared by the SGLang and vLLM clients: endpoints, retries, health checks."""

    endpoints: list[str]
    timeout_s: float = 600.0
    retries: int = 3
    retry_backoff_s: float = 1.0
    transport: Transport = http_json
    gate: WeightGate = field(default_factory=WeightGate)
    # LoRA adapter sync (treetrain.rl.rollout.adapters): requests name the adapter of their
    # version, and the served version is read from the adapters a server lists. None: full weights.
    adapter: AdapterSlots | None = None
    dispatch: Dispatch = field(default_factory=Dispatch, init=False, repr=False)
    health_path: str = field(default="/health", init=False)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise RolloutError(_NO_ENDPOINTS)
        self.endpoints = [e.rstrip("/") for e in self.endpoints]

    @property
    def resubmitted(self) -> int:
        """Generation requests sent again (interrupted by a weight update, or their server failed)."""
        return self.dispatch.resubmitted

    def call(self, endpoint: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """A request with retries on connection errors and 5xx (then ServerUnavailable); 4xx fails
        at once."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                status, payload = self.transport(method, endpoint + path, body, self.timeout_s)
            except DeadlineExceeded as err:
                # Slow, not down: another try here would cost the whole deadline again. The caller
                # fails over to the next server (a generation) or fails (anything else).
                print(
                    f"rollout: {method} {endpoint}{path}: {err} (trainer.rollout.timeoutSeconds); "
                    "giving up on this server for the request",
                    file=sys.stderr,
                    flush=True,
                )
                raise ServerUnavailable(f"{method} {endpoint}{path} failed: {err}") from None
            except OSError as err:
                last = f"{type(err).__name__}: {err}"
            else:
                if status < 300:
                    return payload
                last = f"HTTP {status}: {str(payload)[:300]}"
                if status < 500:
                    raise RolloutError(f"{method} {endpoint}{path} failed: {last}")
            if attempt < self.retries:
                time.sleep(self.retry_backoff_s * 2**attempt)
        raise ServerUnavailable(f"{method} {endpoint}{path} failed: {last}")

    def optional(self, endpoint: str, method: str, path: str, body: dict[str, Any] | None) -> bool:
        """Like :meth:`call` for a route older servers lack: False when it answers 404."""
        try:
            self.call(endpoint, method, path, body)
        except RolloutError as err:
            if "HTTP 404" in str(err):
                return False
            raise
        return True

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.endpoints)
        while pending:
            still = []
            for ep in pending:
                try:
                    status, _ = self.transport("GET", ep + self.health_path, None, 10.0)
                except OSError:
                    status = 0
                if status != 200:
                    still.append(ep)
            pending = still
            if pending and time.monotonic() > deadline:
                raise RolloutError(f"rollout servers not healthy after {timeout_s:.0f}s: {', '.join(pending)}")
            if pending:
                time.sleep(1.0)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        """Safe to call from several threads at once; every reply is complete (resubmit.py)."""
        return spread(
            self.sync_targets(), self.dispatch, self.gate, prompts, params, seed, self.timeout_s, stop=self.stop
        )

    @abstractmethod
    def _generate_one(
        self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int, version: int = 0
    ) -> Generation:
        """One request in the server's dialect, sampled with the weights of ``version`` (with
        adapter sync: the adapter of that version). A reply cut short by a pause comes back with
        finish_reason "abort" and the tokens sampled so far; ``versions`` is left empty."""

    def _each(self, fn: Callable[[str], None]) -> None:
        _in_parallel(fn, self.endpoints)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        """The weight version the server reports (None: the weights it started with); UNKNOWN when
        it cannot say (then no restart is detected)."""
        return UNKNOWN

    def stale_servers(self, version: int) -> list[str]:
        found = _in_parallel(self._served, self.endpoints)
        return [ep for ep, v in zip(self.endpoints, found, strict=True) if v is not UNKNOWN and v != version]

    def _served(self, endpoint: str) -> int | Unknown | None:
        slots = self.adapter
        return (
            self.loaded_version(endpoint) if slots is None else served_version(self.adapter_versions(endpoint, slots))
        )

    # -- LoRA adapter sync (treetrain.rl.rollout.adapters) ---------------------------------
    def update_adapter(self, path: str, version: int) -> None:
        slots = self.adapter
        if slots is None:
            raise RolloutError("adapter sync asked of a client without adapter slots")
        self._each(lambda ep: sync_adapter(self, ep, path, version, slots))

    def adapter_versions(self, endpoint: str, slots: AdapterSlots) -> list[int]:
        """The versions of our adapter that ``endpoint`` lists (``GET /v1/models``; both servers)."""
        found = (slots.version_of(n) for n in listed_names(self.call(endpoint, "GET", "/v1/models")))
        return sorted(v for v in found if v is not None)

    def load_adapter(self, endpoint: str, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` as ``name``."""
        raise NotImplementedError

    def unload_adapter(self, endpoint: str, name: str) -> None:
        raise NotImplementedError

    def sync_targets(self) -> list[tuple[HTTPRollout, str]]:
        """Every endpoint with the client that speaks its dialect (distributed weight sync)."""
        return [(self, ep) for ep in self.endpoints]

    # -- distributed weight sync: one server's side, in its own API (treetrain.rl.weight_sync) --
    def pause(self, endpoint: str) -> bool:
        """Stop generating for a weight update; False when the server has no pause route."""
        raise NotImplementedError

    def resume(self, endpoint: str) -> None:
        raise NotImplementedError

    def join_group(self, endpoint: str, group: GroupRequest, rank_offset: int) -> None:
        """Ask the server to join the weight-update group (returns once it joined)."""
        raise NotImplementedError

    def leave_group(self, endpoint: str, group: GroupRequest) -> None:
        raise NotImplementedError

    def receive_bucket(self, endpoint: str, bucket: BucketRequest) -> None:
        """Ask the server to receive one broadcast bucket and load it (returns once loaded)."""
        raise NotImplementedError

    def _rpc_ok(self, endpoint: str, what: str, res: Any) -> None:
        if isinstance(res, dict) and res.get("success") is False:
            raise RolloutError(f"{endpoint} could not {what}: {res.get('message')}")


@dataclass(frozen=True, slots=True)
class GroupRequest:
    """The weight-update group as the servers are told it."""

    address: str
    port: int
    world_size: int
    name: str
    backend: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class BucketRequest:
    """One broadcast bucket: its tensors (names, torch dtype names, shapes), in the flat order."""

    group: GroupRequest
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    version: int
    first: bool  # the first bucket of this version
    last: bool  # the last bucket of this version: the servers flush their caches after it


class HTTPHealth(HTTPRollout):
    """Only the health wait, for servers whose kind is not known yet."""

    kind = "unknown"

    def _generate_one(
        self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int, version: int = 0
    ) -> Generation:
        raise RolloutError(f"{endpoint}: its kind is not known yet; probe it first")


def check_weights_dir(path: str) -> None:
    """A Hugging Face weights directory a server can load: config.json, safetensors, and every
    shard its index lists."""
    root = Path(path)
    missing = [] if (root / "config.json").is_file() else ["config.json"]
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing += sorted(n for n in shards if not (root / n).is_file())
    elif not root.is_dir() or not any(root.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise RolloutError(
            f"weights at {path} are incomplete (missing {', '.join(missing)}): not asking the servers to load them"
        )
