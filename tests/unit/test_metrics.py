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
}


def test_constants_are_the_design_names() -> None:
    assert M.TREE_TOKEN_RATIO == "treetrain_tree_token_ratio"
    assert M.TOKENS_TOTAL == "treetrain_tokens_total"
    assert M.STEP_DURATION_SECONDS == "treetrain_step_duration_seconds"
    assert M.TRAIN_TOKENS_PER_SECOND == "treetrain_train_tokens_per_second"
    assert M.STEPS_TOTAL == "treetrain_steps_total"
    assert M.TOKEN_KINDS == ("original", "tree", "padded")
    assert M.DEFAULT_PORT == 9400


def test_scrape_and_parse() -> None:
    metrics = M.TrainerMetrics()
    port = metrics.serve(0, "127.0.0.1")
    try:
        fig = M.StepFigures(
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
