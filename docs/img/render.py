"""Draw the dashboards' panels from samples captured by docs/img/capture.py (matplotlib).

    .venv/bin/pip install matplotlib      # not a project dependency: only these pictures need it
    .venv/bin/python docs/img/render.py build/dashboard-samples.jsonl

Grafana is not available here, so this draws each dashboard itself: the panels, titles, units
and layout (gridPos) come from the dashboard JSON the chart ships, and each panel's series are
its queries computed in Python from the scraped samples (rates over 60 s, histogram quantiles
by linear interpolation inside the bucket, as Prometheus does). Writes
docs/img/dashboard-training.png and docs/img/dashboard-operator.png.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

ROOT = Path(__file__).resolve().parents[2]
BOARDS = ROOT / "charts" / "rljob-operator" / "dashboards"
WINDOW = 60.0  # seconds, the rate window
Key = tuple[str, tuple[tuple[str, str], ...]]
Series = list[tuple[str, list[float], list[float]]]  # (legend, minutes, values)
BG, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#ffcb7d"]


class Samples:
    def __init__(self, path: Path) -> None:
        self.data: dict[Key, list[tuple[float, float]]] = defaultdict(list)
        for line in path.read_text().splitlines():
            s = json.loads(line)
            self.data[(s["name"], tuple(sorted(s["labels"].items())))].append((s["t"], s["value"]))
        self.t0 = min(t for points in self.data.values() for t, _ in points)

    def select(self, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], list[tuple[float, float]]]:
        return {
            labels: points
            for (n, labels), points in self.data.items()
            if n == name and all(dict(labels).get(k) == v for k, v in match.items())
        }

    def minutes(self, points: list[tuple[float, float]]) -> list[float]:
        return [(t - self.t0) / 60 for t, _ in points]


def rate(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-second increase over the last WINDOW seconds, at each sample."""
    out, j = [], 0
    for t, v in points:
        while points[j][0] < t - WINDOW:
            j += 1
        t0, v0 = points[j]
        if t - t0 >= WINDOW / 2:
            out.append((t, max(0.0, v - v0) / (t - t0)))
    return out


def combine(series: list[list[tuple[float, float]]], op: Callable[[list[float]], float]) -> list[tuple[float, float]]:
    """Join series on (rounded) scrape times and reduce each instant with ``op``."""
    by_time: dict[float, list[float]] = defaultdict(list)
    for points in series:
        for t, v in points:
            by_time[round(t / 2) * 2].append(v)
    return sorted((t, op(vs)) for t, vs in by_time.items())


