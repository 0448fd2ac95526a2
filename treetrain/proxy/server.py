"""The OpenAI-compatible HTTP endpoint with RL sessions (``treetrain proxy``; docs/agents.md).

An agent gets a session (``POST /rl/sessions``), calls ``/v1/chat/completions`` (or
``/v1/responses``, ``/v1/completions``) with the session's key as its API key, and every completion
is kept as token ids, the sampler's log-probs and weight versions (``GET /rl/sessions/{id}/samples``):
the trainer trains exactly the tokens that were sampled. This module routes and samples; the
transport (treetrain.proxy.transport), request fields (options), OpenAI shapes (shaping) and the
Responses API (responses) live beside it. Every generation goes through one :class:`BatchingSampler`
worker thread.
"""

from __future__ import annotations

import math
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from treetrain.proxy import responses
from treetrain.proxy.chat import ChatError, ChatRenderer, Turn, normalize_messages
from treetrain.proxy.exposition import CONTENT_TYPE, prometheus_text
from treetrain.proxy.options import (
    BadRequest,
    Options,
    ToolChoice,
    allow,
    chat_logprobs,
    chat_tools,
    check_fields,
    check_response_format,
    completion_logprobs,
    is_int,
    json_body,
)
from treetrain.proxy.sampler import BatchingSampler, Generate, SamplerError
from treetrain.proxy.sessions import ProxyLimits, Refused, SampleRecord, Session, SessionStore
from treetrain.proxy.shaping import (
    Choice,
    Completed,
    TokenText,
    chat_completion,
    chat_stream,
    cut,
    record,
    stopped,
    text_completion,
    text_stream,
    usage,
)
from treetrain.proxy.stats import ProxyStats
from treetrain.proxy.transport import ProxyHTTPServer, Response, error, kernel_backlog
from treetrain.rl.rollout import Generation, SamplingParams

__all__ = ["DEFAULT_LIMITS", "GREEDY_TEMPERATURE", "BadRequest", "ProxyServer"]

