"""Rollout sources: ``local`` (the trainer's own model), ``sglang`` and ``vllm`` servers.

Every source takes token-id prompts and returns token ids plus the sampler's log-probs
(the *behaviour* log-probs decoupled PPO needs). Remote sources reload weights from disk:
the trainer saves Hugging Face weights to a shared path, then asks every server to load
them (SGLang ``/update_weights_from_disk``; vLLM ``/collective_rpc`` ``load_weights_from_disk``
of our worker extension, else vLLM's own ``reload_weights``; both need ``VLLM_SERVER_DEV_MODE=1``
on the server). One job may mix SGLang and vLLM
servers: :func:`remote_client` gives each endpoint a client of its own server's dialect.
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

KINDS = ("local", "sglang", "vllm")
REMOTE_KINDS = ("sglang", "vllm")  # the server kinds :func:`remote_client` builds clients for

_T = TypeVar("_T")
_R = TypeVar("_R")

_NO_ENDPOINTS = "no rollout servers: set rollout.servers or TREETRAIN_ROLLOUT_ENDPOINTS"


class RolloutError(RuntimeError):
    """A rollout server that cannot be reached or answered wrongly."""


class Unknown(enum.Enum):
    """A server that cannot report which weights it holds."""

    UNKNOWN = "unknown"


UNKNOWN = Unknown.UNKNOWN


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str = "length"


class RolloutClient(ABC):
    kind: str

    @abstractmethod
    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        """One generation per prompt, in order."""

    def update_weights(self, path: str, version: int) -> None:  # noqa: B027 - a no-op unless remote
        """Load the weights saved at ``path`` (remote servers); local rollout shares the model."""

    def wait_ready(self, timeout_s: float) -> None:  # noqa: B027
        """Block until every server answers its health check."""

    def close(self) -> None:  # noqa: B027
        """Release connections (nothing to release for plain HTTP requests)."""

    def forget(self) -> None:  # noqa: B027
        """Drop what was kept between the calls of one batch (local rollout: the KV cache)."""

    def stale_servers(self, version: int) -> list[str]:
        """Servers that report weights other than ``version`` (restarted since the last sync)."""
        return []


# -- local ------------------------------------------------------------------------------


class LocalRollout(RolloutClient):
    """Samples with the trainer's model (the embedded default). Every rank must call
    :meth:`generate` together when the model is sharded.

    Between the turns of one batch it keeps the KV cache it ended with: when every prompt of the
    next call extends a sequence it holds (history + reply + the next user turn), only the new
    tokens are read. Identical prompts (the samples of a group) are read once. Any in-place change
    of the weights (an optimizer step, a checkpoint load) or :meth:`forget` drops the cache."""

    kind = "local"

    def __init__(self, model: Any, device: Any) -> None:
        self.model = model
        self.device = device
        # transformers >= 5.2x names the KV cache `cache`; older releases `past_key_values`.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._kept: _KeptCache | None = None
        self.prompt_tokens_read = 0  # prompt tokens the model has run (the tests read it)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        import torch

        if not prompts:
            return []
        gen = torch.Generator().manual_seed(seed)
        kept, self._kept = self._kept, None
        if kept is not None and kept.weights != self._weights():
            kept = None  # the weights changed since: the cached keys and values are stale
        was_training = self.model.training
        self.model.eval()
        try:
            rows = list(prompts)
            with torch.no_grad():
                start = (self._extend(kept, rows) if kept is not None else None) or self._prefill(rows)
                gens, self._kept = self._decode(rows, start, params, gen)
            return gens
        finally:
            self.model.train(was_training)

    def forget(self) -> None:
        self._kept = None

    def _weights(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def _forward(self, ids_BT: Any, mask_BT: Any, pos_BT: Any, cache: Any = None) -> tuple[Any, Any]:
        """(the KV cache, each row's last logits) of one forward over ``ids_BT``."""
        extra = {self._cache_kw: cache} if cache is not None else {}
        res = self.model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True, **extra)
        return _cache_of(res), res.logits[:, -1].float()

    def _prefill(self, prompts: list[list[int]]) -> _Start:
        """Read every distinct prompt once, left-padded: every row's last prompt token sits in the
        last column, pads are masked out and positions count real tokens only, so each row sees
        exactly what it would see alone; then give each prompt its row."""
        import torch

        distinct = list(dict.fromkeys(map(tuple, prompts)))
        row_of = {p: r for r, p in enumerate(distinct)}
        ids_BT, mask_BT = _left_padded([list(p) for p in distinct], self.device)
        pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
        cache, logits_BV = self._forward(ids_BT, mask_BT, pos_BT)
        self.prompt_tokens_read += sum(map(len, distinct))
        rows = torch.tensor([row_of[tuple(p)] for p in prompts], device=self.device)
        if len(distinct) < len(prompts):
            cache.reorder_cache(rows)
        return _Start(cache, mask_BT[rows], pos_BT[rows, -1:], logits_BV[rows])

    def _extend(self, kept: _KeptCache, prompts: list[list[int]]) -> _Start | None:
        """Continue the kept cache: each prompt reads only what follows the kept sequence it
        extends (left-padded again, so the last columns line up). None when one extends none."""
        import torch

        rows = kept.rows_extended_by(prompts)
        if rows is None:
            return None
        index = torch.tensor(rows, device=self.device)
        kept.cache.reorder_cache(index)
        held = [len(kept.seqs[r]) for r in rows]
        ids_BT, new_BT = _left_padded([p[n:] for p, n in zip(prompts, held, strict=True)], self.device)
        pos_BT = torch.tensor(held, device=self.device)[:, None] + (new_BT.cumsum(1) - 1).clamp(min=0)
        mask_BT = torch.cat([kept.mask_BT[index], new_BT], dim=1)
        cache, logits_BV = self._forward(ids_BT, mask_BT, pos_BT, kept.cache)
        self.prompt_tokens_read += sum(len(p) - n for p, n in zip(prompts, held, strict=True))
        return _Start(cache, mask_BT, pos_BT[:, -1:], logits_BV)

    def _decode(
        self, prompts: list[list[int]], start: _Start, params: SamplingParams, gen: Any
    ) -> tuple[list[Generation], _KeptCache]:
        import torch

        cache, mask_BT, pos_B1, logits_BV = start.cache, start.mask_BT, start.pos_B1, start.logits_BV
        b = len(prompts)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        fed = [0] * b  # tokens of each row that the cache holds
        done = [False] * b
        reasons = ["length"] * b
        for step in range(params.max_new_tokens):
            probs_BV = torch.softmax(logits_BV / params.temperature, dim=-1)
            if params.top_p < 1.0:
                probs_BV = _top_p(probs_BV, params.top_p)
            next_B = torch.multinomial(probs_BV.cpu(), 1, generator=gen).squeeze(1)
            # The behaviour log-prob is the model's at temperature 1, as the trainer computes it
            # (and vLLM returns by default): temperature and top-p shape exploration only.
            raw_BV = logits_BV.float()
            picked_B = raw_BV.gather(1, next_B[:, None].to(raw_BV.device)).squeeze(1)
            chosen = (picked_B - torch.logsumexp(raw_BV, dim=-1)).cpu()
            live = [not d for d in done]  # rows whose token this step is theirs
            # Host sync per decoded token: the episode logic needs the tokens on the host anyway.
            for r, (t, lp) in enumerate(zip(next_B.tolist(), chosen.tolist(), strict=True)):
                if done[r]:
                    continue
                toks[r].append(t)
                lps[r].append(lp)
                if t in params.stop_token_ids:
                    done[r], reasons[r] = True, "stop"
            if all(done) or step == params.max_new_tokens - 1:
                break
            # Finished rows keep decoding (the batch keeps one shape), but their tokens are
            # masked out of the cache: it must hold only what the next turn's prompt extends.
            fed = [n + a for n, a in zip(fed, live, strict=True)]
            mask_BT = torch.cat([mask_BT, torch.tensor(live, dtype=mask_BT.dtype, device=self.device)[:, None]], 1)
            pos_B1 = pos_B1 + 1
            cache, logits_BV = self._forward(next_B[:, None].to(self.device), mask_BT, pos_B1, cache)
        gens = [Generation(tokens=t, logprobs=lp, finish_reason=r) for t, lp, r in zip(toks, lps, reasons, strict=True)]
        seqs = [p + t[:n] for p, t, n in zip(prompts, toks, fed, strict=True)]
        return gens, _KeptCache(cache, mask_BT, seqs, self._weights())


