"""Remote rollout servers as one client: probing a server's kind, and mixing SGLang and vLLM
servers behind one round-robin."""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.rl.rollout.adapters import AdapterSlots
from treetrain.rl.rollout.base import (
    _NO_ENDPOINTS,
    REMOTE_KINDS,
    Generation,
    RolloutClient,
    RolloutError,
    SamplingParams,
)
from treetrain.rl.rollout.gate import WeightGate
from treetrain.rl.rollout.http import HTTPHealth, HTTPRollout, Transport, _in_parallel, http_json
from treetrain.rl.rollout.resubmit import Dispatch, spread
from treetrain.rl.rollout.sglang import SGLangRollout
from treetrain.rl.rollout.vllm import VLLMRollout


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
        self.dispatch = Dispatch()
        self.gate = WeightGate()  # one for every server: they take each weight update together
        for c in self.clients:
            c.gate = self.gate

    @property
    def vocab_size(self) -> int | None:
        return self.clients[0].vocab_size

    @vocab_size.setter
    def vocab_size(self, n: int | None) -> None:  # each per-kind client parses its own answers
        for c in self.clients:
            c.vocab_size = n

    @property
    def endpoints(self) -> list[str]:
        return [ep for _, ep in self.targets]

    def sync_targets(self) -> list[tuple[HTTPRollout, str]]:
        return list(self.targets)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        timeout_s = max(c.timeout_s for c in self.clients)
        return spread(self.targets, self.dispatch, self.gate, prompts, params, seed, timeout_s, stop=self.stop)

    @property
    def resubmitted(self) -> int:
        """Generation requests sent again (interrupted by a weight update, or their server failed)."""
        return self.dispatch.resubmitted

    def update_weights(self, path: str, version: int) -> None:
        # Every kind at once: the reload takes as long as the slowest server, not the sum of them.
        _in_parallel(lambda c: c.update_weights(path, version), self.clients)

    def update_adapter(self, path: str, version: int) -> None:
        _in_parallel(lambda c: c.update_adapter(path, version), self.clients)

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


def use_adapter(client: RolloutClient, slots: AdapterSlots) -> None:
    """From now on ``client``'s requests name the adapter of their version and its weight syncs
    go through :meth:`RolloutClient.update_adapter` (remote servers only)."""
    clients = client.clients if isinstance(client, MixedRollout) else [client]
    for c in clients:
        if not isinstance(c, HTTPRollout):
            raise RolloutError(f"{client.kind} rollout samples with the trainer's own model: it takes no adapter")
        c.adapter = slots
