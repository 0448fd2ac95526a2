"""Synchronous vs asynchronous RL: real CPU training against a rollout stand-in.

    python bench/async_rl.py [--steps 16] [--repeat 2] [--staleness 0 1 2] [--token-delay auto] [--json out.json]

The trainer is the real one (``Trainer``: builtin:tiny-llama on builtin:parity, tree packing,
GRPO, one torch thread) and its rollout server is bench/rollout_standin.py in a process of its
own, whose generation time is simulated (a per-token condition wait: no CPU), so the rollout
servers take no CPU from training; the group scheduler's threads (HTTP requests, the task's
code) do run in the trainer's process, as they do in a real run. Weights go to the stand-in by disk (``checkpoint.dir`` in a
temporary directory), as a disk-synced server gets them. Each mode of ``--staleness`` trains the
same number of steps from the same seed in this one process: ``0`` is the synchronous loop
(rollout, then training, then the weight sync), ``N >= 1`` is ``trainer.rollout.maxStaleness: N``
(the next steps' groups are generated while a step trains).

The stand-in generates at most one step's requests at once (``--max-running``, a server's batch):
its throughput is fixed, so overlap can hide the shorter of rollout and training, no more.
``--token-delay auto`` first runs a short synchronous calibration (4 steps at 1 ms a token, which
also warms the process up) and picks the delay that makes a step's rollout time R about its
training time T (weight sync included), where overlap helps most.

Every mode runs ``--repeat`` times, the modes taking turns, and each mode's fastest run is
reported (on a shared machine the others' load only ever slows a run down). Printed per mode:
wall time, the speed-up over the synchronous run, the fraction of the ideal
speed-up ``(R + T) / max(R, T)`` that it reaches (R and T per step as the synchronous run
measured them; goal >= 0.85), the trainer's idle fraction (waiting for rollouts; the trainer's
``treetrain_trainer_idle_seconds_total``), the rollout side's idle fraction
(``treetrain_rollout_idle_seconds_total``) and the stand-in's own idle fraction (wall time with
no request generating). Each run's first step waits for a whole rollout, so N steps can reach at
most ``N (R + T) / (R + N max(R, T))`` of the synchronous time: printed as "ideal with fill".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import transformers

from treetrain import config as C
from treetrain.rl.rollout import http_json
from treetrain.trainer.loop import StepRecord, Trainer

HERE = Path(__file__).resolve().parent

STALENESS = re.compile(r"\| staleness max (\d+) mean ([\d.]+)")
VOCAB = 512  # builtin:tiny-llama's and builtin:parity's


@dataclass(slots=True)
class Run:
    """One mode's measurements (seconds are totals over the run's steps)."""

    staleness: int
    steps: int
    wall_s: float
    rollout_s: float  # the step records' rollout part: in the synchronous loop, the whole generation
    train_s: float  # everything else of the steps: training and the weight sync
    trainer_idle_s: float
    rollout_idle_s: float | None  # None: the trainer exports no rollout idle counter
    server_idle_s: float
    # The window the server's busy time was read over: trainer.run() whole, restore and start-up
    # included, so a bit longer than wall_s (the steps alone). The server's idle fraction is of
    # this window: divided by wall_s it passed 1 on a loaded machine.
    server_window_s: float
    staleness_max: int
    staleness_mean: float
    rewards: list[float]
    step_rollout_s: list[float]
    step_train_s: list[float]

    @property
    def rollout_per_step(self) -> float:
        return self.rollout_s / self.steps

    @property
    def train_per_step(self) -> float:
        return self.train_s / self.steps


def make_config(url: str, ckpt: Path, args: argparse.Namespace, *, staleness: int, steps: int) -> dict[str, Any]:
    rollout: dict[str, Any] = {"kind": "sglang", "timeoutSeconds": 120, "retries": 1, "readyTimeoutSeconds": 60}
    if staleness or supports_staleness():
        rollout["maxStaleness"] = staleness
    return {
        "model": {"path": "builtin:tiny-llama", "seed": 1},
        "actor": {
            "backend": "fsdp:d1",
            "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 1024, "blockSize": 16},
        },
        "trainer": {
            "steps": steps,
            "task": "builtin:parity",
            "taskArgs": {
                "turns": args.turns,
                "userTokens": 4,
                "systemTokens": 32,
                "maxNewTokens": args.max_new_tokens,
            },
            "groupsPerStep": args.groups,
            "groupSize": args.group_size,
            "optimizer": {"lr": 1e-3},
            "metrics": {"enabled": False},
            "threads": args.threads,
            "rollout": rollout,
        },
        "rollout": {"servers": [{"url": url, "kind": "sglang"}], "weightSync": {"method": "disk"}},
        "checkpoint": {"dir": str(ckpt), "intervalSteps": 1_000_000},  # one save, after the last step
    }


def supports_staleness() -> bool:
    return "max_staleness" in C.SamplingSettings.model_fields


def counter(trainer: Trainer, name: str) -> float | None:
    value = trainer.metrics.registry.get_sample_value(name)
    return None if value is None else float(value)


class StandinProcess:
    """bench/rollout_standin.py in a process of its own, as a rollout server is on its own
    machine: its HTTP threads then never hold the trainer's GIL."""

    def __init__(self, token_delay: float, max_running: int) -> None:
        cmd = [sys.executable, str(HERE / "rollout_standin.py"), "--token-delay", str(token_delay)]
        cmd += ["--vocab", str(VOCAB), "--max-running", str(max_running)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        if found is None:
            self.close()
            raise SystemExit(f"the rollout stand-in did not start: {line!r}")
        self.url = found[0]

    def busy_seconds(self) -> float:
        status, stats = http_json("GET", self.url + "/standin/stats", None, 30.0)
        assert status == 200, stats
        return float(stats["busy_seconds"])

    def __enter__(self) -> StandinProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run_mode(token_delay: float, args: argparse.Namespace, tmp: Path, *, staleness: int, steps: int, label: str) -> Run:
    ckpt = Path(tempfile.mkdtemp(prefix=f"s{staleness}-", dir=tmp))
    # The server's batch holds one step's requests: a bound >= 1 overlaps its work with
    # training, it does not make it generate two steps in the time of one.
    with StandinProcess(token_delay, args.groups * args.group_size) as standin:
        cfg = C.validate(make_config(standin.url, ckpt, args, staleness=staleness, steps=steps))
        lines: list[str] = []

        def log(line: str) -> None:
            lines.append(line)
            if line.startswith("step "):
                print(f"  [{label}] {line}", flush=True)

        trainer = Trainer(cfg, log=log)
        try:
            busy0, t0 = standin.busy_seconds(), time.monotonic()
            summary = trainer.run()
            server_busy, took = standin.busy_seconds() - busy0, time.monotonic() - t0
            trainer_idle = counter(trainer, "treetrain_trainer_idle_seconds_total")
            rollout_idle = counter(trainer, "treetrain_rollout_idle_seconds_total")
        finally:
            trainer.close()
    records: list[StepRecord] = summary.records
    found = [(int(m[1]), float(m[2])) for line in lines if (m := STALENESS.search(line))]
    rollout_s = sum(r.rollout_seconds for r in records)
    return Run(
        staleness=staleness,
        steps=len(records),
        wall_s=summary.seconds,
        rollout_s=rollout_s,
        train_s=sum(r.seconds - r.rollout_seconds for r in records),
        trainer_idle_s=rollout_s if trainer_idle is None else trainer_idle,
        rollout_idle_s=rollout_idle,
        server_idle_s=max(0.0, took - server_busy),
        server_window_s=took,
        staleness_max=max((k for k, _ in found), default=0),
        staleness_mean=sum(x for _, x in found) / len(found) if found else 0.0,
        rewards=[r.reward for r in records],
        step_rollout_s=[r.rollout_seconds for r in records],
        step_train_s=[r.seconds - r.rollout_seconds for r in records],
    )


def calibrate(args: argparse.Namespace, tmp: Path) -> float:
    """The per-token delay that makes a synchronous step's rollout time about its training time."""
    probe = run_mode(0.001, args, tmp, staleness=0, steps=4, label="calibrate")
    # The first step warms up (allocations, the first export): the later ones are the measure.
    train = statistics.median(probe.step_train_s[1:])
    # The generation alone: turns x maxNewTokens decode steps (a group's samples run at once).
    decode = int(args.turns) * int(args.max_new_tokens)
    overhead = max(0.0, statistics.median(probe.step_rollout_s[1:]) - 0.001 * decode)  # HTTP and task code per step
    delay = max(0.001, (train * float(args.rt_ratio) - overhead) / decode)
    print(
        f"calibration: training {train:.2f} s/step, rollout overhead {overhead:.2f} s/step "
        f"-> token delay {delay * 1000:.1f} ms",
        flush=True,
    )
    return delay


def report(runs: list[Run], token_delay: float) -> dict[str, Any]:
    sync = next(r for r in runs if r.staleness == 0)
    r_step, t_step = sync.rollout_per_step, sync.train_per_step
    ideal = (r_step + t_step) / max(r_step, t_step)
    n = sync.steps
    ideal_fill = n * (r_step + t_step) / (r_step + n * max(r_step, t_step))
    rows = []
    for run in runs:
        speedup = sync.wall_s / run.wall_s
        rows.append(
            {
                **asdict(run),
                "speedup": speedup,
                "fraction_of_ideal": speedup / ideal,
                "trainer_idle_fraction": run.trainer_idle_s / run.wall_s,
                "rollout_idle_fraction": None if run.rollout_idle_s is None else run.rollout_idle_s / run.wall_s,
                "server_idle_fraction": run.server_idle_s / run.server_window_s,
            }
        )
    return {
        "token_delay_s": token_delay,
        "rollout_per_step_s": r_step,
        "train_per_step_s": t_step,
        "ideal_speedup": ideal,
        "ideal_speedup_with_fill": ideal_fill,
        "runs": rows,
    }


def print_report(rep: dict[str, Any]) -> None:
    print(
        f"synchronous run: R = {rep['rollout_per_step_s']:.2f} s rollout, T = {rep['train_per_step_s']:.2f} s "
        f"training + weight sync per step (token delay {rep['token_delay_s'] * 1000:.1f} ms)"
    )
    print(
        f"ideal speed-up (R+T)/max(R,T) = {rep['ideal_speedup']:.2f}x "
        f"(ideal with fill over these steps: {rep['ideal_speedup_with_fill']:.2f}x)"
    )
    header = (
        f"{'mode':<16} {'steps':>5} {'wall s':>8} {'speed-up':>8} {'of ideal':>8} {'trainer idle':>12} "
        f"{'rollout idle':>12} {'server idle':>11} {'staleness max/mean':>18}"
    )
    print(header)
    for row in rep["runs"]:
        sync = row["staleness"] == 0
        mode = "synchronous" if sync else f"maxStaleness {row['staleness']}"
        of_ideal = "-" if sync else f"{row['fraction_of_ideal']:.2f}"
        rollout_idle = "n/a" if row["rollout_idle_fraction"] is None else f"{row['rollout_idle_fraction']:.0%}"
        print(
            f"{mode:<16} {row['steps']:>5} {row['wall_s']:>8.2f} {row['speedup']:>7.2f}x "
            f"{of_ideal:>8} {row['trainer_idle_fraction']:>12.0%} {rollout_idle:>12} "
            f"{row['server_idle_fraction']:>11.0%} {row['staleness_max']:>11}/{row['staleness_mean']:.2f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="modes to run; 0 is always run")
    ap.add_argument("--token-delay", default="auto", help="seconds per generated token, or auto (R about T)")
    ap.add_argument("--rt-ratio", type=float, default=1.0, help="auto: the rollout/training time ratio to aim at")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every mode; each mode's fastest is reported")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # the export's bar
    modes = sorted({0, *args.staleness})
    if any(m > 0 for m in modes) and not supports_staleness():
        raise SystemExit("this checkout has no trainer.rollout.maxStaleness yet: run with --staleness 0")
    print(
        f"async RL bench: builtin:tiny-llama on builtin:parity, {args.groups} groups x {args.group_size} samples, "
        f"{args.turns} turns of {args.max_new_tokens} tokens, {args.steps} steps per mode, modes {modes}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="async-rl-") as tmp:
        delay = calibrate(args, Path(tmp)) if args.token_delay == "auto" else float(args.token_delay)
        best: dict[int, Run] = {}
        for r in range(args.repeat):  # rounds of every mode: a busy spell of the machine hits them alike
            for mode in modes:
                label = ("sync" if mode == 0 else f"maxStaleness {mode}") + (
                    f", round {r + 1}" if args.repeat > 1 else ""
                )
                print(f"{label}: {args.steps} steps", flush=True)
                run = run_mode(delay, args, Path(tmp), staleness=mode, steps=args.steps, label=label)
                if mode not in best or run.wall_s < best[mode].wall_s:
                    best[mode] = run
    rep = report([best[m] for m in modes], delay)
    print_report(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2) + "\n")


if __name__ == "__main__":
    main()
