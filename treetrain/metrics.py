"""Trainer metrics: the names docs/contracts.md fixes, in one place, and a Prometheus registry.

Dashboards (charts/, dashboards/) are built on exactly these names: change one here and
there at once. Every value is set on logging steps only, from Python floats that the
trainer already synced (see :meth:`TrainerMetrics.observe_step`); nothing here touches a
tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TREE_TOKEN_RATIO = "treetrain_tree_token_ratio"
TOKENS_TOTAL = "treetrain_tokens_total"
STEP_DURATION_SECONDS = "treetrain_step_duration_seconds"
TRAIN_TOKENS_PER_SECOND = "treetrain_train_tokens_per_second"
STEP_TOKENS_PER_SECOND = "treetrain_step_tokens_per_second"
STEPS_TOTAL = "treetrain_steps_total"
ROLLOUT_LOGPROB_MISMATCH = "treetrain_rollout_logprob_mismatch"
LOSS = "treetrain_loss"
REWARD = "treetrain_reward"
EPISODES_CAPPED_TOTAL = "treetrain_episodes_capped_total"
# Asynchronous rollout (exported by every run, synchronous ones too, so every panel has data).
ROLLOUT_STALENESS = "treetrain_rollout_staleness"
ROLLOUT_BUFFER_GROUPS = "treetrain_rollout_buffer_groups"
ROLLOUT_IDLE_SECONDS_TOTAL = "treetrain_rollout_idle_seconds_total"
TRAINER_IDLE_SECONDS_TOTAL = "treetrain_trainer_idle_seconds_total"
ROLLOUT_GROUPS_DROPPED_TOTAL = "treetrain_rollout_groups_dropped_total"
ROLLOUT_RESUBMITTED_TOTAL = "treetrain_rollout_resubmitted_total"
WEIGHT_VERSION = "treetrain_weight_version"
# Agents and datasets: rank 0's OpenAI-compatible proxy, the reward function, evaluation.
PROXY_REQUESTS_TOTAL = "treetrain_proxy_requests_total"
PROXY_SESSIONS_OPEN = "treetrain_proxy_sessions_open"
PROXY_FRESH_RENDERS_TOTAL = "treetrain_proxy_fresh_renders_total"
# Served by the proxy's own GET /metrics only (`treetrain proxy`), not by the trainer's registry.
PROXY_PROMPT_TOKENS_TOTAL = "treetrain_proxy_prompt_tokens_total"
PROXY_COMPLETION_TOKENS_TOTAL = "treetrain_proxy_completion_tokens_total"
PROXY_REQUEST_DURATION_SECONDS = "treetrain_proxy_request_duration_seconds"
REWARD_FAILURES_TOTAL = "treetrain_reward_failures_total"
EVAL_REWARD = "treetrain_eval_reward"
# What an RL user watches per step: the policy, the update, the replies, the groups' signal.
POLICY_ENTROPY = "treetrain_policy_entropy"
KL = "treetrain_kl"
CLIP_FRACTION = "treetrain_clip_fraction"
IMPORTANCE_RATIO = "treetrain_importance_ratio"
GRAD_NORM = "treetrain_grad_norm"
RESPONSE_LENGTH_TOKENS = "treetrain_response_length_tokens"
ZERO_SIGNAL_GROUPS_TOTAL = "treetrain_zero_signal_groups_total"

# Label values of TOKENS_TOTAL{kind=...}: savings over a window are 1 - rate(tree) / rate(original).
TOKEN_KINDS = ("original", "tree", "padded")
# Label values of EPISODES_CAPPED_TOTAL{reason=...}: trainer.maxTurns, trainer.maxEpisodeTokens.
CAP_REASONS = ("turns", "tokens")
# Label values of ROLLOUT_GROUPS_DROPPED_TOTAL{reason=...}: dynamic sampling (all rewards equal),
# or a generation that failed on every server.
DROP_REASONS = ("filtered", "failed")
# Label values of PROXY_FRESH_RENDERS_TOTAL{reason=...}: why a chat request was rendered afresh
# instead of extending an earlier completion's tokens (treetrain.proxy.chat counts them).
FRESH_REASONS = ("edited", "template")
# Label values of REWARD_FAILURES_TOTAL{reason=...}: the reward function raised, or ran too long.
REWARD_FAILURE_REASONS = ("error", "timeout")
# Replies range from a few tokens (tiny test tasks) to tens of thousands (long reasoning).
RESPONSE_LENGTH_BUCKETS = tuple(float(2**k) for k in range(2, 16))  # 4 ... 32768
# Staleness of a trained sample, in steps: 0 in synchronous runs, at most maxStaleness otherwise.
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0)
# Step times range from well under a second (tiny CPU runs) to minutes (large models).
STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
DEFAULT_PORT = 9400

# Every metric name a scrape shows (counters get ``_total`` and ``_created``, histograms their series).
NAMES = (
    TREE_TOKEN_RATIO,
    TOKENS_TOTAL,
    STEP_DURATION_SECONDS,
    TRAIN_TOKENS_PER_SECOND,
    STEP_TOKENS_PER_SECOND,
    ROLLOUT_LOGPROB_MISMATCH,
    STEPS_TOTAL,
    LOSS,
    REWARD,
    EPISODES_CAPPED_TOTAL,
    ROLLOUT_STALENESS,
    ROLLOUT_BUFFER_GROUPS,
    ROLLOUT_IDLE_SECONDS_TOTAL,
    TRAINER_IDLE_SECONDS_TOTAL,
    ROLLOUT_GROUPS_DROPPED_TOTAL,
    ROLLOUT_RESUBMITTED_TOTAL,
    WEIGHT_VERSION,
    PROXY_REQUESTS_TOTAL,
    PROXY_SESSIONS_OPEN,
    PROXY_FRESH_RENDERS_TOTAL,
    REWARD_FAILURES_TOTAL,
    EVAL_REWARD,
    POLICY_ENTROPY,
    KL,
    CLIP_FRACTION,
    IMPORTANCE_RATIO,
    GRAD_NORM,
    RESPONSE_LENGTH_TOKENS,
    ZERO_SIGNAL_GROUPS_TOTAL,
)


@dataclass(frozen=True, slots=True)
class StepFigures:
    """What one training step reports, as host floats."""

    tree_token_ratio: float
    original_tokens: int
    tree_tokens: int
    padded_tokens: int
    seconds: float  # the whole step: rollout, training, weight sync
    train_seconds: float  # the training part only
    loss: float
    reward: float
    # |rollout engine's log-prob - trainer's recomputed log-prob| over the response tokens;
    # None when the batch carried no sampler log-probs.
    mismatch_mean: float | None = None
    mismatch_max: float | None = None
    # Episodes the step's rollouts ended at trainer.maxTurns / before trainer.maxEpisodeTokens.
    capped_turns: int = 0
    capped_tokens: int = 0
    # Rollout: per trained sample, the step less the weight version its trajectory started from;
    # the rest are what happened since the previous step (counters) or now (gauges).
    staleness: tuple[int, ...] = ()
    buffer_groups: int = 0
    rollout_idle_seconds: float = 0.0
    trainer_idle_seconds: float = 0.0
    dropped_filtered: int = 0
    dropped_failed: int = 0
    resubmitted: int = 0
    weight_version: int = 0
    # The policy and its update, per response token of the step (None: not measured this step;
    # kl needs a reference model). The ratio is the importance ratio policy / proximal policy.
    entropy: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    ratio_mean: float | None = None
    ratio_max: float | None = None
    grad_norm: float | None = None
    # Per trained sample: its reply's tokens; and the step's groups whose rewards were all equal.
    response_lengths: tuple[int, ...] = ()
    zero_signal_groups: int = 0

    # Both count original (unpacked) tokens: what the step trained, however well it packed.
    @property
    def train_tokens_per_second(self) -> float:
        return self.original_tokens / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def step_tokens_per_second(self) -> float:
        return self.original_tokens / self.seconds if self.seconds > 0 else 0.0


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
        self._seen: dict[tuple[str, str], float] = {}  # cumulative counts last exported (observe_agents)
        self._server: Any = None

    def observe_step(self, fig: StepFigures) -> None:
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
