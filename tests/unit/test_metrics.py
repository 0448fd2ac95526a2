"""The trainer's /metrics endpoint: scraped over loopback, parsed, and its names are the
ones docs/contracts.md fixes (dashboards are built on them)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from treetrain import metrics as M

# docs/contracts.md "Metrics": the names users, scripts and dashboards depend on.
CONTRACT_NAMES = {
    "treetrain_tree_token_ratio": "gauge",
    "treetrain_tokens": "counter",  # exposed as treetrain_tokens_total{kind=...}
    "treetrain_step_duration_seconds": "histogram",
    "treetrain_train_tokens_per_second": "gauge",
    "treetrain_step_tokens_per_second": "gauge",
    "treetrain_rollout_logprob_mismatch": "gauge",
    "treetrain_steps": "counter",  # treetrain_steps_total
    "treetrain_loss": "gauge",
    "treetrain_reward": "gauge",
    "treetrain_episodes_capped": "counter",  # treetrain_episodes_capped_total{reason=...}
    # Asynchronous rollout, exported by every run.
    "treetrain_rollout_staleness": "histogram",
    "treetrain_rollout_buffer_groups": "gauge",
    "treetrain_rollout_idle_seconds": "counter",  # treetrain_rollout_idle_seconds_total
    "treetrain_trainer_idle_seconds": "counter",  # treetrain_trainer_idle_seconds_total
    "treetrain_rollout_groups_dropped": "counter",  # treetrain_rollout_groups_dropped_total{reason=...}
    "treetrain_rollout_resubmitted": "counter",  # treetrain_rollout_resubmitted_total
    "treetrain_weight_version": "gauge",
    # Weight sync to rollout servers: the last sync's seconds and bytes by payload, the adapter version.
    "treetrain_weight_sync_seconds": "gauge",  # {payload="adapter"|"full"}
    "treetrain_weight_sync_bytes": "gauge",  # {payload="adapter"|"full"}
    "treetrain_adapter_version": "gauge",  # 0 (the base model) without LoRA adapter sync
    # Agents and datasets (the proxy, the reward function, evaluation), exported by every run.
    "treetrain_proxy_requests": "counter",  # treetrain_proxy_requests_total{code=...}
    "treetrain_proxy_sessions_open": "gauge",
    "treetrain_proxy_fresh_renders": "counter",  # treetrain_proxy_fresh_renders_total{reason=...}
    "treetrain_reward_failures": "counter",  # treetrain_reward_failures_total{reason=...}
    "treetrain_eval_reward": "gauge",
    # RL health, per step.
    "treetrain_policy_entropy": "gauge",
    "treetrain_kl": "gauge",
    "treetrain_clip_fraction": "gauge",
    "treetrain_importance_ratio": "gauge",  # {stat="mean"|"max"}
    "treetrain_grad_norm": "gauge",
    "treetrain_response_length_tokens": "histogram",
    "treetrain_zero_signal_groups": "counter",  # treetrain_zero_signal_groups_total
}


def test_constants_are_the_design_names() -> None:
    assert M.TREE_TOKEN_RATIO == "treetrain_tree_token_ratio"
    assert M.TOKENS_TOTAL == "treetrain_tokens_total"
    assert M.STEP_DURATION_SECONDS == "treetrain_step_duration_seconds"
    assert M.TRAIN_TOKENS_PER_SECOND == "treetrain_train_tokens_per_second"
    assert M.STEPS_TOTAL == "treetrain_steps_total"
    assert M.TOKEN_KINDS == ("original", "tree", "padded")
    assert M.DEFAULT_PORT == 9400
    assert (M.POLICY_ENTROPY, M.KL, M.CLIP_FRACTION, M.IMPORTANCE_RATIO, M.GRAD_NORM) == (
        "treetrain_policy_entropy",
        "treetrain_kl",
        "treetrain_clip_fraction",
        "treetrain_importance_ratio",
        "treetrain_grad_norm",
    )
    assert M.RESPONSE_LENGTH_TOKENS == "treetrain_response_length_tokens"
    assert M.ZERO_SIGNAL_GROUPS_TOTAL == "treetrain_zero_signal_groups_total"


def test_scrape_and_parse() -> None:
    metrics = M.TrainerMetrics()
    port = metrics.serve(0, "127.0.0.1")
    try:
        fig = M.StepRecord(
            step=1,
            tree_token_ratio=0.25,
            original_tokens=1000,
            tree_tokens=250,
            padded_tokens=6,
            seconds=4.0,
            train_seconds=2.0,
            loss=-0.5,
            reward=0.75,
        )
        metrics.observe_step(fig)
        metrics.observe_step(fig)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        metrics.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in CONTRACT_NAMES.items():
        assert name in families, name
        assert families[name].type == kind, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("treetrain_tree_token_ratio", ())] == 0.25
    assert samples[("treetrain_tokens_total", (("kind", "original"),))] == 2000
    assert samples[("treetrain_tokens_total", (("kind", "tree"),))] == 500
    assert samples[("treetrain_tokens_total", (("kind", "padded"),))] == 12
    assert samples[("treetrain_steps_total", ())] == 2
    assert samples[("treetrain_step_duration_seconds_count", ())] == 2
    # Two names for two figures: the training part alone, and the whole step.
    assert samples[("treetrain_train_tokens_per_second", ())] == 500
    assert samples[("treetrain_step_tokens_per_second", ())] == 250
    assert samples[("treetrain_loss", ())] == -0.5 and samples[("treetrain_reward", ())] == 0.75
    # Every exposed treetrain_ family is one of the fixed names (nothing undocumented sneaks in).
    # (The text format shows each counter's and histogram's *_created series as its own family.)
    exposed = {n for n in families if n.startswith("treetrain_") and not n.endswith("_created")}
    assert exposed == set(CONTRACT_NAMES)


def test_the_rollout_metrics_are_exported_from_the_first_scrape_and_count_what_steps_report() -> None:
    metrics = M.TrainerMetrics()
    port = metrics.serve(0, "127.0.0.1")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    try:
        before = scrape()
        fig = M.StepRecord(
            step=1, tree_token_ratio=0.5, original_tokens=10, tree_tokens=5, padded_tokens=0, seconds=1.0, train_seconds=0.5,
            loss=0.0, reward=0.0, staleness=(0, 1, 1, 2), buffer_groups=3, rollout_idle_seconds=0.25,
            trainer_idle_seconds=1.5, dropped_filtered=2, dropped_failed=1, resubmitted=4, weight_version=7,
        )  # fmt: skip
        metrics.observe_step(fig)
        after = scrape()
    finally:
        metrics.close()
    for reason in M.DROP_REASONS:  # both labels from the start, at 0
        assert before[("treetrain_rollout_groups_dropped_total", (("reason", reason),))] == 0
    assert before[("treetrain_rollout_staleness_count", ())] == 0
    assert before[("treetrain_weight_version", ())] == 0
    want = {
        ("treetrain_rollout_staleness_count", ()): 4,
        ("treetrain_rollout_staleness_bucket", (("le", "0.0"),)): 1,
        ("treetrain_rollout_staleness_bucket", (("le", "1.0"),)): 3,
        ("treetrain_rollout_staleness_sum", ()): 4,
        ("treetrain_rollout_buffer_groups", ()): 3,
        ("treetrain_rollout_idle_seconds_total", ()): 0.25,
        ("treetrain_trainer_idle_seconds_total", ()): 1.5,
        ("treetrain_rollout_groups_dropped_total", (("reason", "filtered"),)): 2,
        ("treetrain_rollout_groups_dropped_total", (("reason", "failed"),)): 1,
        ("treetrain_rollout_resubmitted_total", ()): 4,
        ("treetrain_weight_version", ()): 7,
    }
    assert {key: after[key] for key in want} == want


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_the_rl_health_figures_are_exported_under_their_contract_names() -> None:
    """Entropy, KL, clip fraction, importance ratio, grad norm, reply lengths and zero-signal groups
    of one step, as a scrape shows them; before any step the gauges have no sample (a run that
    never measures KL, having no reference model, shows none rather than a 0)."""
    metrics = M.TrainerMetrics()
    port = metrics.serve(0, "127.0.0.1")
    base = dict(step=1, tree_token_ratio=0.5, original_tokens=10, tree_tokens=5, padded_tokens=0, seconds=1.0,
                train_seconds=0.5, loss=0.0, reward=0.0)  # fmt: skip
    try:
        before = _scrape(port)
        health = {"entropy": 1.25, "kl": 0.003, "clip_fraction": 0.125, "ratio": 1.01, "ratio_max": 1.5}
        step = M.StepRecord(**base, stats=health, grad_norm=0.75, response_lengths=(3, 5, 64), zero_signal_groups=2)  # type: ignore[arg-type]
        metrics.observe_step(step)
        after = _scrape(port)
        metrics.observe_step(M.StepRecord(**base, response_lengths=(7,), zero_signal_groups=1))  # type: ignore[arg-type]  # no KL this step
        later = _scrape(port)
    finally:
        metrics.close()
    names = {"treetrain_policy_entropy", "treetrain_kl", "treetrain_clip_fraction", "treetrain_grad_norm"}
    assert not {name for name, _ in before} & (names | {"treetrain_importance_ratio"})
    assert before[("treetrain_zero_signal_groups_total", ())] == 0  # a counter: 0 from the first scrape
    assert before[("treetrain_response_length_tokens_count", ())] == 0
    want = {
        ("treetrain_policy_entropy", ()): 1.25,
        ("treetrain_kl", ()): 0.003,
        ("treetrain_clip_fraction", ()): 0.125,
        ("treetrain_importance_ratio", (("stat", "mean"),)): 1.01,
        ("treetrain_importance_ratio", (("stat", "max"),)): 1.5,
        ("treetrain_grad_norm", ()): 0.75,
        ("treetrain_response_length_tokens_count", ()): 3,  # one observation per trained sample
        ("treetrain_response_length_tokens_sum", ()): 72,
        ("treetrain_response_length_tokens_bucket", (("le", "4.0"),)): 1,
        ("treetrain_response_length_tokens_bucket", (("le", "8.0"),)): 2,
        ("treetrain_response_length_tokens_bucket", (("le", "64.0"),)): 3,
        ("treetrain_zero_signal_groups_total", ()): 2,
    }
    assert {key: after[key] for key in want} == want
    # A step that did not measure a figure leaves its last value; counters and histograms add up.
    assert later[("treetrain_kl", ())] == 0.003
    assert later[("treetrain_zero_signal_groups_total", ())] == 3
    assert later[("treetrain_response_length_tokens_count", ())] == 4


def test_the_agent_metrics_count_increments_of_cumulative_figures() -> None:
    metrics = M.TrainerMetrics()

    def value(name: str, **labels: str) -> float:
        got = metrics.registry.get_sample_value(name, labels)
        assert got is not None, (name, labels)
        return got

    for reason in M.FRESH_REASONS:  # every label from the start, at 0
        assert value("treetrain_proxy_fresh_renders_total", reason=reason) == 0
    for reason in M.REWARD_FAILURE_REASONS:
        assert value("treetrain_reward_failures_total", reason=reason) == 0
    snap = {"requests": {"200": 5, "429": 1}, "sessions_open": 3, "fresh_renders": {"edited": 2, "template": 0}}
    metrics.observe_agents(snap, {"error": 1, "timeout": 0})
    snap = {"requests": {"200": 9, "429": 1}, "sessions_open": 0, "fresh_renders": {"edited": 2, "template": 1}}
    metrics.observe_agents(snap, {"error": 1, "timeout": 2})
    metrics.observe_eval(0.625)
    assert value("treetrain_proxy_requests_total", code="200") == 9
    assert value("treetrain_proxy_requests_total", code="429") == 1
    assert value("treetrain_proxy_sessions_open") == 0
    assert value("treetrain_proxy_fresh_renders_total", reason="edited") == 2
    assert value("treetrain_proxy_fresh_renders_total", reason="template") == 1
    assert value("treetrain_reward_failures_total", reason="error") == 1
    assert value("treetrain_reward_failures_total", reason="timeout") == 2
    assert value("treetrain_eval_reward") == 0.625


def test_the_weight_sync_figures_by_payload() -> None:
    """The last sync's seconds and bytes under its payload, both payloads at 0 from the start (a
    run with local rollout sends nothing); the adapter version 0 (the base model) until an adapter
    sync reports one."""
    metrics = M.TrainerMetrics()

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return metrics.registry.get_sample_value(name, labels or {})

    metrics.observe_sync(None)
    assert value("treetrain_adapter_version") == 0
    assert value("treetrain_weight_sync_bytes", {"payload": "adapter"}) == 0
    assert value("treetrain_weight_sync_seconds", {"payload": "full"}) == 0
    metrics.observe_sync(M.SyncRecord("adapter", 0.5, 1200, 3, adapter_version=3))
    metrics.observe_sync(M.SyncRecord("adapter", 0.25, 1300, 4, adapter_version=4))
    assert value("treetrain_weight_sync_seconds", {"payload": "adapter"}) == 0.25
    assert value("treetrain_weight_sync_bytes", {"payload": "adapter"}) == 1300
    assert value("treetrain_adapter_version") == 4
    assert value("treetrain_weight_sync_bytes", {"payload": "full"}) == 0
    metrics.observe_sync(M.SyncRecord("full", 2.0, 540_000_000, 5))
    assert value("treetrain_weight_sync_bytes", {"payload": "full"}) == 540_000_000
    assert value("treetrain_adapter_version") == 4
