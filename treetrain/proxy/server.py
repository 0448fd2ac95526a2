"""The OpenAI-compatible HTTP endpoint with RL sessions (``treetrain proxy``; docs/agents.md).

An agent gets a session (``POST /rl/sessions``), calls ``/v1/chat/completions`` with the
session's key as its API key, and every completion is kept as token ids, the sampler's
log-probs and weight versions (``GET /rl/sessions/{id}/samples``): the trainer trains exactly
the tokens that were sampled. Thread model: the stdlib ``ThreadingHTTPServer`` answers each
connection in its own daemon thread (HTTP/1.1 keep-alive, so the openai SDK's connection pool
works); every generation goes through one :class:`BatchingSampler` worker thread.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from treetrain.proxy.chat import ChatError, ChatRenderer, Reply, Turn, normalize_messages
from treetrain.proxy.sampler import BatchingSampler, Generate, SamplerError
from treetrain.proxy.sessions import ProxyLimits, Refused, SampleRecord, Session, SessionStore
from treetrain.proxy.stats import ProxyStats
from treetrain.rl.rollout import Generation, SamplingParams

DEFAULT_LIMITS = ProxyLimits()
MAX_CHOICES = 8
# A refused body (too large) is discarded, not kept, up to this much (then the connection closes).
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 5.0
SHUTDOWN_POLL_S = 0.05  # how soon close() stops the accept loop
MAX_STOPS = 4
# Local rollout divides the logits by the temperature: 0 would give NaN probabilities. Greedy
# decoding is the limit of a tiny temperature (the top token gets all the mass), and vLLM treats
# temperatures below 1e-5 as greedy as well.
GREEDY_TEMPERATURE = 1e-5
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Errors a retry cannot fix: the openai SDK retries 409 (and 429, 5xx) unless told not to.
_NO_RETRY = {400, 401, 404, 409, 413}


class BadRequest(Refused):
    """A malformed request (400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message)
        self.param = param