@dataclass(slots=True)
class _Start:
    """Where decoding starts: the cache after the prompts, its mask, each row's last position
    and its next-token logits."""

    cache: Any
    mask_BT: Any
    pos_B1: Any
    logits_BV: Any


@dataclass(slots=True)
class _KeptCache:
    """The cache a :meth:`LocalRollout.generate` call ended with: row r holds the keys and values
    of ``seqs[r]`` in the columns where ``mask_BT[r]`` is 1; ``weights`` are the parameters'
    version counters at the time (an in-place update bumps them)."""

    cache: Any
    mask_BT: Any
    seqs: list[list[int]]
    weights: tuple[int, ...]

    def rows_extended_by(self, prompts: list[list[int]]) -> list[int] | None:
        """For each prompt, the longest kept row it strictly extends; None if one extends none."""
        by_len: dict[int, dict[tuple[int, ...], int]] = {}
        for r, seq in enumerate(self.seqs):
            by_len.setdefault(len(seq), {}).setdefault(tuple(seq), r)
        lengths = sorted(by_len, reverse=True)
        rows = []
        for p in prompts:
            row = next((by_len[n][key] for n in lengths if n < len(p) and (key := tuple(p[:n])) in by_len[n]), None)
            if row is None:
                return None
            rows.append(row)
        return rows


