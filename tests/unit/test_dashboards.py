"""Grafana dashboards and alert rules: fresh from dashboards/generate.py, well formed, and every
PromQL query names only metrics that the code really exports.

Exported names come from the code's live registries, not from a list kept here: the operator's
(``rljob_operator.metrics.Metrics``) and the trainer's (``treetrain.metrics.TrainerMetrics``).
docs/contracts.md's trainer names are checked against the trainer's registry too.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rljob_operator.metrics import Metrics
from treetrain.metrics import TrainerMetrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rljob-operator"

# docs/contracts.md "Metrics", trainer side (sample names as scraped).
CONTRACT_TRAINER = {
    "treetrain_tree_token_ratio",
    "treetrain_tokens_total",
    "treetrain_step_duration_seconds_bucket",
    "treetrain_step_duration_seconds_sum",
    "treetrain_step_duration_seconds_count",
    "treetrain_train_tokens_per_second",
    "treetrain_rollout_logprob_mismatch",
    "treetrain_steps_total",
}
# docs/contracts.md's "plus loss and reward gauges", as treetrain/metrics/names.py names them.
LOSS_AND_REWARD = {"treetrain_loss", "treetrain_reward"}
# The RL health signals (sample names as scraped): each has a panel in the Training dashboard's
# "RL health" row, and tests/cluster/test_prometheus.py checks every panel has data.
RL_HEALTH = {
    "treetrain_policy_entropy",
    "treetrain_kl",
    "treetrain_clip_fraction",
    "treetrain_importance_ratio",
    "treetrain_grad_norm",
    "treetrain_response_length_tokens_bucket",
    "treetrain_response_length_tokens_sum",
    "treetrain_response_length_tokens_count",
    "treetrain_zero_signal_groups_total",
}

PROMQL_FUNCTIONS = {
    "sum", "avg", "max", "min", "count", "rate", "increase", "irate", "delta", "histogram_quantile",
    "label_values", "abs", "clamp_min", "clamp_max", "topk", "bottomk", "absent", "time", "vector",
}  # fmt: skip
_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_generate", ROOT / "dashboards" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generator()


def samples(registry: Any) -> set[str]:
    """The sample names a scrape of ``registry`` shows (without ``_created``)."""
    names: set[str] = set()
    for family in registry.collect():
        for suffix in _SAMPLE_SUFFIXES[family.type]:
            names.add(family.name + suffix)
    return names


def operator_samples() -> set[str]:
    return samples(Metrics().registry)


def trainer_samples() -> set[str]:
    return samples(TrainerMetrics().registry)


def exported() -> set[str]:
    return operator_samples() | trainer_samples()


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana label_values() query)."""
    query = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr)
    if query:
        expr = query.group(1)
    rest = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # label values
    rest = re.sub(r"\{[^}]*\}", "", rest)  # label matchers
    rest = re.sub(r"\[[^\]]*\]", "", rest)  # ranges
    rest = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", rest)
    rest = re.sub(r"\$\w+", "", rest)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(\s*\()?", rest):
        word, call = match.group(0).rstrip("( \t"), match.group(1)
        if call:
            assert word in PROMQL_FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        else:
            names.add(word)
    return names


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def queries(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def rule_exprs() -> list[str]:
    """The PrometheusRule expressions, with Helm's value placeholders as numbers."""
    text = (CHART / "templates" / "prometheusrule.yaml").read_text()
    return [re.sub(r"\{\{[^}]*\}\}", "1", m) for m in re.findall(r"^\s*expr: (.+)$", text, flags=re.M)]


# ---------------------------------------------------------------------------


def test_committed_dashboards_are_fresh() -> None:
    built = generate.build()
    assert sorted(built) == sorted(dashboards()) == ["operator", "training"]
    for name, board in built.items():
        path = CHART / "dashboards" / f"{name}.json"
        assert path.read_text() == generate.render(board), f"{path} is stale: run `python dashboards/generate.py`"


def test_parser_finds_names() -> None:
    assert metric_names('1 - sum by (a, b) (rate(x_total{kind="tree", n=~"$n"}[$__rate_interval])) / y') == {
        "x_total",
        "y",
    }
    assert metric_names('label_values(rljob_gpus_requested{namespace=~"$namespace"}, rljob)') == {
        "rljob_gpus_requested"
    }
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m])))") == {"h_bucket"}


@pytest.mark.parametrize("name", ["training", "operator"])
def test_every_query_names_only_exported_metrics(name: str) -> None:
    allowed = exported()
    board = dashboards()[name]
    exprs = queries(board)
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= allowed, f"{sorted(names - allowed)} in {expr!r} are not exported by the code"


def test_alert_rules_name_only_exported_metrics() -> None:
    exprs = rule_exprs()
    assert len(exprs) == 4
    for expr in exprs:
        names = metric_names(expr)
        assert names and names <= exported(), expr


def test_dashboards_cover_the_issue() -> None:
    """Training: tokens/s, savings, tree_token_ratio, step time, loss, reward, GPUs by component.
    Operator: RLJobs by phase, reconcile latency, errors."""
    used = {n: set().union(*(metric_names(e) for e in queries(b))) for n, b in dashboards().items()}
    assert CONTRACT_TRAINER | LOSS_AND_REWARD | RL_HEALTH | {"rljob_gpus_requested"} <= used["training"]
    assert {
        "rljob_jobs",
        "rljob_reconcile_duration_seconds_bucket",
        "rljob_reconcile_errors_total",
        "rljob_trainer_restarts_total",
    } <= used["operator"]
    training = json.dumps(dashboards()["training"])
    assert '1 - sum by (namespace, rljob) (rate(treetrain_tokens_total{kind=\\"tree\\"' in training


def test_trainer_exports_what_design_names() -> None:
    """docs/contracts.md's trainer metrics, the loss and reward gauges and the RL health signals are
    in the trainer's registry."""
    want = CONTRACT_TRAINER | LOSS_AND_REWARD | RL_HEALTH
    assert trainer_samples() >= want, sorted(want - trainer_samples())


def test_the_rl_health_row_has_a_panel_per_signal() -> None:
    board = dashboards()["training"]
    titles = [p["title"] for p in board["panels"]]
    row = titles.index("RL health")
    end = next(i for i in range(row + 1, len(titles)) if board["panels"][i]["type"] == "row")
    in_row = set().union(*(metric_names(t["expr"]) for p in board["panels"][row + 1 : end] for t in p["targets"]))
    assert in_row >= RL_HEALTH, sorted(RL_HEALTH - in_row)


@pytest.mark.parametrize("name", ["training", "operator"])
def test_panels_are_well_formed(name: str) -> None:
    board = dashboards()[name]
    assert board["uid"] == f"treetrain-{name}" and board["title"].startswith("treetrain / ")
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} >= {"datasource"}
    for panel in board["panels"]:
        assert panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(refs)
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24


def test_metrics_reference_lists_every_metric() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    families = {f.name + ("_total" if f.type == "counter" else "") for f in Metrics().registry.collect()}
    trainer = {
        n.removesuffix("_bucket")
        for n in CONTRACT_TRAINER | LOSS_AND_REWARD | RL_HEALTH
        if not n.endswith(("_sum", "_count"))
    }
    missing = sorted(n for n in families | trainer if f"`{n}`" not in doc)
    assert not missing, f"docs/metrics.md does not list {missing}"
