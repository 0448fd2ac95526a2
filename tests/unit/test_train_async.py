"""The trainer with asynchronous rollout (``trainer.rollout.maxStaleness`` >= 1) against the
rollout stand-in (bench/rollout_standin.py: SGLang's dialect on loopback, simulated generation
time): it finishes, stays within the bound with some samples a step stale (rollout overlapped
training), exports the rollout metrics, and a SIGTERM + resume neither loses nor repeats a group.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from suite_helpers import small

from treetrain import config as C
from treetrain.metrics import StepRecord
from treetrain.trainer.loop import Trainer
from treetrain.trainer.rollout import ROLLOUT_STATE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout_standin import RolloutStandin

STALENESS = re.compile(r" \| staleness max (\d+) mean (\d+\.\d\d)$")


@pytest.fixture
def standin() -> Iterator[RolloutStandin]:
    # A few ms per token: rollout takes about as long as a tiny training step.
    with RolloutStandin(token_delay_s=0.004, vocab=512, seed=0) as server:
        yield server


def config(url: str, ckpt: Path, *, staleness: int | None, steps: int = 4) -> dict[str, Any]:
    """test_train's small config against the stand-in, weights synced by disk."""
    rollout: dict[str, Any] = {"kind": "sglang", "timeoutSeconds": 60, "retries": 1, "readyTimeoutSeconds": 60}
    if staleness is not None:
        rollout["maxStaleness"] = staleness
    cfg = small(ckpt, steps=steps, rollout=rollout)
    cfg["checkpoint"]["intervalSteps"] = 1000
    return {**cfg, "rollout": {"servers": [{"url": url, "kind": "sglang"}], "weightSync": {"method": "disk"}}}


def run(cfg: dict[str, Any], **kw: Any) -> tuple[Trainer, list[StepRecord], list[str]]:
    lines: list[str] = []
    trainer = Trainer(C.validate(cfg), log=lines.append, **kw)
    try:
        records = trainer.run().records
    finally:
        trainer.close()
    return trainer, records, lines


def test_max_staleness_one_overlaps_rollout_with_training_within_the_bound(
    standin: RolloutStandin, tmp_path: Path
) -> None:
    # Unset with servers is 1.
    trainer, records, lines = run(config(standin.url, tmp_path, staleness=None))
    assert trainer.rollout.max_staleness == 1
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 4 and all(STALENESS.search(line) for line in steps), steps
    found = [(int(m[1]), float(m[2])) for line in steps if (m := STALENESS.search(line))]
    assert all(k <= 1 for k, _ in found)
    assert any(k == 1 for k, _ in found)  # groups of a step were sampled while the one before trained
    assert found[0] == (0, 0.0)  # the first step's groups start from the initial weights
    assert [str(v) for _, v in standin.loads] == ["1", "2", "3", "4"]  # every step's weights reached the server
    reg = trainer.metrics.registry
    n = 4 * 2 * 2 * 2  # steps x groups x samples x turns
    assert reg.get_sample_value("treetrain_rollout_staleness_count") == n
    assert reg.get_sample_value("treetrain_rollout_staleness_bucket", {"le": "1.0"}) == n
    assert reg.get_sample_value("treetrain_weight_version") == 4
    for reason in ("filtered", "failed"):
        assert reg.get_sample_value("treetrain_rollout_groups_dropped_total", {"reason": reason}) == 0
    assert all(r.trainer_idle_seconds >= 0 and r.rollout_idle_seconds >= 0 for r in records)


def test_max_staleness_zero_with_servers_is_the_synchronous_loop(standin: RolloutStandin, tmp_path: Path) -> None:
    trainer, records, lines = run(config(standin.url, tmp_path, staleness=0, steps=2))
    assert trainer.rollout.max_staleness == 0 and trainer.rollout.scheduler is not None
    assert trainer.rollout.scheduler.state() is None  # the step's groups played inline: nothing between steps
    assert not any("staleness" in line for line in lines if line.startswith("step "))
    reg = trainer.metrics.registry
    assert reg.get_sample_value("treetrain_rollout_staleness_bucket", {"le": "0.0"}) == 2 * 2 * 2 * 2
    # Synchronous: the trainer waits through every rollout, the server through every training step.
    assert all(r.trainer_idle_seconds > 0 and r.rollout_idle_seconds > 0 for r in records)


def test_sigterm_keeps_the_rollout_buffer_and_the_resumed_run_trains_every_group_once(
    standin: RolloutStandin, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    raw = config(standin.url, ckpt, staleness=2, steps=5)
    taken: list[tuple[int, list[int], list[list[int]]]] = []
    trainer = recording(Trainer(C.validate(raw), log=lambda _: None), taken, sigterm_after=1)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
    assert summary.interrupted and [r.step for r in summary.records] == [1, 2]
    state = json.loads((ckpt / "step-00000002" / ROLLOUT_STATE).read_text())
    assert state["next_step"] == 2

    again = recording(Trainer(C.validate(raw), log=lambda _: None), taken)
    try:
        resumed = again.run()
    finally:
        again.close()
    assert resumed.start_step == 2 and [r.step for r in resumed.records] == [3, 4, 5]
    assert [(s, g) for s, g, _ in taken] == [(k, [0, 1]) for k in range(5)]  # every step's groups, once
    # The groups buffered before the stop were trained as they were sampled (none played again).
    buffered = {int(s) for s, v in state["steps"].items() if v["done"]}
    for s, _, tokens in taken:
        if s in buffered:
            done = state["steps"][str(s)]["done"]
            saved = [smp["tokens"] for g in sorted(done, key=int) for smp in done[g]["samples"]]
            assert all(t in tokens for t in saved)


def recording(
    trainer: Trainer, taken: list[tuple[int, list[int], list[list[int]]]], sigterm_after: int = -1
) -> Trainer:
    """``trainer`` noting every step it takes (step, group ids, sample tokens) into ``taken``,
    and sending itself SIGTERM (as Kubernetes does) after taking step ``sigterm_after``."""
    take = trainer.rollout.take

    def noted(step: int) -> Any:
        rollouts = take(step)
        taken.append((step, sorted(set(rollouts.groups)), [s.tokens for s in rollouts.samples]))
        if step == sigterm_after:
            signal.raise_signal(signal.SIGTERM)
        return rollouts

    trainer.rollout.take = noted  # type: ignore[method-assign]
    return trainer


def test_train_step_alone_starts_the_controller(standin: RolloutStandin, tmp_path: Path) -> None:
    """Tests and tools that drive train_step themselves (no run()) get asynchronous rollout too."""
    trainer = Trainer(C.validate(config(standin.url, tmp_path, staleness=1, steps=2)), log=lambda _: None)
    try:
        first, second = trainer.train_step(0), trainer.train_step(1)
    finally:
        trainer.close()
    assert trainer.rollout.scheduler is not None and trainer.rollout.scheduler.max_staleness == 1
    assert first.stats["staleness_max"] == 0 and second.stats["staleness_max"] <= 1
