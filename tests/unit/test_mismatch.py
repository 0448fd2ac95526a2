"""The train/rollout log-prob mismatch: measured every step from the sampler's own log-probs
and the trainer's recomputed ones, exported and logged."""

from __future__ import annotations

import pytest
from suite_helpers import small

from treetrain import config as C
from treetrain.metrics import StepRecord, TrainerMetrics
from treetrain.trainer.lines import format_record
from treetrain.trainer.loop import Trainer

pytestmark = pytest.mark.usefixtures("trainer_env")


def test_local_rollout_and_the_trainer_agree_on_every_token() -> None:
    # Local rollout samples with the trainer's own model (left-padded batches, a KV cache):
    # the tree-packed recomputation must give the same log-probs, so the mismatch is ~0.
    trainer = Trainer(C.validate(small(steps=1)), log=lambda _: None)
    try:
        (rec,) = trainer.run().records
    finally:
        trainer.close()
    assert 0.0 <= rec.stats["behav_mismatch"] <= rec.stats["behav_mismatch_max"] < 1e-4, rec.stats
    assert "logprob mismatch" in format_record(rec, 1)


def test_the_gauge_family_has_a_mean_and_a_max() -> None:
    metrics = TrainerMetrics()
    stats = {"behav_mismatch": 0.01, "behav_mismatch_max": 0.2}
    metrics.observe_step(
        StepRecord(step=1, tree_token_ratio=0.5, original_tokens=10, seconds=1.0, loss=0.0, reward=0.0, stats=stats)
    )
    samples = {(s.name, s.labels.get("stat")): s.value for f in metrics.registry.collect() for s in f.samples}
    assert samples[("treetrain_rollout_logprob_mismatch", "mean")] == 0.01
    assert samples[("treetrain_rollout_logprob_mismatch", "max")] == 0.2