class ProxyServer:
    """The proxy, in-process: ``start()`` serves in daemon threads and returns the port; the
    trainer reads samples through :attr:`store` and counters through :attr:`stats`.

    ``admit()``: None admits a new session; a number refuses it with 429 and that Retry-After."""

    def __init__(
        self,
        *,
        generate: Generate,
        renderer: ChatRenderer,
        model_name: str,
        limits: ProxyLimits = DEFAULT_LIMITS,
        admit: Callable[[], float | None] = lambda: None,
        log: Callable[[str], None] | None = None,
        batch_window_s: float = 0.01,
    ) -> None:
        self.renderer = renderer
        self.model_name = model_name
        self.limits = limits
        self.admit = admit
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stats = ProxyStats()
        self.store = SessionStore(limits, stats=self.stats)
        self.sampler = BatchingSampler(generate, window_s=batch_window_s, log=self.log)
        self.created = int(time.time())
        # A Hugging Face fast tokenizer may refuse concurrent calls ("Already borrowed": encode
        # sets its truncation state); rendering takes milliseconds, so the HTTP threads take turns.
        self._tokenizer_lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: any free port) in daemon threads; returns the port."""
        if self._httpd is not None:
            raise RuntimeError(f"the proxy already serves at {self.url}")
        httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        httpd.daemon_threads = True
        self._httpd = httpd
        bound = int(httpd.server_address[1])
        # The URL this process dials (the trainer's own agents): loopback when serving every interface.
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(SHUTDOWN_POLL_S,), name="treetrain-proxy-http", daemon=True
        )
        self._thread.start()
        return bound

    def close(self) -> None:
        """Stop serving and stop the sampler (queued requests fail with 503)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(30.0)
            self._thread = None
        self.sampler.close()

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- routes (each returns (status, JSON body or SSE text, extra headers)) ----------------
    def handle(self, method: str, path: str, headers: Any, body: bytes | None) -> _Response:
        """One request, routed; a :class:`Refused` becomes its status and an OpenAI error body."""
        path = path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        try:
            if parts == ["rl", "sessions"]:
                _allow(method, "POST")
                return self._create_session(_json_body(body, allow_empty=True))
            if parts[:2] == ["v1", "models"] and len(parts) <= 3:
                _allow(method, "GET")
                self._session(headers)
                return self._models(parts[2] if len(parts) == 3 else None)
            if parts == ["v1", "chat", "completions"]:
                _allow(method, "POST")
                session = self._session(headers)
                return self._chat(session, _json_body(body))
            if parts == ["v1", "completions"]:
                _allow(method, "POST")
                session = self._session(headers)
                return self._completions(session, _json_body(body))
            if len(parts) == 4 and parts[:2] == ["rl", "sessions"] and parts[3] in ("reward", "end", "samples"):
                _allow(method, "GET" if parts[3] == "samples" else "POST")
                session = self._session(headers, parts[2])
                if parts[3] == "reward":
                    return self._reward(session, _json_body(body))
                if parts[3] == "end":
                    self.store.end(session.id)
                    return _Response(200, {"id": session.id, "ended": True})
                return self._samples(session)
            raise Refused(404, f"no route {method} {path}: see docs/agents.md for the proxy's routes")
        except Refused as err:
            return _error(err)

    def _session(self, headers: Any, session_id: str | None = None) -> Session:
        auth = str(headers.get("Authorization") or "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Refused(
                401, "missing API key: send Authorization: Bearer <api_key of a session from POST /rl/sessions>"
            )
        session = self.store.authenticate(key.strip())
        if session_id is not None and session.id != session_id:
            raise Refused(404, f"unknown session {session_id!r} for this key")
        return session

    def _create_session(self, body: dict[str, Any]) -> _Response:
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
        meta = body.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise BadRequest("meta must be a JSON object", "meta")
        wait = self.admit()
        if wait is not None:
            raise Refused(429, "the trainer admits no new session now: retry after the Retry-After seconds", wait)
        session = self.store.create(seed=seed, meta=meta)
        return _Response(200, {"id": session.id, "api_key": session.api_key})

    def _models(self, name: str | None) -> _Response:
        model = {"id": name or self.model_name, "object": "model", "created": self.created, "owned_by": "treetrain"}
        return _Response(200, model if name else {"object": "list", "data": [model]})

    def _reward(self, session: Session, body: dict[str, Any]) -> _Response:
        value = body.get("reward")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise BadRequest(f"reward must be a finite number, got {value!r}", "reward")
        cid = body.get("completion_id")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest(f"completion_id must be a string, got {cid!r}", "completion_id")
        self.store.reward(session.id, float(value), cid)
        return _Response(200, {"id": session.id, "reward": float(value), "completion_id": cid})

    def _samples(self, session: Session) -> _Response:
        records = self.store.samples(session.id)
        return _Response(
            200, {"samples": [r.to_json() for r in records], "session_reward": self.store.session_reward(session.id)}
        )

    # -- completions ----------------------------------------------------------------------
    def _chat(self, session: Session, body: dict[str, Any]) -> _Response:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of message objects", "messages")
        opts = _Options(body, self.limits.max_tokens)
        tools, use_tools = _tools(body)
        try:
            normalized = normalize_messages(messages)
            with self._tokenizer_lock:
                prompt = self.renderer.prompt(messages, tools if use_tools else None, self.store.turns(session))
        except ChatError as err:
            raise BadRequest(str(err), "messages") from None
        if prompt.fresh_reason is not None:
            self.stats.fresh_render(prompt.fresh_reason)
        gens, cid, max_new = self._sample(session, prompt.tokens, opts, "chatcmpl")
        choices, turns, records = [], [], []
        for i, gen in enumerate(gens):
            tokens, finish, cut = _stopped(gen, opts.stop, self._text)
            text = self._text(tokens) if cut is None else cut
            with self._tokenizer_lock:
                reply = self.renderer.reply(tokens, finish)
            if reply.tool_calls and not use_tools:  # no tools offered (or tool_choice none): the text as is
                reply = _plain(self._text(tokens), finish)
            if cut is not None:
                reply = _cut(reply, opts.stop)
            message = reply.message()
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            choices.append({"index": i, "message": message, "finish_reason": reply.finish_reason, "logprobs": None})
            turns.append(
                Turn(messages=normalized, reply=normalize_messages([message])[0], tokens=(*prompt.tokens, *tokens))
            )
            records.append(_record(completion_id, prompt.tokens, gen, len(tokens), text))
        self._finish(session, prompt.tokens, gens, max_new, turns, records)
        usage = _usage(len(prompt.tokens), records)
        obj = {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": opts.model or self.model_name,
            "choices": choices,
            "usage": usage,
            "system_fingerprint": None,
        }
        return _chat_stream(obj, opts.include_usage) if opts.stream else _Response(200, obj)

    def _completions(self, session: Session, body: dict[str, Any]) -> _Response:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a list, as the SDK may send it
        vocab = len(self.renderer.tokenizer)
        if isinstance(prompt, str) and prompt:
            with self._tokenizer_lock:
                tokens = self.renderer.render_text_prompt(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t < vocab for t in prompt):
            tokens = [int(t) for t in prompt]  # an id outside the vocabulary would fail the whole batch
        else:
            raise BadRequest(f"prompt must be one non-empty string (or one list of token ids below {vocab})", "prompt")
        opts = _Options(body, self.limits.max_tokens)
        gens, cid, max_new = self._sample(session, tokens, opts, "cmpl")
        choices, records = [], []
        for i, gen in enumerate(gens):
            sampled, finish, cut = _stopped(gen, opts.stop, self._text)
            text = self._text(sampled) if cut is None else cut
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": None})
            records.append(_record(completion_id, tokens, gen, len(sampled), text))
        self._finish(session, tokens, gens, max_new, [], records)
        obj = {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": opts.model or self.model_name,
            "choices": choices,
            "usage": _usage(len(tokens), records),
        }
        return _text_stream(obj, opts.include_usage) if opts.stream else _Response(200, obj)

    def _sample(
        self, session: Session, prompt: list[int], opts: _Options, prefix: str
    ) -> tuple[list[Generation], str, int]:
        call, max_new = self.store.begin(session, len(prompt), opts.n, opts.max_tokens)
        params = SamplingParams(
            max_new_tokens=max_new,
            temperature=opts.temperature or GREEDY_TEMPERATURE,
            top_p=opts.top_p,
            stop_token_ids=tuple(self.renderer.stop_token_ids),
        )
        seed = opts.seed if opts.seed is not None else session.seed + call
        try:
            gens = self.sampler.generate([prompt] * opts.n, params, seed, explicit_seed=opts.seed is not None)
        except SamplerError as err:
            self.store.release(session, opts.n * (len(prompt) + max_new))
            raise Refused(err.status, str(err)) from None
        return gens, f"{prefix}-{secrets.token_hex(12)}", max_new

    def _finish(
        self,
        session: Session,
        prompt: list[int],
        gens: list[Generation],
        max_new: int,
        turns: list[Turn],
        records: list[SampleRecord],
    ) -> None:
        self.store.finish(session, len(gens) * (len(prompt) + max_new), turns, records)
        self.stats.completion_tokens(sum(sum(r.loss_mask) for r in records))

    def _text(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.renderer.tokenizer.decode(tokens, skip_special_tokens=True))


