"""``trainer.rollout.maxStaleness: 1`` against the REAL vLLM server (conftest.py's, SmolLM2-135M).

A short run: 3 steps of 2 groups x 2 one-turn arithmetic episodes. With the bound 1, step k's
groups may start on weights k - 1, so while step 1 trains the producer already generates step 2
on version 0 (or 1): the step lines report staleness at most 1, and some trained samples are at
exactly 1, which only an overlap of rollout and training can give.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from real_vllm import VLLMServer, short_run

from treetrain import config as C
from treetrain.trainer.loop import Trainer

STALENESS = re.compile(r"\| staleness max (\d+) mean ([\d.]+)")


def async_config(server: VLLMServer, tmp: Path, *, steps: int = 3) -> dict[str, Any]:
    """real_vllm's short run, asynchronous (bound 1), with checkpoints for its weight versions."""
    raw: dict[str, Any] = short_run(server, tmp, steps=steps, max_staleness=1)
    raw["checkpoint"] = {"dir": str(tmp / "ckpt"), "intervalSteps": 100}
    return raw


def test_max_staleness_1_overlaps_rollout_and_training(vllm: VLLMServer, tmp_path: Path) -> None:
    lines: list[str] = []
    trainer = Trainer(C.validate(async_config(vllm, tmp_path)), log=lines.append)
    try:
        summary = trainer.run()
        at_most = {
            le: trainer.metrics.registry.get_sample_value("treetrain_rollout_staleness_bucket", {"le": le})
            for le in ("0.0", "1.0", "+Inf")
        }
    finally:
        trainer.close()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(summary.records) == 3 and len(steps) == 3, lines
    found = [(int(m[1]), float(m[2])) for line in steps if (m := STALENESS.search(line))]
    assert len(found) == 3, steps  # every asynchronous step line reports its staleness
    assert all(k <= 1 and 0.0 <= mean <= 1.0 for k, mean in found), steps
    assert any(k == 1 for k, _ in found), steps  # some samples were generated while a step trained
    assert steps[0].find("staleness max 0 ") >= 0, steps  # step 1 can only be sampled by the initial weights
    # The histogram agrees: every trained sample within the bound, some at exactly 1.
    assert at_most["1.0"] == at_most["+Inf"] == 3 * 2 * 2, at_most
    assert at_most["0.0"] is not None and at_most["0.0"] < at_most["1.0"], at_most
