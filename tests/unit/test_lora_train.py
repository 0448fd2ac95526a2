"""`treetrain train` with ``actor.lora`` on every engine: the base stays frozen, local
rollout samples with the adapter being trained, and a run stopped by SIGTERM then resumed gives
the same next steps and the same adapter as a run never stopped (the checkpoint holds the
adapter and its optimizer state only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from suite_helpers import sigterm_after_each_step, small

from treetrain import config as C
from treetrain.trainer.loop import Trainer

LORA = {"rank": 4, "alpha": 8.0}
BACKENDS = ["fsdp:d1", "archon:d1", "megatron:d1"]


def lora_run(backend: str, tmp: Path | None = None) -> dict[str, Any]:
    # A reference model with KL makes the loss non-trivial (on-policy GRPO alone sums to ~0).
    cfg = small(tmp, loss={"klCoef": 0.05})
    cfg["actor"] |= {"backend": backend, "lora": LORA}
    cfg["ref"] = {}
    return cfg


def frozen(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The base model's weights (what LoRA must leave alone)."""
    return {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters() if not p.requires_grad}


def adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    weights = trainer.actor.adapter_weights()
    assert weights, "a LoRA run holds an adapter"
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lora_run_stopped_by_sigterm_resumes_exactly(backend: str, tmp_path: Path) -> None:
    straight = Trainer(C.validate(lora_run(backend)), log=lambda _: None)
    base = frozen(straight)
    assert base, "the base weights are frozen"
    want = straight.run().records
    want_adapter, after = adapter(straight), frozen(straight)
    straight.close()
    assert all(torch.equal(after[n], base[n]) for n in base), "training moved a frozen base weight"
    assert any(b.abs().max() > 0 for k, b in want_adapter.items() if "lora_B" in k), "the adapter did not train"

    first = Trainer(C.validate(lora_run(backend, tmp_path)), log=lambda _: None)
    sigterm_after_each_step(first)
    stopped = first.run()
    first.close()
    assert stopped.interrupted and [r.step for r in stopped.records] == [1]
    saved = {p.name: p.stat().st_size for p in (tmp_path / "step-00000001").rglob("*") if p.is_file()}
    assert "adapter_model.safetensors" in saved, saved
    # The adapter and its optimizer state only: the whole checkpoint is smaller than the base alone.
    assert sum(saved.values()) < sum(t.numel() * t.element_size() for t in base.values()), saved

    lines: list[str] = []
    resumed = Trainer(C.validate(lora_run(backend, tmp_path)), log=lines.append)
    got = resumed.run()
    assert got.start_step == 1 and [r.step for r in got.records] == [2, 3]
    assert any("resumed from" in line for line in lines), lines
    for a, b in zip(want[1:], got.records, strict=True):
        assert (a.loss, a.reward, a.grad_norm, a.stats) == (b.loss, b.reward, b.grad_norm, b.stats), a.step
    assert want[2].loss != 0.0
    got_adapter = adapter(resumed)
    assert got_adapter.keys() == want_adapter.keys()
    for key, value in want_adapter.items():
        assert torch.equal(got_adapter[key], value), key
    resumed.close()