# -- request parsing ------------------------------------------------------------------------
class _Options:
    """The sampling options of one completion request, checked."""

    def __init__(self, body: dict[str, Any], cap: int) -> None:
        self.model = body.get("model")
        if self.model is not None and not isinstance(self.model, str):
            raise BadRequest("model must be a string", "model")
        self.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        self.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if self.top_p == 0.0:
            raise BadRequest("top_p must be > 0 and <= 1", "top_p")
        self.max_tokens = cap  # the default, as ProxyLimits.max_tokens says
        for name in ("max_completion_tokens", "max_tokens"):
            value = body.get(name)
            if value is None:
                continue
            if not _is_int(value) or value < 1:
                raise BadRequest(f"{name} must be an integer >= 1, got {value!r}", name)
            self.max_tokens = min(int(value), cap)  # above the proxy's limit: the limit
            break
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}", "n")
        self.n = int(n)
        self.stop = _stops(body.get("stop"))
        seed = body.get("seed")
        if seed is not None and not _is_int(seed):
            raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
        self.seed: int | None = None if seed is None else int(seed)
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        self.stream = bool(stream)
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise BadRequest("stream_options must be an object", "stream_options")
        self.include_usage = bool(so.get("include_usage", False))


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """(the tools, whether the template gets them and tool calls are parsed)."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("tools must be a list of tool objects", "tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise BadRequest(f"tool_choice must be none, auto, required or a named tool, got {choice!r}", "tool_choice")
    return (tools or None), bool(tools) and choice != "none"


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number from {lo:g} to {hi:g}, got {value!r}", name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_body(body: bytes | None, *, allow_empty: bool = False) -> dict[str, Any]:
    if not body:
        if allow_empty:
            return {}
        raise BadRequest("the request needs a JSON object body")
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(value, dict):
        raise BadRequest(f"the body must be a JSON object, got a JSON {type(value).__name__}")
    return value


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise Refused(405, f"use {allowed} for this route, not {method}")


# -- replies --------------------------------------------------------------------------------
def _stopped(
    gen: Generation, stops: tuple[str, ...], text_of: Callable[[list[int]], str]
) -> tuple[list[int], str, str | None]:
    """(the sampled tokens kept, finish reason, the text cut at the first stop string or None).
    The tokens run up to and including the one where the stop string completes."""
    tokens = list(gen.tokens)
    if not stops:
        return tokens, gen.finish_reason, None
    full = text_of(tokens)
    hits = [i for s in stops if (i := full.find(s)) >= 0]
    if not hits:
        return tokens, gen.finish_reason, None
    at = min(hits)
    lo, hi = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text_of(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo], "stop", full[:at]


def _cut(reply: Reply, stops: tuple[str, ...]) -> Reply:
    content = reply.content
    if content is not None:
        hits = [i for s in stops if (i := content.find(s)) >= 0]
        content = content[: min(hits)] if hits else content
    return Reply(content=content, tool_calls=reply.tool_calls, reasoning=reply.reasoning, finish_reason="stop")


def _plain(text: str, finish: str) -> Reply:
    """A reply without tool parsing (no tools offered, or tool_choice none)."""
    return Reply(content=text, tool_calls=[], reasoning=None, finish_reason="length" if finish == "length" else "stop")


def _record(completion_id: str, prompt: list[int], gen: Generation, kept: int, text: str) -> SampleRecord:
    n = len(prompt)
    versions = list(gen.versions[:kept]) if len(gen.versions) >= kept else [-1] * kept
    return SampleRecord(
        completion_id=completion_id,
        input_ids=[*prompt, *gen.tokens[:kept]],
        loss_mask=[0] * n + [1] * kept,
        logprobs=[0.0] * n + [float(x) for x in gen.logprobs[:kept]],
        versions=[-1] * n + versions,
        reward=None,
        text=text,
    )


def _usage(prompt_len: int, records: list[SampleRecord]) -> dict[str, Any]:
    sampled = sum(sum(r.loss_mask) for r in records)
    return {"prompt_tokens": prompt_len, "completion_tokens": sampled, "total_tokens": prompt_len + sampled}


class _Response:
    """A status, a JSON body (dict) or SSE text (str), and extra headers."""

    def __init__(self, status: int, body: dict[str, Any] | str, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or {}


def _error(err: Refused) -> _Response:
    body = {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES.get(err.status, "invalid_request_error"),
            "param": getattr(err, "param", None),
            "code": err.status,
        }
    }
    headers = {}
    if err.retry_after_s is not None:
        wait = max(0.0, float(err.retry_after_s))
        headers = {"Retry-After": str(math.ceil(wait)), "retry-after-ms": str(int(wait * 1000))}
    if err.status in _NO_RETRY:
        headers["x-should-retry"] = "false"
    return _Response(err.status, body, headers)


def _sse(chunks: list[dict[str, Any]]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _chat_stream(obj: dict[str, Any], include_usage: bool) -> _Response:
    """The whole reply as one delta per choice, then each choice's finish reason (and the usage)."""
    head = {k: obj[k] for k in ("id", "created", "model", "system_fingerprint")} | {"object": "chat.completion.chunk"}
    chunks = []
    for c in obj["choices"]:
        msg = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(msg["tool_calls"])]
        if msg.get("reasoning_content"):
            delta["reasoning_content"] = msg["reasoning_content"]
        chunks.append(
            head | {"choices": [{"index": c["index"], "delta": delta, "finish_reason": None, "logprobs": None}]}
        )
    for c in obj["choices"]:
        chunks.append(
            head
            | {"choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"], "logprobs": None}]}
        )
    if include_usage:
        chunks.append(head | {"choices": [], "usage": obj["usage"]})
    return _Response(200, _sse(chunks))