DEFAULT_LIMITS = ProxyLimits()
SHUTDOWN_POLL_S = 0.05  # how soon close() stops the accept loop
# Local rollout divides the logits by the temperature: 0 would give NaN probabilities. Greedy
# decoding is the limit of a tiny temperature (the top token gets all the mass), and vLLM treats
# temperatures below 1e-5 as greedy as well.
GREEDY_TEMPERATURE = 1e-5
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
    """The proxy, in-process: ``start()`` serves in daemon threads and returns the port; the
    trainer reads samples through :attr:`store` and counters through :attr:`stats`.

    ``admit()``: None admits a new session; a number refuses it with 429 and that Retry-After.
    ``request_log``: gets one line per answered request (``treetrain proxy`` prints them)."""

    def __init__(
        self,
        *,
        generate: Generate,
        renderer: ChatRenderer,
        model_name: str,
        limits: ProxyLimits = DEFAULT_LIMITS,
        admit: Callable[[], float | None] = lambda: None,
        log: Callable[[str], None] | None = None,
        request_log: Callable[[str], None] | None = None,
        batch_window_s: float = 0.01,
    ) -> None:
        self.renderer = renderer
        self.model_name = model_name
        self.limits = limits
        self.admit = admit
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.request_log = request_log
        self.stats = ProxyStats()
        self.store = SessionStore(limits, stats=self.stats)
        self.sampler = BatchingSampler(
            generate, window_s=batch_window_s, max_batch_tokens=limits.max_batch_tokens, log=self._log
        )
        self.token_text = TokenText(renderer.tokenizer)
        self.created = int(time.time())
        # A Hugging Face fast tokenizer may refuse concurrent calls ("Already borrowed": encode
        # sets its truncation state); rendering takes milliseconds, so the HTTP threads take turns.
        self._tokenizer_lock = threading.RLock()
        self._httpd: ProxyHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def log(self, line: str) -> None:
        self._log(line)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: any free port) in daemon threads; returns the port."""
        if self._httpd is not None:
            raise RuntimeError(f"the proxy already serves at {self.url}")
        httpd = ProxyHTTPServer((host, port), self, backlog=self.limits.max_sessions)
        cap = kernel_backlog()
        if cap is not None and cap < httpd.request_queue_size:
            self._log(
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
        session = self.store.authenticate(key.strip())
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
        wait = self.admit()
        if wait is not None:
            raise Refused(429, "the trainer admits no new session now: retry after the Retry-After seconds", wait)
        session = self.store.create(seed=seed, meta=meta, client=client)
        res = Response(200, {"id": session.id, "api_key": session.api_key})
        res.session_id = session.id
        return res

    def _models(self, name: str | None) -> Response:
        model = {"id": name or self.model_name, "object": "model", "created": self.created, "owned_by": "treetrain"}
        return Response(200, model if name else {"object": "list", "data": [model]})

    def _session_route(self, session: Session, action: str, body: bytes | None) -> Response:
        if action == "end":
            self.store.end(session.id)
            return Response(200, {"id": session.id, "ended": True})
        if action == "samples":
            records = self.store.samples(session.id)
            reward = self.store.session_reward(session.id)
            return Response(200, {"samples": [r.to_json() for r in records], "session_reward": reward})
        fields = json_body(body)
        value = fields.get("reward")
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise BadRequest(f"reward must be a finite number, got {value!r}", "reward")
        cid = fields.get("completion_id")
        if cid is not None and not isinstance(cid, str):
            raise BadRequest(f"completion_id must be a string, got {cid!r}", "completion_id")
        self.store.reward(session.id, float(value), cid)
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
        opts = Options(body, self.limits.max_tokens, ("max_completion_tokens", "max_tokens"))
        done = self.complete_chat(session, messages, tools, choice, opts, "chatcmpl")
        obj = chat_completion(done, opts.model or self.model_name, self.token_text if want_logprobs else None)
        res = Response(200, chat_stream(obj, opts.include_usage) if opts.stream else obj)
        return _counted(res, done.usage)

    def _responses(self, session: Session, body: dict[str, Any]) -> Response:
        call = responses.parse(body, self.limits.max_tokens)
        done = self.complete_chat(session, call.messages, call.tools, call.choice, call.options, "resp")
        obj = responses.response_object(call, done, call.options.model or self.model_name)
        return _counted(Response(200, responses.event_stream(obj) if call.stream else obj), done.usage)

    def complete_chat(
        self,
        session: Session,
        messages: list[Any],
        tools: list[dict[str, Any]] | None,
        choice: ToolChoice,
        opts: Options,
        id_prefix: str,
    ) -> Completed:
        """Render, sample and record a chat request. A forced tool choice appends the template's
        tool-call opening to the prompt: those ids are prompt (not trained), the model samples on."""
        use_tools = bool(tools) and choice.mode != "none"
        try:
            normalized = normalize_messages(messages)
            with self._tokenizer_lock:
                prompt = self.renderer.prompt(messages, tools if use_tools else None, self.store.turns(session))
                opening = self.renderer.call_opening(choice.name)[1] if choice.forced else []
        except ChatError as err:
            raise BadRequest(str(err), "messages") from None
        if prompt.fresh_reason is not None:
            self.stats.fresh_render(prompt.fresh_reason)
        tokens = [*prompt.tokens, *opening]
        gens, cid, max_new = self._sample(session, tokens, opts, id_prefix)
        choices, turns, records = [], [], []
        for i, gen in enumerate(gens):
            sampled, finish, stop_cut = stopped(gen, opts.stop, self._text)
            with self._tokenizer_lock:
                reply = self.renderer.reply([*opening, *sampled], finish, tools=use_tools)
            if stop_cut is not None:
                reply = cut(reply, opts.stop)
            message = reply.message()
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            text = self._text([*opening, *sampled]) if stop_cut is None else self._text(opening) + stop_cut
            choices.append(Choice(reply, sampled, [float(x) for x in gen.logprobs[: len(sampled)]]))
            turns.append(Turn(messages=normalized, reply=normalize_messages([message])[0], tokens=(*tokens, *sampled)))
            records.append(record(completion_id, tokens, gen, len(sampled), text))
        self._finish(session, tokens, gens, max_new, turns, records)
        return Completed(cid, len(tokens), choices, usage(len(tokens), records))

    def _completions(self, session: Session, body: dict[str, Any]) -> Response:
        check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a list, as the SDK may send it
        vocab = len(self.renderer.tokenizer)
        if isinstance(prompt, str) and prompt:
            with self._tokenizer_lock:
                tokens = self.renderer.render_text_prompt(prompt)
        elif isinstance(prompt, list) and prompt and all(is_int(t) and 0 <= t < vocab for t in prompt):
            tokens = [int(t) for t in prompt]  # an id outside the vocabulary would fail the whole batch
        else:
            raise BadRequest(f"prompt must be one non-empty string (or one list of token ids below {vocab})", "prompt")
        want_logprobs = completion_logprobs(body)
        opts = Options(body, self.limits.max_tokens)
        gens, cid, max_new = self._sample(session, tokens, opts, "cmpl")
        choices, records = [], []
        for i, gen in enumerate(gens):
            sampled, finish, stop_cut = stopped(gen, opts.stop, self._text)
            text = self._text(sampled) if stop_cut is None else stop_cut
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            logprobs = self.token_text.legacy(sampled, gen.logprobs[: len(sampled)]) if want_logprobs else None
            choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs})
            records.append(record(completion_id, tokens, gen, len(sampled), text))
        self._finish(session, tokens, gens, max_new, [], records)
        obj = text_completion(cid, opts.model or self.model_name, choices, usage(len(tokens), records))
        res = Response(200, text_stream(obj, opts.include_usage) if opts.stream else obj)
        return _counted(res, obj["usage"])

    def _sample(
        self, session: Session, prompt: list[int], opts: Options, prefix: str
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
        sep = "_" if prefix == "resp" else "-"  # resp_…, as OpenAI's Responses ids look
        return gens, f"{prefix}{sep}{secrets.token_hex(12)}", max_new

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
        self.stats.tokens(len(prompt) * len(records), sum(sum(r.loss_mask) for r in records))

    def _text(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.renderer.tokenizer.decode(tokens, skip_special_tokens=True))


def _counted(res: Response, used: dict[str, Any]) -> Response:
    """The response with its token counts for the request log."""
    res.prompt_tokens, res.completion_tokens = int(used["prompt_tokens"]), int(used["completion_tokens"])
    return res
