"""The FSDP engine in one process: Hugging Face directories in and out, the critic's value
head on a saved causal LM, and clear errors for layouts it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from treetrain.engines.base import EngineConfigError, OptimConfig, TrainBatch, TreeTrainingConfig
from treetrain.engines.fsdp import FSDPEngine, ModelConfig
from treetrain.engines.parallel import allocation_for, init_distributed

SEQS = [[1, 9, 12, 30, 31, 32], [1, 9, 12, 40, 41], [1, 9, 50, 51, 52, 53, 54]]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "16")
    monkeypatch.delenv("TREETRAIN_ATTENTION", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _engine(path: str, role: str = "actor", optim: OptimConfig | None = None) -> FSDPEngine:
    layout = init_distributed("fsdp:d1")
    return FSDPEngine(
        ModelConfig(path=path, seed=5), layout, TreeTrainingConfig(max_tokens_per_mb=64), optim, role=role
    )


def test_export_then_train_from_the_directory(tmp_path: Path) -> None:
    actor = _engine("builtin:tiny-llama", optim=OptimConfig(lr=1e-3))
    want = actor.forward(SEQS)
    actor.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()

    reloaded = _engine(str(tmp_path / "hf"))
    for got, ref in zip(reloaded.forward(SEQS), want, strict=True):
        torch.testing.assert_close(got, ref)
    # Tree and flat log-probs agree (no-grad path).
    for a, b in zip(reloaded.forward(SEQS, tree=True), reloaded.forward(SEQS, tree=False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    critic = _engine(str(tmp_path / "hf"), role="critic", optim=OptimConfig(lr=1e-3))
    backbone = dict(critic.model.named_parameters())
    for name, p in reloaded.model.named_parameters():
        if name.startswith("model."):  # the causal LM's backbone is the critic's backbone
            torch.testing.assert_close(backbone["backbone." + name.removeprefix("model.")], p)
    values = critic.forward(SEQS)
    assert [v.shape[0] for v in values] == [len(s) - 1 for s in SEQS]
    # Shared prefix tokens have one value, whichever sequence reads it.
    assert torch.equal(values[0][:3], values[1][:3])
    with pytest.raises(EngineConfigError, match="only an actor exports"):
        critic.export_hf(tmp_path / "critic")


def test_a_ref_cannot_train() -> None:
    ref = _engine("builtin:tiny-llama", role="ref")
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = TrainBatch(sequences=SEQS, loss_mask=[torch.ones(len(s) - 1) for s in SEQS])
    with pytest.raises(RuntimeError, match="without an optimizer"):
        ref.forward_backward(batch, lambda *a: (torch.zeros(()), {}))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("fsdp:d2c2", "context parallelism (c2 in 'fsdp:d2c2') is not supported by the FSDP engine yet"),
        ("megatron:d2p2", "this trainer runs the FSDP engine"),
        ("fsdp:x2", "fsdp:x2"),
    ],
)
def test_layouts_the_engine_cannot_run(backend: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        allocation_for(backend)
    assert message in str(err.value)


def test_tree_settings_are_checked() -> None:
    with pytest.raises(EngineConfigError, match="maxTokensPerMicrobatch must be a positive integer"):
        TreeTrainingConfig(max_tokens_per_mb=-5)
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        _engine_with_cap(40)


def _engine_with_cap(cap: int) -> FSDPEngine:
    layout = init_distributed("fsdp:d1")
    return FSDPEngine(ModelConfig(path="builtin:tiny-llama"), layout, TreeTrainingConfig(max_tokens_per_mb=cap))


def test_train_batch_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must have shape \(5,\)"):
        TrainBatch(sequences=[SEQS[0]], loss_mask=[torch.ones(6)])
    with pytest.raises(ValueError, match="needs at least 2"):
        TrainBatch(sequences=[[3]], loss_mask=[torch.ones(0)])