def quantile(q: float, buckets: dict[float, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    rated = {le: dict(rate(points)) for le, points in buckets.items()}
    times = sorted(set.intersection(*(set(r) for r in rated.values()))) if rated else []
    out = []
    for t in times:
        bounds = sorted(rated)
        counts = [rated[le][t] for le in bounds]
        total = counts[-1]
        if total <= 0:
            continue
        rank, prev_le, prev_c = q * total, 0.0, 0.0
        for le, c in zip(bounds, counts, strict=True):
            if c >= rank:
                value = (
                    prev_le
                    if le == float("inf")
                    else prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-12)
                )
                out.append((t, value))
                break
            prev_le, prev_c = le, c
    return out


def by_label(samples: Samples, name: str, label: str, **match: str) -> dict[str, list[list[tuple[float, float]]]]:
    groups: dict[str, list[list[tuple[float, float]]]] = defaultdict(list)
    for labels, points in samples.select(name, **match).items():
        groups[dict(labels).get(label, "")].append(points)
    return groups


def series(samples: Samples, named: dict[str, list[tuple[float, float]]]) -> Series:
    return [(legend, samples.minutes(points), [v for _, v in points]) for legend, points in sorted(named.items())]


# ---------------------------------------------------------------------------
# Panels: title -> series (or a stat value)


def training_panels(s: Samples) -> dict[str, Callable[[], Series | str]]:
    def per_job(
        name: str, fn: Callable[[list[tuple[float, float]]], list[tuple[float, float]]] = lambda p: p
    ) -> Series:
        return series(s, {f"demo/{job}": fn(p[0]) for job, p in by_label(s, name, "rljob").items()})

    def tokens(job: str, kind: str) -> list[tuple[float, float]]:
        (points,) = s.select("treetrain_tokens_total", rljob=job, kind=kind).values()
        return points

    jobs = sorted(by_label(s, "treetrain_tokens_total", "rljob"))

    def savings() -> Series:
        out = {}
        for job in jobs:
            tree, orig = dict(rate(tokens(job, "tree"))), rate(tokens(job, "original"))
            out[f"demo/{job}"] = [(t, 1 - tree[t] / v) for t, v in orig if v > 0 and t in tree]
        return series(s, out)

    def savings_range() -> str:
        tree = sum(tokens(j, "tree")[-1][1] - tokens(j, "tree")[0][1] for j in jobs)
        orig = sum(tokens(j, "original")[-1][1] - tokens(j, "original")[0][1] for j in jobs)
        return f"{100 * (1 - tree / orig):.1f}%"

    def step_time() -> Series:
        out = {}
        for job in jobs:
            buckets = {
                float(dict(lb)["le"]): p
                for lb, p in s.select("treetrain_step_duration_seconds_bucket", rljob=job).items()
            }
            out[f"{job} p50"] = quantile(0.5, buckets)
            out[f"{job} p90"] = quantile(0.9, buckets)
        return series(s, out)

    def gpus_by_component() -> Series:
        out = {}
        for labels, points in s.select("rljob_gpus_requested").items():
            d = dict(labels)
            out[f"{d['rljob']} {d['component']}"] = points
        return series(s, out)

    def last(name: str, reduce: Callable[[list[float]], float] = sum) -> str:
        values = [p[-1][1] for p in s.select(name).values()]
        return f"{reduce(values):,.0f}" if values else "No data"

    return {
        "Token savings (range)": savings_range,
        "Train tokens/s": lambda: last("treetrain_train_tokens_per_second"),
        "Steps": lambda: last("treetrain_steps_total"),
        "GPUs requested": lambda: last("rljob_gpus_requested"),
        "Train tokens/s per RLJob": lambda: per_job("treetrain_train_tokens_per_second"),
        "Token savings": savings,
        "tree_token_ratio": lambda: per_job("treetrain_tree_token_ratio"),
        "Tokens/s by kind": lambda: series(s, {f"{j} {k}": rate(tokens(j, k)) for j in jobs for k in ("original", "tree", "padded")}),
        "Step time": step_time,
        "Steps per minute": lambda: series(s, {j: [(t, v * 60) for t, v in rate(p[0])] for j, p in by_label(s, "treetrain_steps_total", "rljob").items()}),
        "Loss": lambda: per_job("treetrain_loss"),
        "Reward": lambda: per_job("treetrain_reward"),
        "GPUs per RLJob by component": gpus_by_component,
    }  # fmt: skip


def operator_panels(s: Samples) -> dict[str, Callable[[], Series | str]]:
    def phase_now(phase: str) -> str:
        (points,) = s.select("rljob_jobs", phase=phase).values()
        return f"{points[-1][1]:.0f}"

    def latency() -> Series:
        buckets = {float(dict(lb)["le"]): p for lb, p in s.select("rljob_reconcile_duration_seconds_bucket").items()}
        return series(s, {f"p{round(q * 100)}": quantile(q, buckets) for q in (0.5, 0.9, 0.99)})

    def one(name: str) -> list[tuple[float, float]]:
        (points,) = s.select(name).values()
        return points

    panels: dict[str, Callable[[], Series | str]] = {
        p: (lambda p=p: phase_now(p)) for p in ("Pending", "Running", "Succeeded", "Failed", "Suspended")
    }
    panels |= {
        "RLJobs by phase": lambda: series(s, {ph: p[0] for ph, p in by_label(s, "rljob_jobs", "phase").items()}),
        "Reconcile latency": latency,
        "Reconciles and errors": lambda: series(
            s, {"reconciles": rate(one("rljob_reconcile_duration_seconds_count")), "errors": rate(one("rljob_reconcile_errors_total"))}
        ),
        "Trainer restarts": lambda: series(
            s, {ns: [(t, v * WINDOW) for t, v in rate(p[0])] for ns, p in by_label(s, "rljob_trainer_restarts_total", "namespace").items()}
        ),
        "GPUs requested by component": lambda: series(
            s, {c: combine(ps, sum) for c, ps in by_label(s, "rljob_gpus_requested", "component").items()}
        ),
        "Operator version": lambda: next(iter(by_label(s, "rljob_build_info", "version")), "No data"),
    }  # fmt: skip
    return panels


# ---------------------------------------------------------------------------
# Drawing


def draw(board: dict[str, Any], panels: dict[str, Callable[[], Series | str]], out: Path, note: str) -> None:
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    unit_h = 0.42  # inches per grid row
    fig = plt.figure(figsize=(16, rows * unit_h + 1.0), facecolor=BG)
    top = 1 - 0.8 / (rows * unit_h + 1.0)
    fig.text(
        0.01, 1 - 0.35 / (rows * unit_h + 1.0), board["title"], color=TEXT, fontsize=15, weight="bold", va="center"
    )
    fig.text(0.99, 1 - 0.35 / (rows * unit_h + 1.0), note, color="#8e8e8e", fontsize=8.5, ha="right", va="center")
    scale_y = top / rows
    fig_w, fig_h = fig.get_size_inches()
    for panel in board["panels"]:
        g = panel["gridPos"]
        left, width = g["x"] / 24 + 0.003, g["w"] / 24 - 0.006
        bottom, height = top - (g["y"] + g["h"]) * scale_y + 0.003, g["h"] * scale_y - 0.006
        if panel["type"] == "row":
            fig.text(left, bottom + height / 2, panel["title"], color=TEXT, fontsize=11, weight="bold", va="center")
            continue
        fig.add_artist(
            Rectangle(
                (left, bottom), width, height, transform=fig.transFigure, facecolor=PANEL, edgecolor=GRID, zorder=-1
            )
        )
        fig.text(left + 0.1 / fig_w, bottom + height - 0.06 / fig_h, panel["title"], color=TEXT, fontsize=10, va="top")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        result = panels[panel["title"]]()
        if isinstance(result, str):
            color = "#8e8e8e" if result == "No data" else "#73bf69"
            fig.text(left + width / 2, bottom + height * 0.42, result, color=color, fontsize=22, weight="bold",
                     ha="center", va="center")  # fmt: skip
            continue
        # Inside the panel: room for the title above and the tick labels left and below.
        inset = (left + 0.62 / fig_w, bottom + 0.42 / fig_h, width - 0.75 / fig_w, height - 0.78 / fig_h)
        ax = fig.add_axes(inset, facecolor=PANEL)
        for spine in ax.spines.values():
            spine.set_visible(False)
        plot(ax, panel, result, unit)
    fig.savefig(out, dpi=90, facecolor=BG)
    plt.close(fig)
    print(f"wrote {out}")


def plot(ax: Axes, panel: dict[str, Any], result: Series, unit: str) -> None:
    ax.tick_params(colors="#8e8e8e", labelsize=7.5)
    ax.grid(color=GRID, linewidth=0.6)
    ax.set_xlabel("minutes into the run", color="#8e8e8e", fontsize=7.5, labelpad=1)
    result = [r for r in result if r[1]]
    if not result:
        ax.text(0.5, 0.5, "No data", color="#8e8e8e", fontsize=14, ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    if stacked:
        grid = sorted({round(x, 3) for _, xs, _ in result for x in xs})
        ys = []
        for _, xs, vs in result:
            lookup = {round(x, 3): v for x, v in zip(xs, vs, strict=True)}
            last, filled = 0.0, []
            for x in grid:
                last = lookup.get(x, last if x <= max(lookup) else 0.0)
                filled.append(last)
            ys.append(filled)
        ax.stackplot(grid, ys, labels=[r[0] for r in result], colors=COLORS[: len(result)], alpha=0.75, step="post")
    else:
        for i, (legend, xs, vs) in enumerate(result):
            ax.plot(xs, vs, color=COLORS[i % len(COLORS)], linewidth=1.4, label=legend)
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    elif unit == "s":
        ax.set_ylabel("s", color="#8e8e8e", fontsize=7.5)
    if "min" in panel.get("fieldConfig", {}).get("defaults", {}):
        ax.set_ylim(bottom=0)
    legend = ax.legend(fontsize=7, loc="upper left", framealpha=0.3, ncol=3 if len(result) > 4 else 1)
    legend.get_frame().set_facecolor(PANEL)
    for text in legend.get_texts():
        text.set_color(TEXT)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: render.py SAMPLES.jsonl (from docs/img/capture.py)", file=sys.stderr)
        return 2
    samples = Samples(Path(sys.argv[1]))
    minutes = max(t for p in samples.data.values() for t, _ in p) - samples.t0
    note = f"drawn from {minutes / 60:.0f} min of real samples of a local run (docs/img/README.md); not a Grafana screenshot"
    out = Path(__file__).resolve().parent
    for name, panels in (("training", training_panels(samples)), ("operator", operator_panels(samples))):
        board = json.loads((BOARDS / f"{name}.json").read_text())
        draw(board, panels, out / f"dashboard-{name}.png", note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
