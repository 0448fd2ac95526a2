"""The trainer's Prometheus registry: every metric of treetrain.metrics.names, set from a step's
one record (:class:`~treetrain.metrics.record.StepRecord`).

Every value is set on logging steps only, from Python floats that the trainer already synced
(see :meth:`TrainerMetrics.observe_step`); nothing here touches a tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from treetrain.metrics.names import (
    ADAPTER_VERSION,
    CAP_REASONS,
    CLIP_FRACTION,
    DEFAULT_PORT,
    DROP_REASONS,
    EPISODES_CAPPED_TOTAL,
    EVAL_REWARD,
    FRESH_REASONS,
    GRAD_NORM,
    IMPORTANCE_RATIO,
    KL,
    LOSS,
    POLICY_ENTROPY,
    PROXY_FRESH_RENDERS_TOTAL,
    PROXY_REQUESTS_TOTAL,
    PROXY_SESSIONS_OPEN,
    RESPONSE_LENGTH_BUCKETS,
    RESPONSE_LENGTH_TOKENS,
    REWARD,
    REWARD_FAILURE_REASONS,
    REWARD_FAILURES_TOTAL,
    ROLLOUT_BUFFER_GROUPS,
    ROLLOUT_GROUPS_DROPPED_TOTAL,
    ROLLOUT_IDLE_SECONDS_TOTAL,
    ROLLOUT_LOGPROB_MISMATCH,
    ROLLOUT_RESUBMITTED_TOTAL,
    ROLLOUT_STALENESS,
    STALENESS_BUCKETS,
    STEP_BUCKETS,
    STEP_DURATION_SECONDS,
    STEP_TOKENS_PER_SECOND,
    STEPS_TOTAL,
    SYNC_PAYLOADS,
    TOKEN_KINDS,
    TOKENS_TOTAL,
    TRAIN_TOKENS_PER_SECOND,
    TRAINER_IDLE_SECONDS_TOTAL,
    TREE_TOKEN_RATIO,
    WEIGHT_SYNC_BYTES,
    WEIGHT_SYNC_SECONDS,
    WEIGHT_VERSION,
    ZERO_SIGNAL_GROUPS_TOTAL,
)
from treetrain.metrics.record import StepRecord, SyncRecord


class OptionalGauge(Collector):
    """A gauge without labels that has no sample until it is first set: a figure some runs
    never measure (KL without a reference model) is absent, not a misleading 0. Its family
    (help and type) is listed from the start, like a labelled gauge with no child yet."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.value: float | None = None
        registry.register(self)

    def set(self, value: float) -> None:
        self.value = float(value)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation)
        if self.value is not None:
            family.add_metric([], self.value)
        yield family


