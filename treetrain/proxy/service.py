"""The RL service of the proxy: sessions, completions recorded as training samples, rewards.

One object serves both callers: the HTTP routes (treetrain.proxy.server, which add the OpenAI
shapes) and in-process callers (the trainer's agent runs, which open their sessions and take
their samples here, not over HTTP). Every generation goes through one :class:`BatchingSampler`
worker thread, so concurrent sessions' requests share generate calls.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treetrain.proxy.chat import ChatError, ChatRenderer, Turn, normalize_messages
from treetrain.proxy.options import BadRequest, Options, ToolChoice
from treetrain.proxy.sampler import BatchingSampler, Generate, SamplerError
from treetrain.proxy.sessions import ProxyLimits, Refused, SampleRecord, Session, SessionStore
from treetrain.proxy.shaping import Choice, Completed, TokenText, cut, record, stopped, usage
from treetrain.proxy.stats import ProxyStats
from treetrain.rl.rollout import Generation, SamplingParams

DEFAULT_LIMITS = ProxyLimits()
# Local rollout divides the logits by the temperature: 0 would give NaN probabilities. Greedy
# decoding is the limit of a tiny temperature (the top token gets all the mass), and vLLM treats
# temperatures below 1e-5 as greedy as well.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TextChoice:
    """One sampled reply of a text completion: the tokens kept (after a stop string), its text,
    why it ended, and the kept tokens' log-probs."""

    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]


class RLService:
    """See the module docstring. ``admit()``: None admits a new session; a number refuses it with
    429 and that Retry-After (the trainer's bound on runs in flight)."""

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
        self.renderer, self.model_name, self.limits, self.admit = renderer, model_name, limits, admit
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.stats = ProxyStats()
        self.store = SessionStore(limits, stats=self.stats)
        self.sampler = BatchingSampler(
            generate, window_s=batch_window_s, max_batch_tokens=limits.max_batch_tokens, log=self.log
        )
        self.token_text = TokenText(renderer.tokenizer)
        # A Hugging Face fast tokenizer may refuse concurrent calls ("Already borrowed": encode
        # sets its truncation state); rendering takes milliseconds, so callers take turns.
        self._tokenizer_lock = threading.RLock()

    def close(self) -> None:
        """Stop the sampler (queued requests fail with 503)."""
        self.sampler.close()

    # -- sessions -------------------------------------------------------------------------
    def open_session(
        self, *, seed: int | None = None, meta: dict[str, Any] | None = None, client: str | None = None
    ) -> Session:
        """A new session for a caller over HTTP (``client``: its address); :class:`Refused` (429)
        at a bound or while the trainer admits none."""
        wait = self.admit()
        if wait is not None:
            raise Refused(429, "the trainer admits no new session now: retry after the Retry-After seconds", wait)
        return self.store.create(seed=seed, meta=meta, client=client)

    def open_waiting(self, seed: int, wait_s: float) -> Session | str:
        """A session of the trainer's own (no admission: the trainer bounds its runs itself); at
        the session bound, wait as each refusal says (at most a second a try) for up to
        ``wait_s``. Returns the last refusal's message when the wait ran out."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.store.create(seed=seed)
            except Refused as err:
                if time.monotonic() >= deadline:
                    return err.message
                time.sleep(min(err.retry_after_s or 0.5, 1.0))

    def authenticate(self, api_key: str) -> Session:
        return self.store.authenticate(api_key)

    def end(self, session_id: str) -> None:
        self.store.end(session_id)

    def discard(self, session_id: str) -> None:
        """Forget a session and its samples (their taker has them)."""
        self.store.discard(session_id)

    def reward(self, session_id: str, value: float, completion_id: str | None = None) -> None:
        self.store.reward(session_id, value, completion_id)

    def samples(self, session_id: str) -> tuple[list[SampleRecord], float | None]:
        """The session's samples (one per completion) and its session reward (None: none posted)."""
        return self.store.samples(session_id), self.store.session_reward(session_id)

    # -- completions ----------------------------------------------------------------------
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
            sampled, finish, stop_cut = stopped(gen, opts.stop, self.text)
            with self._tokenizer_lock:
                reply = self.renderer.reply([*opening, *sampled], finish, tools=use_tools)
            if stop_cut is not None:
                reply = cut(reply, opts.stop)
            message = reply.message()
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            text = self.text([*opening, *sampled]) if stop_cut is None else self.text(opening) + stop_cut
            choices.append(Choice(reply, sampled, [float(x) for x in gen.logprobs[: len(sampled)]]))
            turns.append(Turn(messages=normalized, reply=normalize_messages([message])[0], tokens=(*tokens, *sampled)))
            records.append(record(completion_id, tokens, gen, len(sampled), text))
        self._finish(session, tokens, gens, max_new, turns, records)
        return Completed(cid, len(tokens), choices, usage(len(tokens), records))

    def render_text(self, prompt: str) -> list[int]:
        with self._tokenizer_lock:
            return list(self.renderer.render_text_prompt(prompt))

    def complete_text(
        self, session: Session, tokens: list[int], opts: Options
    ) -> tuple[str, list[TextChoice], dict[str, Any]]:
        """Sample and record a text completion of ``tokens``: (its id, the choices, the usage)."""
        gens, cid, max_new = self._sample(session, tokens, opts, "cmpl")
        choices, records = [], []
        for i, gen in enumerate(gens):
            sampled, finish, stop_cut = stopped(gen, opts.stop, self.text)
            text = self.text(sampled) if stop_cut is None else stop_cut
            completion_id = cid if len(gens) == 1 else f"{cid}-{i}"
            choices.append(TextChoice(sampled, text, finish, [float(x) for x in gen.logprobs[: len(sampled)]]))
            records.append(record(completion_id, tokens, gen, len(sampled), text))
        self._finish(session, tokens, gens, max_new, [], records)
        return cid, choices, usage(len(tokens), records)

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

    def text(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.renderer.tokenizer.decode(tokens, skip_special_tokens=True))
