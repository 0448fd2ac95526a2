"""Grafana dashboards of treetrain, as code (grafana-foundation-sdk).

    .venv/bin/python dashboards/generate.py           # write charts/rljob-operator/dashboards/*.json
    .venv/bin/python dashboards/generate.py --check   # exit 1 when the committed JSON is stale

The Helm chart ships the JSON files as ConfigMaps for Grafana's dashboard sidecar;
tests/unit/test_dashboards.py keeps them fresh and checks that every query names only metrics
that the operator and the trainer really export. Labels the queries rely on: the trainer
PodMonitor adds ``rljob``, ``component`` and ``pod`` (and Prometheus adds ``namespace``); the
operator's ServiceMonitor keeps the metrics' own ``namespace``/``rljob``/``component``
(``honorLabels``), so both sides join on ``namespace`` and ``rljob``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphDrawStyle, StackingMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

OUT = Path(__file__).resolve().parents[1] / "charts" / "rljob-operator" / "dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Selects the RLJobs picked in the dashboard's variables.
SEL = 'namespace=~"$namespace", rljob=~"$rljob"'
BY = "namespace, rljob"


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DS)


def series(
    title: str, description: str, unit: str, targets: list[prometheus.Dataquery], *, width: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).description(description).unit(unit).datasource(DS)
    refs = [t.ref_id(chr(ord("A") + i)) for i, t in enumerate(targets)]
    return panel.targets(list(refs)).height(8).span(width).fill_opacity(10).line_width(2)


def stat_panel(title: str, description: str, unit: str, target: prometheus.Dataquery, *, width: int = 6) -> stat.Panel:
    panel = stat.Panel().title(title).description(description).unit(unit).datasource(DS)
    panel = panel.with_target(target.ref_id("A")).reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
    return panel.height(4).span(width)


def variables(board: dashboard.Dashboard) -> dashboard.Dashboard:
    board = board.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    for name, expr in (
        ("namespace", "label_values(rljob_gpus_requested, namespace)"),
        ("rljob", 'label_values(rljob_gpus_requested{namespace=~"$namespace"}, rljob)'),
    ):
        board = board.with_variable(
            dashboard.QueryVariable(name)
            .label(name)
            .datasource(DS)
            .query(expr)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    return board


def training() -> dashboard.Dashboard:
    tokens = "treetrain_tokens_total"
    savings = (
        f'1 - sum by ({BY}) (rate({tokens}{{kind="tree", {SEL}}}[$__rate_interval]))'
        f' / sum by ({BY}) (rate({tokens}{{kind="original", {SEL}}}[$__rate_interval]))'
    )
    savings_range = (
        f'1 - sum(increase({tokens}{{kind="tree", {SEL}}}[$__range]))'
        f' / sum(increase({tokens}{{kind="original", {SEL}}}[$__range]))'
    )
    staleness = "treetrain_rollout_staleness"
    length = "treetrain_response_length_tokens"
    step_bucket = f"sum by ({BY}, le) (rate(treetrain_step_duration_seconds_bucket{{{SEL}}}[$__rate_interval]))"
    board = variables(
        dashboard.Dashboard("treetrain / Training")
        .uid("treetrain-training")
        .description(
            "Throughput, tree-packing savings, step time, loss, reward, RL health (entropy, KL, clipping, "
            "importance ratio, grad norm, reply length, zero-signal groups) and GPUs of each RLJob."
        )
        .tags(["treetrain"])
        .time("now-3h", "now")
        .refresh("30s")
    )
    return (
        board.with_row(dashboard.Row("Overview"))
        .with_panel(
            stat_panel(
                "Token savings (range)",
                "1 - tree tokens / original tokens over the whole time range: the share of tokens tree packing "
                "did not have to compute.",
                "percentunit",
                query(savings_range, "savings"),
            )
        )
        .with_panel(
            stat_panel(
                "Train tokens/s",
                "Original (unpacked) tokens trained per second in the last step, summed over the selected RLJobs.",
                "short",
                query(f"sum(treetrain_train_tokens_per_second{{{SEL}}})", "tokens/s"),
            )
        )
        .with_panel(
            stat_panel(
                "Steps",
                "Training steps done, summed over the selected RLJobs.",
                "short",
                query(f"sum(max by ({BY}) (treetrain_steps_total{{{SEL}}}))", "steps"),
            )
        )
        .with_panel(
            stat_panel(
                "GPUs requested",
                "GPUs the selected RLJobs ask for, all components (from the operator).",
                "short",
                query(f"sum(rljob_gpus_requested{{{SEL}}})", "GPUs"),
            )
        )
        .with_row(dashboard.Row("Throughput and tree packing"))
        .with_panel(
            series(
                "Train tokens/s per RLJob",
                "Original (unpacked) tokens trained per second in each RLJob's last step.",
                "short",
                [query(f"sum by ({BY}) (treetrain_train_tokens_per_second{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            )
        )
        .with_panel(
            series(
                "Token savings",
                "1 - rate(tree tokens) / rate(original tokens): the share of tokens that shared prefixes saved.",
                "percentunit",
                [query(savings, "{{namespace}}/{{rljob}}")],
            ).min(0)
        )
        .with_panel(
            series(
                "tree_token_ratio",
                "Tree tokens / original tokens of the last packed batch (lower is better; 1 means no sharing).",
                "short",
                [query(f"avg by ({BY}) (treetrain_tree_token_ratio{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            ).min(0)
        )
        .with_panel(
            series(
                "Tokens/s by kind",
                "original: tokens of the unpacked sequences; tree: tokens after prefix sharing; padded: padding "
                "added to fill micro-batches.",
                "short",
                [
                    query(
                        f"sum by ({BY}, kind) (rate({tokens}{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} {{kind}}",
                    )
                ],
            )
        )
        .with_row(dashboard.Row("Steps"))
        .with_panel(
            series(
                "Step time",
                "Optimizer step duration: p50 and p90 from the histogram, and the mean.",
                "s",
                [
                    query(f"histogram_quantile(0.5, {step_bucket})", "{{rljob}} p50"),
                    query(f"histogram_quantile(0.9, {step_bucket})", "{{rljob}} p90"),
                    query(
                        f"sum by ({BY}) (rate(treetrain_step_duration_seconds_sum{{{SEL}}}[$__rate_interval]))"
                        f" / sum by ({BY}) (rate(treetrain_step_duration_seconds_count{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} mean",
                    ),
                ],
            )
        )
        .with_panel(
            series(
                "Steps per minute",
                "Training steps per minute (rate of treetrain_steps_total).",
                "short",
                [query(f"max by ({BY}) (rate(treetrain_steps_total{{{SEL}}}[$__rate_interval])) * 60", "{{rljob}}")],
            )
        )
        .with_panel(
            series(
                "Loss",
                "Policy loss of the last step.",
                "short",
                [query(f"avg by ({BY}) (treetrain_loss{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            )
        )
        .with_panel(
            series(
                "Reward",
                "Mean reward of the last step's rollouts.",
                "short",
                [query(f"avg by ({BY}) (treetrain_reward{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            )
        )
        .with_panel(
            series(
                "Rollout log-prob mismatch",
                "|rollout server's sampling log-prob - trainer's recomputed log-prob| of the same tokens in the last "
                "step, mean and max over response tokens: it should stay near 0 right after every weight sync.",
                "short",
                [
                    query(
                        f"max by ({BY}, stat) (treetrain_rollout_logprob_mismatch{{{SEL}}})",
                        "{{rljob}} {{stat}}",
                    )
                ],
                width=24,
            ).min(0)
        )
        .with_row(dashboard.Row("RL health"))
        .with_panel(
            series(
                "Policy entropy",
                "Mean entropy (nats) of the policy's next-token distributions over the last step's response tokens. "
                "A fall towards 0 means the policy has stopped exploring (collapse); a sharp rise, that it is coming "
                "apart.",
                "short",
                [query(f"avg by ({BY}) (treetrain_policy_entropy{{{SEL}}})", "{{namespace}}/{{rljob}}")],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "KL to the reference",
                "KL(policy || reference model) per response token of the last step (k3 estimate). Empty for runs "
                "without a reference model (trainer.loss.klCoef 0).",
                "short",
                [query(f"avg by ({BY}) (treetrain_kl{{{SEL}}})", "{{namespace}}/{{rljob}}")],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "Grad norm",
                "Gradient norm of the last step, before clipping to trainer.optimizer.maxGradNorm.",
                "short",
                [query(f"max by ({BY}) (treetrain_grad_norm{{{SEL}}})", "{{namespace}}/{{rljob}}")],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "Clip fraction",
                "Share of the last step's response tokens whose update the PPO clip cut off (0 when every update "
                "is on-policy: one update per batch, no stale rollouts).",
                "percentunit",
                [query(f"avg by ({BY}) (treetrain_clip_fraction{{{SEL}}})", "{{namespace}}/{{rljob}}")],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "Importance ratio",
                "policy / proximal policy over the last step's response tokens, mean and max: 1 on-policy; a max "
                "far above 1 + clip means updates or stale samples moved the policy a lot.",
                "short",
                [
                    query(
                        f"max by ({BY}, stat) (treetrain_importance_ratio{{{SEL}}})",
                        "{{rljob}} {{stat}}",
                    )
                ],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "Zero-signal groups per step",
                "Trained groups per step whose rewards were all equal: they give GRPO-style advantages nothing to "
                "learn from. As many as groupsPerStep means the reward never varies (a reward stuck at 0).",
                "short",
                [
                    query(
                        f"sum by ({BY}) (increase(treetrain_zero_signal_groups_total{{{SEL}}}[$__rate_interval]))"
                        f" / sum by ({BY}) (increase(treetrain_steps_total{{{SEL}}}[$__rate_interval]))",
                        "{{namespace}}/{{rljob}}",
                    )
                ],
                width=8,
            ).min(0)
        )
        .with_panel(
            series(
                "Response length",
                "Tokens per trained reply: the mean, and p50 and p90 from the histogram, over the interval. Replies "
                "that all reach the task's limit are cut off; a steady climb is often reward hacking by length.",
                "short",
                [
                    query(
                        f"sum by ({BY}) (rate({length}_sum{{{SEL}}}[$__rate_interval]))"
                        f" / sum by ({BY}) (rate({length}_count{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} mean",
                    ),
                    query(
                        f"histogram_quantile(0.5, sum by ({BY}, le) (rate({length}_bucket{{{SEL}}}[$__rate_interval])))",
                        "{{rljob}} p50",
                    ),
                    query(
                        f"histogram_quantile(0.9, sum by ({BY}, le) (rate({length}_bucket{{{SEL}}}[$__rate_interval])))",
                        "{{rljob}} p90",
                    ),
                ],
                width=24,
            ).min(0)
        )
        .with_row(dashboard.Row("Asynchronous rollout"))
        .with_panel(
            series(
                "Staleness of trained samples",
                "Per trained sample: the step it is trained at less the weight version its trajectory started from "
                "(0 in synchronous runs; never above trainer.rollout.maxStaleness). Mean and p90 over the interval.",
                "short",
                [
                    query(
                        f"sum by ({BY}) (rate({staleness}_sum{{{SEL}}}[$__rate_interval]))"
                        f" / sum by ({BY}) (rate({staleness}_count{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} mean",
                    ),
                    query(
                        f"histogram_quantile(0.9, sum by ({BY}, le) "
                        f"(rate({staleness}_bucket{{{SEL}}}[$__rate_interval])))",
                        "{{rljob}} p90",
                    ),
                ],
                width=24,
            ).min(0)
        )
        .with_panel(
            series(
                "Trainer idle",
                "Share of the time the trainer waited for rollouts (seconds waited per second).",
                "percentunit",
                [
                    query(
                        f"max by ({BY}) (rate(treetrain_trainer_idle_seconds_total{{{SEL}}}[$__rate_interval]))",
                        "{{namespace}}/{{rljob}}",
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Rollout idle",
                "Share of the time the rollout side had nothing to generate (in synchronous runs: training and weight "
                "sync).",
                "percentunit",
                [
                    query(
                        f"max by ({BY}) (rate(treetrain_rollout_idle_seconds_total{{{SEL}}}[$__rate_interval]))",
                        "{{namespace}}/{{rljob}}",
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Rollout buffer",
                "Finished rollout groups waiting to be trained.",
                "short",
                [query(f"max by ({BY}) (treetrain_rollout_buffer_groups{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            ).min(0)
        )
        .with_panel(
            series(
                "Weight version",
                "The weight version the trainer last synced to the rollout servers, and with LoRA adapter sync the "
                "adapter version every server listed after it (the same number when syncs are verified).",
                "short",
                [
                    query(f"max by ({BY}) (treetrain_weight_version{{{SEL}}})", "{{namespace}}/{{rljob}} weights"),
                    query(f"max by ({BY}) (treetrain_adapter_version{{{SEL}}})", "{{namespace}}/{{rljob}} adapter"),
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Weight sync time",
                "Wall time of the last weight sync (export and every server's load), by payload: adapter (LoRA "
                "adapter alone) or full (full weights, a merged adapter's included).",
                "s",
                [
                    query(
                        f"max by ({BY}, payload) (treetrain_weight_sync_seconds{{{SEL}}})",
                        "{{rljob}} {{payload}}",
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Weight sync size",
                "Bytes each rollout server received in the last weight sync, by payload (adapter or full).",
                "bytes",
                [query(f"max by ({BY}, payload) (treetrain_weight_sync_bytes{{{SEL}}})", "{{rljob}} {{payload}}")],
            ).min(0)
        )
        .with_panel(
            series(
                "Groups dropped",
                "Rollout groups dropped and replaced per interval: filtered (dynamic sampling, all rewards equal) or "
                "failed (every server failed the generation).",
                "short",
                [
                    query(
                        f"sum by ({BY}, reason) "
                        f"(increase(treetrain_rollout_groups_dropped_total{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} {{reason}}",
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Requests resubmitted",
                "Generation requests sent again per interval: interrupted by a weight update, or moved off a failed "
                "server.",
                "short",
                [
                    query(
                        f"sum by ({BY}) (increase(treetrain_rollout_resubmitted_total{{{SEL}}}[$__rate_interval]))",
                        "{{namespace}}/{{rljob}}",
                    )
                ],
            ).min(0)
        )
        .with_row(dashboard.Row("Agents and data"))
        .with_panel(
            series(
                "Eval reward",
                "Mean reward of the last evaluation on trainer.eval's dataset (greedy, one run per row).",
                "short",
                [query(f"avg by ({BY}) (treetrain_eval_reward{{{SEL}}})", "{{namespace}}/{{rljob}}")],
            )
        )
        .with_panel(
            series(
                "Proxy requests by code",
                "Requests the agent proxy answered per second, by HTTP status (429: sessions at the bound; 413: a "
                "session's token budget; 4xx: the agent sent something wrong), and the sessions open now.",
                "reqps",
                [
                    query(
                        f"sum by ({BY}, code) (rate(treetrain_proxy_requests_total{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} {{code}}",
                    ),
                    query(f"sum by ({BY}) (treetrain_proxy_sessions_open{{{SEL}}})", "{{rljob}} sessions open"),
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Fresh renders",
                "Agent chat requests rendered afresh per interval instead of extending an earlier completion's "
                "tokens: edited (the agent changed an earlier reply) or template (the chat template does not render "
                "incrementally). Each one breaks prefix sharing.",
                "short",
                [
                    query(
                        f"sum by ({BY}, reason) "
                        f"(increase(treetrain_proxy_fresh_renders_total{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} {{reason}}",
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Reward failures",
                "Reward calls that failed and scored 0 per interval: error (the function raised) or timeout "
                "(trainer.rewardTimeoutSeconds).",
                "short",
                [
                    query(
                        f"sum by ({BY}, reason) (increase(treetrain_reward_failures_total{{{SEL}}}[$__rate_interval]))",
                        "{{rljob}} {{reason}}",
                    )
                ],
            ).min(0)
        )
        .with_row(dashboard.Row("GPUs"))
        .with_panel(
            series(
                "GPUs per RLJob by component",
                "GPUs requested by each component (rollout, actor, critic, ref) of each RLJob, from the operator.",
                "short",
                [
                    query(
                        f"sum by ({BY}, component) (rljob_gpus_requested{{{SEL}}})",
                        "{{rljob}} {{component}}",
                    )
                ],
                width=24,
            )
            .stacking(StackingConfig().mode(StackingMode.NORMAL))
            .fill_opacity(60)
            .draw_style(GraphDrawStyle.BARS)
            .min(0)
        )
    )


def operator() -> dashboard.Dashboard:
    bucket = "sum by (le) (rate(rljob_reconcile_duration_seconds_bucket[$__rate_interval]))"
    board = (
        dashboard.Dashboard("treetrain / RLJob operator")
        .uid("treetrain-operator")
        .description("RLJobs by phase, reconcile latency and errors, trainer restarts.")
        .tags(["treetrain"])
        .time("now-3h", "now")
        .refresh("30s")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    phases = ("Pending", "Running", "Succeeded", "Failed", "Suspended")
    for phase in phases:
        board = board.with_panel(
            stat_panel(
                phase,
                f"RLJobs in phase {phase} now.",
                "short",
                query(f'sum(rljob_jobs{{phase="{phase}"}})', phase),
                width=24 // len(phases) if phase != phases[-1] else 24 - (24 // len(phases)) * (len(phases) - 1),
            )
        )
    return (
        board.with_panel(
            series(
                "RLJobs by phase",
                "Number of RLJobs in each phase, stacked.",
                "short",
                [query("sum by (phase) (rljob_jobs)", "{{phase}}")],
            )
            .stacking(StackingConfig().mode(StackingMode.NORMAL))
            .fill_opacity(40)
            .min(0)
        )
        .with_panel(
            series(
                "Reconcile latency",
                "Time to reconcile one RLJob: p50, p90 and p99.",
                "s",
                [
                    query(f"histogram_quantile(0.5, {bucket})", "p50"),
                    query(f"histogram_quantile(0.9, {bucket})", "p90"),
                    query(f"histogram_quantile(0.99, {bucket})", "p99"),
                ],
            )
        )
        .with_panel(
            series(
                "Reconciles and errors",
                "Reconciles per second, and reconciles that raised an error per second.",
                "reqps",
                [
                    query("sum(rate(rljob_reconcile_duration_seconds_count[$__rate_interval]))", "reconciles"),
                    query("sum(rate(rljob_reconcile_errors_total[$__rate_interval]))", "errors"),
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "Trainer restarts",
                "Trainer gang restarts, by namespace, per interval.",
                "short",
                [
                    query(
                        "sum by (namespace) (increase(rljob_trainer_restarts_total[$__rate_interval]))", "{{namespace}}"
                    )
                ],
            ).min(0)
        )
        .with_panel(
            series(
                "GPUs requested by component",
                "GPUs all RLJobs ask for, by component.",
                "short",
                [query("sum by (component) (rljob_gpus_requested)", "{{component}}")],
            )
            .stacking(StackingConfig().mode(StackingMode.NORMAL))
            .fill_opacity(40)
            .min(0)
        )
        .with_panel(
            stat_panel(
                "Operator version",
                "rljob_build_info of the running operator.",
                "none",
                query("max by (version) (rljob_build_info)", "{{version}}"),
                width=12,
            )
        )
    )


BOARDS = {"training": training, "operator": operator}


def build() -> dict[str, dict[str, Any]]:
    """Every dashboard as its JSON object, by file name (without .json)."""
    out: dict[str, dict[str, Any]] = {}
    for name, make in BOARDS.items():
        board = json.loads(json.dumps(make().build(), cls=JSONEncoder))
        # Stable panel ids (Grafana links and alerts refer to panels by id).
        for number, panel in enumerate(board["panels"], start=1):
            panel["id"] = number
        out[name] = board
    return out


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed dashboard is stale")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    args = parser.parse_args(argv)
    stale = []
    for name, board in build().items():
        path = args.out / f"{name}.json"
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run `python dashboards/generate.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