class TrainerMetrics:
    """The trainer's metrics in their own registry (tests can run several side by side)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.tree_token_ratio = Gauge(
            TREE_TOKEN_RATIO, "Tree tokens / original tokens of the last packed batch (lower is better).", registry=r
        )
        # prometheus_client adds the _total suffix itself.
        self.tokens = Counter(
            TOKENS_TOTAL.removesuffix("_total"),
            "Training tokens by kind: original (unpacked), tree (after prefix sharing), padded (padding).",
            ["kind"],
            registry=r,
        )
        self.step_duration = Histogram(
            STEP_DURATION_SECONDS, "Wall time of one training step.", buckets=STEP_BUCKETS, registry=r
        )
        self.train_tokens_per_second = Gauge(
            TRAIN_TOKENS_PER_SECOND,
            "Original tokens per second of the last step's training part (what the console's train tokens/s shows).",
            registry=r,
        )
        self.step_tokens_per_second = Gauge(
            STEP_TOKENS_PER_SECOND,
            "Original tokens per second of the last whole step (rollout, training and weight sync).",
            registry=r,
        )
        self.steps = Counter(STEPS_TOTAL.removesuffix("_total"), "Training steps completed.", registry=r)
        self.mismatch = Gauge(
            ROLLOUT_LOGPROB_MISMATCH,
            "Absolute difference between the rollout servers' sampling log-probs and the trainer's recomputed "
            "log-probs of the same tokens in the last step (stat: mean or max over response tokens).",
            ["stat"],
            registry=r,
        )
        self.loss = Gauge(LOSS, "Policy loss of the last step.", registry=r)
        self.reward = Gauge(REWARD, "Mean reward of the last step's rollouts.", registry=r)
        self.episodes_capped = Counter(
            EPISODES_CAPPED_TOTAL.removesuffix("_total"),
            "Episodes ended by a cap: reason turns (trainer.maxTurns) or tokens (trainer.maxEpisodeTokens).",
            ["reason"],
            registry=r,
        )
        self.staleness = Histogram(
            ROLLOUT_STALENESS,
            "Per trained sample: the step it was trained at less the weight version its trajectory started from "
            "(0 in synchronous runs; at most trainer.rollout.maxStaleness).",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.buffer_groups = Gauge(ROLLOUT_BUFFER_GROUPS, "Finished rollout groups waiting to be trained.", registry=r)
        self.rollout_idle = Counter(
            ROLLOUT_IDLE_SECONDS_TOTAL.removesuffix("_total"),
            "Seconds the rollout side had nothing to generate (training and weight sync, in synchronous runs).",
            registry=r,
        )
        self.trainer_idle = Counter(
            TRAINER_IDLE_SECONDS_TOTAL.removesuffix("_total"),
            "Seconds the trainer waited for rollouts.",
            registry=r,
        )
        self.groups_dropped = Counter(
            ROLLOUT_GROUPS_DROPPED_TOTAL.removesuffix("_total"),
            "Rollout groups dropped and replaced: reason filtered (dynamic sampling: all rewards equal) or failed "
            "(every server failed the generation).",
            ["reason"],
            registry=r,
        )
        self.resubmitted = Counter(
            ROLLOUT_RESUBMITTED_TOTAL.removesuffix("_total"),
            "Generation requests resubmitted (interrupted by a weight update, or their server failed).",
            registry=r,
        )
        self.weight_version = Gauge(WEIGHT_VERSION, "The weight version the trainer last synced.", registry=r)
        self.sync_seconds = Gauge(
            WEIGHT_SYNC_SECONDS,
            "Wall time of the last weight sync (export and every server's load), by payload: adapter (LoRA "
            "adapter alone) or full (full weights, a merged adapter's included).",
            ["payload"],
            registry=r,
        )
        self.sync_bytes = Gauge(
            WEIGHT_SYNC_BYTES,
            "Bytes each rollout server received in the last weight sync, by payload.",
            ["payload"],
            registry=r,
        )
        self.adapter_version = Gauge(
            ADAPTER_VERSION,
            "The LoRA adapter version every rollout server listed after the last sync (0: the base model, no "
            "adapter; stays 0 without adapter sync).",
            registry=r,
        )
        self.proxy_requests = Counter(
            PROXY_REQUESTS_TOTAL.removesuffix("_total"),
            "Requests the agent proxy answered, by HTTP status code.",
            ["code"],
            registry=r,
        )
        self.proxy_sessions_open = Gauge(PROXY_SESSIONS_OPEN, "Agent proxy sessions open now.", registry=r)
        self.proxy_fresh_renders = Counter(
            PROXY_FRESH_RENDERS_TOTAL.removesuffix("_total"),
            "Chat requests the proxy rendered afresh instead of extending an earlier completion's tokens: reason "
            "edited (the conversation changed an earlier reply) or template (the chat template does not render "
            "incrementally). Fresh renders break prefix sharing.",
            ["reason"],
            registry=r,
        )
        self.reward_failures = Counter(
            REWARD_FAILURES_TOTAL.removesuffix("_total"),
            "Reward calls that failed and scored 0: reason error (the function raised) or timeout "
            "(trainer.rewardTimeoutSeconds).",
            ["reason"],
            registry=r,
        )
        self.eval_reward = Gauge(EVAL_REWARD, "Mean reward of the last evaluation (trainer.eval).", registry=r)
        self.entropy = OptionalGauge(
            POLICY_ENTROPY,
            "Mean entropy (nats) of the policy's next-token distributions over the last step's response tokens.",
            r,
        )
        self.kl = OptionalGauge(
            KL,
            "KL(policy || reference) per response token of the last step (k3 estimate); absent without a "
            "reference model.",
            r,
        )
        self.clip_fraction = OptionalGauge(
            CLIP_FRACTION, "Share of the last step's response tokens whose update the PPO clip cut off.", r
        )
        self.importance_ratio = Gauge(
            IMPORTANCE_RATIO,
            "Importance ratio policy / proximal policy over the last step's response tokens (stat: mean or max).",
            ["stat"],
            registry=r,
        )
        self.grad_norm = OptionalGauge(GRAD_NORM, "Gradient norm of the last step, before clipping.", r)
        self.response_length = Histogram(
            RESPONSE_LENGTH_TOKENS,
            "Tokens of each trained sample's reply (one observation per trained sample).",
            buckets=RESPONSE_LENGTH_BUCKETS,
            registry=r,
        )
        self.zero_signal_groups = Counter(
            ZERO_SIGNAL_GROUPS_TOTAL.removesuffix("_total"),
            "Trained groups whose rewards were all equal: no group-relative learning signal.",
            registry=r,
        )
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind=kind)  # show every series from the first scrape on
        for reason in CAP_REASONS:
            self.episodes_capped.labels(reason=reason)
        for reason in DROP_REASONS:
            self.groups_dropped.labels(reason=reason)
        self.proxy_requests.labels(code="200")  # the other codes appear once answered; runs without agents stay at 0
        for reason in FRESH_REASONS:
            self.proxy_fresh_renders.labels(reason=reason)
        for reason in REWARD_FAILURE_REASONS:
            self.reward_failures.labels(reason=reason)
        for payload in SYNC_PAYLOADS:  # 0 until a sync of that payload (local rollout sends nothing)
            self.sync_seconds.labels(payload=payload)
            self.sync_bytes.labels(payload=payload)
        self._seen: dict[tuple[str, str], float] = {}  # cumulative counts last exported (observe_agents)
        self._server: Any = None

    def observe_step(self, fig: StepRecord) -> None:
        self.tree_token_ratio.set(fig.tree_token_ratio)
        self.tokens.labels(kind="original").inc(fig.original_tokens)
        self.tokens.labels(kind="tree").inc(fig.tree_tokens)
        self.tokens.labels(kind="padded").inc(fig.padded_tokens)
        self.step_duration.observe(fig.seconds)
        self.train_tokens_per_second.set(fig.train_tokens_per_second)
        self.step_tokens_per_second.set(fig.step_tokens_per_second)
        self.steps.inc()
        if fig.mismatch_mean is not None and fig.mismatch_max is not None:
            self.mismatch.labels(stat="mean").set(fig.mismatch_mean)
            self.mismatch.labels(stat="max").set(fig.mismatch_max)
        self.loss.set(fig.loss)
        self.reward.set(fig.reward)
        self.episodes_capped.labels(reason="turns").inc(fig.capped_turns)
        self.episodes_capped.labels(reason="tokens").inc(fig.capped_tokens)
        for staleness in fig.staleness:
            self.staleness.observe(staleness)
        self.buffer_groups.set(fig.buffer_groups)
        self.rollout_idle.inc(fig.rollout_idle_seconds)
        self.trainer_idle.inc(fig.trainer_idle_seconds)
        self.groups_dropped.labels(reason="filtered").inc(fig.dropped_filtered)
        self.groups_dropped.labels(reason="failed").inc(fig.dropped_failed)
        self.resubmitted.inc(fig.resubmitted)
        self.weight_version.set(fig.weight_version)
        for gauge, value in (
            (self.entropy, fig.entropy),
            (self.kl, fig.kl),
            (self.clip_fraction, fig.clip_fraction),
            (self.grad_norm, fig.grad_norm),
        ):
            if value is not None:
                gauge.set(value)
        if fig.ratio_mean is not None and fig.ratio_max is not None:
            self.importance_ratio.labels(stat="mean").set(fig.ratio_mean)
            self.importance_ratio.labels(stat="max").set(fig.ratio_max)
        for length in fig.response_lengths:
            self.response_length.observe(length)
        self.zero_signal_groups.inc(fig.zero_signal_groups)

    def observe_sync(self, sync: SyncRecord | None) -> None:
        """The last weight sync's figures (None: no sync went to servers, as with local rollout)."""
        if sync is None:
            return
        self.sync_seconds.labels(payload=sync.payload).set(sync.seconds)
        self.sync_bytes.labels(payload=sync.payload).set(sync.bytes)
        if sync.adapter_version is not None:
            self.adapter_version.set(sync.adapter_version)

    def observe_agents(self, proxy: dict[str, Any] | None, reward_failures: dict[str, int] | None) -> None:
        """Export the proxy's counters (``ProxyStats.snapshot()``) and the reward runner's failures:
        both are cumulative, so the counters grow by what is new since the last call."""
        if proxy is not None:
            for code, n in proxy.get("requests", {}).items():
                self.proxy_requests.labels(code=str(code)).inc(self._new(("requests", str(code)), n))
            self.proxy_sessions_open.set(proxy.get("sessions_open", 0))
            for reason, n in proxy.get("fresh_renders", {}).items():
                self.proxy_fresh_renders.labels(reason=reason).inc(self._new(("fresh", reason), n))
        for reason, n in (reward_failures or {}).items():
            self.reward_failures.labels(reason=reason).inc(self._new(("reward", reason), n))

    def _new(self, key: tuple[str, str], total: float) -> float:
        before, self._seen[key] = self._seen.get(key, 0.0), float(total)
        return max(0.0, float(total) - before)

    def observe_eval(self, reward: float) -> None:
        self.eval_reward.set(reward)

    def serve(self, port: int = DEFAULT_PORT, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` in a daemon thread; returns the bound port (``port=0``: any free one)."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = (server, thread)
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            if isinstance(thread, threading.Thread):
                thread.join(timeout=5)
            self._server = None