def _text_stream(obj: dict[str, Any], include_usage: bool) -> _Response:
    head = {k: obj[k] for k in ("id", "created", "model", "object")}
    chunks = [head | {"choices": [{**c, "finish_reason": None}]} for c in obj["choices"]]
    chunks += [
        head | {"choices": [{"index": c["index"], "text": "", "finish_reason": c["finish_reason"], "logprobs": None}]}
        for c in obj["choices"]
    ]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": obj["usage"]})
    return _Response(200, _sse(chunks))


# -- HTTP -----------------------------------------------------------------------------------
def _handler_for(proxy: ProxyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai SDK's httpx pool reuses connections
        server_version = "treetrain-proxy"
        timeout = 300  # an idle keep-alive connection (or a stalled upload) frees its thread
        # Headers and body go out in two writes: with Nagle's algorithm the second waits for the
        # client's delayed ACK (40 ms a response on Linux).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            try:
                body = self._body(method)
                if isinstance(body, _Response):
                    self.close_connection = True  # the unread body must not be parsed as a request
                    self._send(body)
                    self._drain()
                    return
                self._send(proxy.handle(method, self.path, self.headers, body))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                self.close_connection = True  # the client went away: nobody to answer
            except Exception as err:  # one line for a server error, and the server serves on
                proxy.log(f"treetrain proxy: error serving {method} {self.path}: {type(err).__name__}: {err}")
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self._send(_error(Refused(500, f"internal error: {type(err).__name__}: {err}")))

        def _body(self, method: str) -> bytes | _Response | None:
            if method == "GET":
                return None
            length = self.headers.get("Content-Length")
            if length is None:
                if self.headers.get("Transfer-Encoding"):
                    return _error(BadRequest("send the body with a Content-Length (chunked bodies are not read)"))
                return None
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                return _error(BadRequest(f"invalid Content-Length {length!r}"))
            if n > proxy.limits.max_body_bytes:
                return _error(
                    Refused(413, f"the body has {n} bytes, the limit is {proxy.limits.max_body_bytes} (max_body_bytes)")
                )
            return self.rfile.read(n)

        def _drain(self) -> None:
            """Discard what the client still sends (bounded) before closing: closing with unread data
            resets the connection, and the client, still sending its body, would never read the answer."""
            with contextlib.suppress(OSError, ValueError):
                left = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT_BYTES)
                self.connection.settimeout(DRAIN_TIMEOUT_S)
                while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                    left -= len(chunk)

        def _send(self, res: _Response) -> None:
            is_sse = isinstance(res.body, str)
            data = (res.body if isinstance(res.body, str) else json.dumps(res.body)).encode()
            self.send_response(res.status)
            self.send_header("Content-Type", "text/event-stream" if is_sse else "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in res.headers.items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            proxy.stats.response(res.status)
            self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's errors (a malformed request line, an unknown method) in OpenAI's shape."""
            self.close_connection = True
            if self.request_version == "HTTP/0.9":  # an unparsable request line: answer with headers all the same
                self.request_version = "HTTP/1.0"
            with contextlib.suppress(OSError):
                self._send(_error(Refused(code, message or explain or f"HTTP {code}")))

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: no line per request (the counters are in ProxyStats)."""

    return Handler
