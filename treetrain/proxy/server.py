"""The OpenAI-compatible HTTP endpoint with RL sessions (``treetrain proxy``; docs/agents.md).

An agent gets a session (``POST /rl/sessions``), calls ``/v1/chat/completions`` (or
``/v1/responses``, ``/v1/completions``) with the session's key as its API key, and every completion
is kept as token ids, the sampler's log-probs and weight versions (``GET /rl/sessions/{id}/samples``):
the trainer trains exactly the tokens that were sampled. This module is the HTTP side: it routes a
request, checks its fields and gives the answer its OpenAI shape; the RL service
(treetrain.proxy.service) opens sessions, samples, records and rewards, for these routes and for
in-process callers alike. The transport (treetrain.proxy.transport), request fields (options),
OpenAI shapes (shaping) and the Responses API (responses) live beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from treetrain.proxy import responses
from treetrain.proxy.exposition import CONTENT_TYPE, prometheus_text
from treetrain.proxy.options import (
    BadRequest,
    Options,
    allow,
    chat_logprobs,
    chat_tools,
    check_fields,
    check_response_format,
    completion_logprobs,
    is_int,
    json_body,
)
from treetrain.proxy.service import GREEDY_TEMPERATURE, RLService
from treetrain.proxy.sessions import Refused, Session
from treetrain.proxy.shaping import chat_completion, chat_stream, text_completion, text_stream
from treetrain.proxy.transport import ProxyHTTPServer, Response, error, kernel_backlog

__all__ = ["GREEDY_TEMPERATURE", "BadRequest", "ProxyServer", "RLService"]

SHUTDOWN_POLL_S = 0.05  # how soon close() stops the accept loop
SESSION_PREFIX = len("sess-") + 8  # what the request log shows of a session id
_SAMPLING = {"model", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options"}
CHAT_FIELDS = frozenset(
    {*_SAMPLING, "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "logprobs"}
    | {"top_logprobs", "response_format"}
)
COMPLETION_FIELDS = frozenset({*_SAMPLING, "prompt", "max_tokens", "logprobs"})
# The duration histogram's route label, by a path's first two segments.
_ROUTE_LABELS: dict[tuple[str, ...], str] = {("v1", "chat"): "chat_completions", ("v1", "completions"): "completions"}
_ROUTE_LABELS |= {("v1", "responses"): "responses", ("rl", "sessions"): "sessions", ("v1", "models"): "models"}
_ROUTE_LABELS[("metrics",)] = "metrics"


class ProxyServer:
    """The proxy's HTTP side over one :class:`RLService`: ``start()`` serves in daemon threads and
    returns the port. ``request_log``: gets one line per answered request (``treetrain proxy``
    prints them)."""

    def __init__(self, service: RLService, *, request_log: Callable[[str], None] | None = None) -> None:
        self.service = service
        self.stats, self.limits = service.stats, service.limits  # what the transport reads
        self.request_log = request_log
        self.created = int(time.time())
        self._httpd: ProxyHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def log(self, line: str) -> None:
        self.service.log(line)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: any free port) in daemon threads; returns the port."""
        if self._httpd is not None:
            raise RuntimeError(f"the proxy already serves at {self.url}")
        httpd = ProxyHTTPServer((host, port), self, backlog=self.service.limits.max_sessions)
        cap = kernel_backlog()
        if cap is not None and cap < httpd.request_queue_size:
            self.log(
                f"treetrain proxy: the kernel queues at most {cap} connections (net.core.somaxconn), fewer than the "
                f"{httpd.request_queue_size} sessions that may connect at once; a larger burst may be reset: raise it"
            )
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
        """Stop serving and stop the service's sampler (queued requests fail with 503)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(30.0)
            self._thread = None
        self.service.close()

    def __enter__(self) -> ProxyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def observe(self, method: str, path: str, res: Response, seconds: float) -> None:
        """Count an answered request; one log line for it when ``request_log`` is set."""
        parts = tuple(path.strip("/").split("/"))
        route = _ROUTE_LABELS.get(parts[:2], "other")
        self.stats.response(res.status)
        self.stats.request_seconds(route, seconds)
        if self.request_log is not None:
            sid = (res.session_id or "-")[:SESSION_PREFIX]
            self.request_log(
                f"treetrain proxy: {method} {path} {res.status} session={sid} prompt_tokens={res.prompt_tokens} "
                f"completion_tokens={res.completion_tokens} seconds={seconds:.3f}"
            )

    # -- routes ---------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: Any, body: bytes | None, client: str | None = None) -> Response:
        """One request, routed; a :class:`Refused` becomes its status and an OpenAI error body.
        ``client``: the peer address (sessions are bounded per client)."""
        path = path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        session: Session | None = None
        try:
            if parts == ["metrics"]:
                allow(method, "GET")
                res = Response(200, prometheus_text(self.stats))
                res.content_type = CONTENT_TYPE
                return res
            if parts == ["rl", "sessions"]:
                allow(method, "POST")
                return self._create_session(json_body(body, allow_empty=True), client)
            if parts[:2] == ["v1", "models"] and len(parts) <= 3:
                allow(method, "GET")
                self._session(headers)
                return self._models(parts[2] if len(parts) == 3 else None)
            if parts in (["v1", "chat", "completions"], ["v1", "completions"], ["v1", "responses"]):
                allow(method, "POST")
                session = self._session(headers)
                route = {"chat": self._chat, "completions": self._completions, "responses": self._responses}
                res = route[parts[1]](session, json_body(body))
            elif len(parts) == 4 and parts[:2] == ["rl", "sessions"] and parts[3] in ("reward", "end", "samples"):
                allow(method, "GET" if parts[3] == "samples" else "POST")
                session = self._session(headers, parts[2])
                res = self._session_route(session, parts[3], body)
            else:
                raise Refused(404, f"no route {method} {path}: see docs/agents.md for the proxy's routes")
        except Refused as err:
            res = error(err)
        res.session_id = session.id if session is not None else res.session_id
        return res

    def _session(self, headers: Any, session_id: str | None = None) -> Session:
        auth = str(headers.get("Authorization") or "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Refused(
                401, "missing API key: send Authorization: Bearer <api_key of a session from POST /rl/sessions>"
            )
        session = self.service.authenticate(key.strip())
        if session_id is not None and session.id != session_id:
            raise Refused(404, f"unknown session {session_id!r} for this key")
        return session

    def _create_session(self, body: dict[str, Any], client: str | None) -> Response:
        seed = body.get("seed")
        if seed is not None and not is_int(seed):
            raise BadRequest(f"seed must be an integer, got {seed!r}", "seed")
        meta = body.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise BadRequest("meta must be a JSON object", "meta")
        session = self.service.open_session(seed=seed, meta=meta, client=client)
        res = Response(200, {"id": session.id, "api_key": session.api_key})
        res.session_id = session.id
        return res

    def _models(self, name: str | None) -> Response:
        model = {
            "id": name or self.service.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "treetrain",
        }
        return Response(200, model if name else {"object": "list", "data": [model]})

    def _session_route(self, session: Session, action: str, body: bytes | None) -> Response:
        if action == "end":
            self.service.end(session.id)
            return Response(200, {"id": session.id, "ended": True})
        if action == "samples":
            records, reward = self.service.samples(session.id)
            return Response(200, {"samples": [r.to_json() for r in records], "session_reward": reward})
        fields = json_body(body)
        value = fields.get("reward")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise BadRequest(f"reward must be a finite number, got {value!r}", "reward")
        cid = fields.get("completion_id")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest(f"completion_id must be a string, got {cid!r}", "completion_id")
        self.service.reward(session.id, float(value), cid)
        return Response(200, {"id": session.id, "reward": float(value), "completion_id": cid})

    # -- completions ----------------------------------------------------------------------
    def _chat(self, session: Session, body: dict[str, Any]) -> Response:
        check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of message objects", "messages")
        check_response_format(body.get("response_format"))
        want_logprobs = chat_logprobs(body)
        tools, choice = chat_tools(body)
        svc = self.service
        opts = Options(body, svc.limits.max_tokens, ("max_completion_tokens", "max_tokens"))
        done = svc.complete_chat(session, messages, tools, choice, opts, "chatcmpl")
        obj = chat_completion(done, opts.model or svc.model_name, svc.token_text if want_logprobs else None)
        res = Response(200, chat_stream(obj, opts.include_usage) if opts.stream else obj)
        return _counted(res, done.usage)

    def _responses(self, session: Session, body: dict[str, Any]) -> Response:
        svc = self.service
        call = responses.parse(body, svc.limits.max_tokens)
        done = svc.complete_chat(session, call.messages, call.tools, call.choice, call.options, "resp")
        obj = responses.response_object(call, done, call.options.model or svc.model_name)
        return _counted(Response(200, responses.event_stream(obj) if call.stream else obj), done.usage)

    def _completions(self, session: Session, body: dict[str, Any]) -> Response:
        check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        svc = self.service
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a list, as the SDK may send it
        vocab = len(svc.renderer.tokenizer)
        if isinstance(prompt, str) and prompt:
            tokens = svc.render_text(prompt)
        elif isinstance(prompt, list) and prompt and all(is_int(t) and 0 <= t < vocab for t in prompt):
            tokens = [int(t) for t in prompt]  # an id outside the vocabulary would fail the whole batch
        else:
            raise BadRequest(f"prompt must be one non-empty string (or one list of token ids below {vocab})", "prompt")
        want_logprobs = completion_logprobs(body)
        opts = Options(body, svc.limits.max_tokens)
        cid, done, used = svc.complete_text(session, tokens, opts)
        choices = [
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": svc.token_text.legacy(c.tokens, c.logprobs) if want_logprobs else None,
            }
            for i, c in enumerate(done)
        ]
        obj = text_completion(cid, opts.model or svc.model_name, choices, used)
        res = Response(200, text_stream(obj, opts.include_usage) if opts.stream else obj)
        return _counted(res, used)


def _counted(res: Response, used: dict[str, Any]) -> Response:
    """The response with its token counts for the request log."""
    res.prompt_tokens, res.completion_tokens = int(used["prompt_tokens"]), int(used["completion_tokens"])
    return res