def _left_padded(seqs: list[list[int]], device: Any) -> tuple[Any, Any]:
    """(ids, mask) of ``seqs`` right-aligned in one batch; pads are id 0 with mask 0."""
    import torch

    width = max(len(s) for s in seqs)
    ids_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    mask_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids_BT[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask_BT[r, width - len(s) :] = 1
    return ids_BT.to(device), mask_BT.to(device)


def _cache_of(res: Any) -> Any:
    return res["cache"] if "cache" in res else res["past_key_values"]


def _top_p(probs_BV: Any, top_p: float) -> Any:
    import torch

    sorted_BV, order_BV = torch.sort(probs_BV, descending=True, dim=-1)
    keep_BV = torch.cumsum(sorted_BV, -1) - sorted_BV < top_p
    sorted_BV = sorted_BV * keep_BV
    return torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)


# -- HTTP -------------------------------------------------------------------------------

Transport = Callable[[str, str, dict[str, Any] | None, float], tuple[int, Any]]


# The rollout servers' API key (the operator sets it in trainer and rollout pods from the RLJob's
# Secret): sent as a bearer token on every request when set. SGLang checks it on every route but
# /health* and /metrics, vLLM on its /v1 routes only.
API_KEY_ENV = "TREETRAIN_ROLLOUT_API_KEY"


def auth_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` from :data:`API_KEY_ENV`, or nothing when it is unset or empty."""
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_json(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
    """One JSON request; returns (status, parsed body or text). Connection errors raise OSError."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **auth_headers()}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _spread(
    targets: Sequence[_T],
    start: int,
    prompts: Sequence[list[int]],
    seed: int,
    send: Callable[[_T, list[int], int], Generation],
) -> tuple[list[Generation], int]:
    """Round-robin: prompt i goes to ``targets[(start + i) % n]`` with seed ``seed + i``, one request
    per prompt, all at once. Returns the generations in prompt order and where the next call starts
    (so consecutive small batches still reach every server)."""
    jobs = [(targets[(start + i) % len(targets)], prompt, seed + i) for i, prompt in enumerate(prompts)]
    with ThreadPoolExecutor(max_workers=min(64, max(1, len(jobs)))) as pool:
        gens = list(pool.map(lambda job: send(*job), jobs))
    return gens, (start + len(prompts)) % len(targets)


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
    _next: int = field(default=0, init=False)
    health_path: str = field(default="/health", init=False)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise RolloutError(_NO_ENDPOINTS)
        self.endpoints = [e.rstrip("/") for e in self.endpoints]

    def call(self, endpoint: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """A request with retries on connection errors and 5xx; 4xx fails at once."""
        last = ""
        for attempt in range(self.retries + 1):
            try:
                status, payload = self.transport(method, endpoint + path, body, self.timeout_s)
            except OSError as err:
                last = f"{type(err).__name__}: {err}"
            else:
                if status < 300:
                    return payload
                last = f"HTTP {status}: {str(payload)[:300]}"
                if status < 500:
                    break
            if attempt < self.retries:
                time.sleep(self.retry_backoff_s * 2**attempt)
        raise RolloutError(f"{method} {endpoint}{path} failed: {last}")

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
        gens, self._next = _spread(
            self.endpoints, self._next, prompts, seed, lambda ep, p, s: self._generate_one(ep, p, params, s)
        )
        return gens

    @abstractmethod
    def _generate_one(self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int) -> Generation: ...

    def _each(self, fn: Callable[[str], None]) -> None:
        _in_parallel(fn, self.endpoints)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        """The weight version the server reports (None: the weights it started with); UNKNOWN when
        it cannot say (then no restart is detected)."""
        return UNKNOWN

    def stale_servers(self, version: int) -> list[str]:
        found = _in_parallel(self.loaded_version, self.endpoints)
        return [ep for ep, v in zip(self.endpoints, found, strict=True) if v is not UNKNOWN and v != version]

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

    def _generate_one(self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int) -> Generation:
        raise RolloutError(f"{endpoint}: its kind is not known yet; probe it first")


class SGLangRollout(HTTPRollout):
    """SGLang's native API: ``POST /generate`` with ``input_ids`` and ``return_logprob``."""

    kind = "sglang"

    def _generate_one(self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int) -> Generation:
        body = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
                "sampling_seed": seed,
            },
            "return_logprob": True,
            "logprob_start_len": len(prompt),  # log-probs of the output tokens only
            "stream": False,
        }
        out = self.call(endpoint, "POST", "/generate", body)
        try:
            meta = out["meta_info"]
            triples = meta["output_token_logprobs"]  # [logprob, token_id, text-or-null]
            tokens = [int(t[1]) for t in triples]
            logprobs = [float(t[0]) for t in triples]
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
        except (KeyError, TypeError, IndexError) as err:
            raise RolloutError(f"unexpected /generate answer from {endpoint}: {err!r} in {str(out)[:300]}") from None
        if reason == "abort":
            raise RolloutError(f"{endpoint} aborted a generation: {finish}")
        return Generation(tokens=tokens, logprobs=logprobs, finish_reason=reason)

    def update_weights(self, path: str, version: int) -> None:
        # Pause (aborting in-flight requests), load from disk, continue: AReaL's disk-mode order.
        def one(ep: str) -> None:
            # Older servers have no pause route: their weight update then waits for in-flight requests.
            paused = self.optional(ep, "POST", "/pause_generation", {"mode": "abort"})
            try:
                res = self.call(
                    ep,
                    "POST",
                    "/update_weights_from_disk",
                    {"model_path": path, "abort_all_requests": True, "weight_version": str(version)},
                )
                if isinstance(res, dict) and res.get("success") is False:
                    raise RolloutError(f"{ep} could not load weights from {path}: {res.get('message')}")
            finally:
                if paused:
                    self.call(ep, "POST", "/continue_generation", {})

        self._each(one)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        # Both weight updates set it (weight_version); a server starts with "default".
        try:
            info = self.call(endpoint, "GET", "/model_info")
        except RolloutError:
            return UNKNOWN
        version = info.get("weight_version", UNKNOWN) if isinstance(info, dict) else UNKNOWN
        if version is UNKNOWN:
            return UNKNOWN
        return int(version) if str(version).isdigit() else None

    def pause(self, endpoint: str) -> bool:
        return self.optional(endpoint, "POST", "/pause_generation", {"mode": "abort"})

    def resume(self, endpoint: str) -> None:
        self.call(endpoint, "POST", "/continue_generation", {})

    def join_group(self, endpoint: str, group: GroupRequest, rank_offset: int) -> None:
        body = {
            "master_address": group.address,
            "master_port": group.port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
        }
        self._rpc_ok(
            endpoint, "join the weight-update group", self.call(endpoint, "POST", "/init_weights_update_group", body)
        )

    def leave_group(self, endpoint: str, group: GroupRequest) -> None:
        self.call(endpoint, "POST", "/destroy_weights_update_group", {"group_name": group.name})

    def receive_bucket(self, endpoint: str, bucket: BucketRequest) -> None:
        body = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "group_name": bucket.group.name,
            "load_format": "flattened_bucket",  # one flat uint8 tensor per bucket (weight_group.pack)
            "flush_cache": bucket.last,
            "weight_version": str(bucket.version),
        }
        res = self.call(endpoint, "POST", "/update_weights_from_distributed", body)
        self._rpc_ok(endpoint, f"load weights version {bucket.version}", res)


class VLLMRollout(HTTPRollout):
    """vLLM's OpenAI-compatible ``POST /v1/completions`` with token-id prompts and log-probs."""

    kind = "vllm"

    def __init__(self, *, model: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model

    def _generate_one(self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int) -> Generation:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if self.model:
            body["model"] = self.model
        out = self.call(endpoint, "POST", "/v1/completions", body)
        try:
            choice = out["choices"][0]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if choice.get("token_ids") is not None:
                tokens = [int(t) for t in choice["token_ids"]]
            else:  # "token_id:123" strings from return_tokens_as_token_ids
                tokens = [int(str(t).rsplit(":", 1)[1]) for t in choice["logprobs"]["tokens"]]
            reason = choice.get("finish_reason") or "length"
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise RolloutError(
                f"unexpected /v1/completions answer from {endpoint}: {err!r} in {str(out)[:300]}"
            ) from None
        if reason == "abort":
            raise RolloutError(f"{endpoint} aborted a generation")
        return Generation(tokens=tokens, logprobs=logprobs, finish_reason=reason)

    def update_weights(self, path: str, version: int) -> None:
        # vLLM has no disk-reload route; its dev-mode collective_rpc calls a method of the workers.
        # A path it cannot load answers 500 and leaves the server broken: check it first.
        check_weights_dir(path)

        def one(ep: str) -> None:
            # /pause and /resume came after /collective_rpc: without them the reload runs unpaused.
            paused = self.optional(ep, "POST", "/pause?mode=keep", None)
            try:
                # Our worker extension loads the directory as it loads a broadcast, exactly, and
                # records the version (restarts show); vLLM's own reload_weights leaves a tied
                # lm_head stale on CPU (see vllm_worker.with_tied).
                if self._try_rpc(ep, "loaded_weight_version", {})[0]:
                    body = {"method": "load_weights_from_disk", "kwargs": {"weights_path": path, "version": version}}
                else:
                    body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
                self.call(ep, "POST", "/collective_rpc", body)
                # Cached prefixes hold keys and values of the old weights (the real server served them).
                self.call(ep, "POST", "/reset_prefix_cache", None)
            finally:
                if paused:
                    self.call(ep, "POST", "/resume", None)

        self._each(one)

    def pause(self, endpoint: str) -> bool:
        return self.optional(endpoint, "POST", "/pause?mode=keep", None)

    def resume(self, endpoint: str) -> None:
        # Cached prefixes hold keys and values of the old weights: drop them before sampling again.
        self.call(endpoint, "POST", "/reset_prefix_cache", None)
        self.call(endpoint, "POST", "/resume", None)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        ok, res = self._try_rpc(endpoint, "loaded_weight_version", {})
        if not ok or not isinstance(res, dict) or not res.get("results"):
            return UNKNOWN  # no worker extension: the server cannot say
        # vLLM answers every result but None, lists and dicts as a string: "3".
        versions = {int(v) if str(v).isdigit() else None for v in res["results"]}
        return versions.pop() if len(versions) == 1 else None  # workers that disagree: send them all again

    def _try_rpc(self, endpoint: str, method: str, kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """One ``/collective_rpc`` without retries: (False, None) when it fails (no such method)."""
        try:
            status, res = self.transport(
                "POST", endpoint + "/collective_rpc", {"method": method, "kwargs": kwargs}, 30.0
            )
        except OSError:
            return False, None
        return status == 200, res

    def _rpc(self, endpoint: str, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """One method of our worker extension on every worker of the server (``/collective_rpc``)."""
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        return self.call(endpoint, "POST", "/collective_rpc", body)

    def join_group(self, endpoint: str, group: GroupRequest, rank_offset: int) -> None:
        kwargs = {
            "address": group.address,
            "port": group.port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
            "timeout_s": group.timeout_s,
        }
        self._rpc(endpoint, "join_weight_group", kwargs, group.timeout_s)

    def leave_group(self, endpoint: str, group: GroupRequest) -> None:
        self._rpc(endpoint, "leave_weight_group", {}, group.timeout_s)

    def receive_bucket(self, endpoint: str, bucket: BucketRequest) -> None:
        kwargs = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "version": bucket.version,
            "first": bucket.first,
            "last": bucket.last,
        }
        self._rpc(endpoint, "receive_weights", kwargs, bucket.group.timeout_s)


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


def probe_kind(endpoint: str, transport: Transport = http_json) -> str:
    """``sglang`` when the server answers ``/model_info`` (vLLM has no such route), else ``vllm``."""
    ep = endpoint.rstrip("/")
    for path in ("/model_info", "/get_model_info"):
        try:
            status, _ = transport("GET", ep + path, None, 10.0)
        except OSError:
            continue
        if status == 200:
            return "sglang"
    try:
        status, _ = transport("GET", ep + "/v1/models", None, 10.0)
    except OSError as err:
        raise RolloutError(f"cannot reach rollout server {ep}: {err}") from None
    if status == 200:
        return "vllm"
    raise RolloutError(f"{ep} is neither an SGLang nor a vLLM server; set trainer.rollout.kind")


def detect_kind(endpoints: Sequence[str], transport: Transport = http_json) -> str:
    """The kind of the first server (see :func:`probe_kind`). Servers that may differ go through
    :func:`remote_client`, which probes each one."""
    if not endpoints:
        raise RolloutError(_NO_ENDPOINTS)
    return probe_kind(endpoints[0], transport)


class MixedRollout(RolloutClient):
    """Servers of several kinds behind one client. Prompts go round-robin over every endpoint, each
    request in its server's dialect (through the per-kind client that holds that endpoint); weight
    updates, health checks, :meth:`close` and :meth:`forget` go to every per-kind client."""

    def __init__(self, clients: Sequence[HTTPRollout]) -> None:
        if not clients:
            raise RolloutError(_NO_ENDPOINTS)
        self.clients = list(clients)
        self.kind = "+".join(c.kind for c in self.clients)
        # Every endpoint paired with the client that speaks its server's dialect.
        self.targets = [(c, ep) for c in self.clients for ep in c.endpoints]
        self._next = 0

    @property
    def endpoints(self) -> list[str]:
        return [ep for _, ep in self.targets]

    def sync_targets(self) -> list[tuple[HTTPRollout, str]]:
        return list(self.targets)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        gens, self._next = _spread(
            self.targets, self._next, prompts, seed, lambda t, p, s: t[0]._generate_one(t[1], p, params, s)
        )
        return gens

    def update_weights(self, path: str, version: int) -> None:
        # Every kind at once: the reload takes as long as the slowest server, not the sum of them.
        _in_parallel(lambda c: c.update_weights(path, version), self.clients)

    def wait_ready(self, timeout_s: float) -> None:
        # At once, so the servers share one deadline rather than each kind getting timeout_s in turn.
        _in_parallel(lambda c: c.wait_ready(timeout_s), self.clients)

    def stale_servers(self, version: int) -> list[str]:
        return [ep for found in _in_parallel(lambda c: c.stale_servers(version), self.clients) for ep in found]

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def forget(self) -> None:
        for c in self.clients:
            c.forget()


def remote_client(
    servers: Sequence[tuple[str, str]],
    *,
    timeout_s: float = 600.0,
    retries: int = 3,
    model: str = "",
    ready_timeout_s: float | None = None,
    transport: Transport = http_json,
) -> RolloutClient:
    """The client for rollout ``servers`` given as ``(url, kind)`` with kind ``sglang``, ``vllm`` or
    ``auto`` (probe that server alone). When all are of one kind: a plain :class:`SGLangRollout` or
    :class:`VLLMRollout` over every url; otherwise a :class:`MixedRollout`. ``model`` is vLLM's
    served model name. A url listed twice is served once (else it would reload weights twice).
    With ``ready_timeout_s``, "auto" servers are first given that long to answer ``/health``
    (both kinds serve it), so a server still loading its model is probed once it is up."""
    if not servers:
        raise RolloutError(_NO_ENDPOINTS)
    valid = (*REMOTE_KINDS, "auto")
    for url, kind in servers:
        if kind not in valid:
            raise RolloutError(f"unknown rollout kind {kind!r} for {url}: expected one of {', '.join(valid)}")
        if not url.strip("/ "):
            raise RolloutError(f"empty rollout endpoint url in {[u for u, _ in servers]}")
    # Probe each "auto" server on its own, all at once: a dead one costs its timeout once.
    auto = list(dict.fromkeys(url.rstrip("/") for url, kind in servers if kind == "auto"))
    if auto and ready_timeout_s:
        HTTPHealth(endpoints=auto, transport=transport).wait_ready(ready_timeout_s)
    probed = dict(zip(auto, _in_parallel(lambda ep: probe_kind(ep, transport), auto), strict=True))

    by_kind: dict[str, list[str]] = {k: [] for k in REMOTE_KINDS}  # KINDS order: a stable "sglang+vllm"
    seen: dict[str, str] = {}
    for url, given in servers:
        ep = url.rstrip("/")
        kind = probed[ep] if given == "auto" else given
        if ep in seen:
            if seen[ep] != kind:
                raise RolloutError(f"rollout server {ep} is listed as both {seen[ep]} and {kind}")
            continue
        seen[ep] = kind
        by_kind[kind].append(ep)

    def client(kind: str, eps: list[str]) -> HTTPRollout:
        if kind == "sglang":
            return SGLangRollout(endpoints=eps, timeout_s=timeout_s, retries=retries, transport=transport)
        return VLLMRollout(endpoints=eps, timeout_s=timeout_s, retries=retries, transport=transport, model=model)

    clients = [client(kind, eps) for kind, eps in by_kind.items() if eps]
    return clients[0] if len(clients) == 1 else MixedRollout(clients)
