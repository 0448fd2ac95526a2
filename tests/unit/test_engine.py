"""The engine factory and the FSDP engine in one process: a training step, log-probs equal to
``treetrain.tree_logprobs``, Hugging Face directories in and out, the critic's value head on
a saved causal LM, and one-line errors for layouts no engine here runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import treetrain
from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import EngineConfigError, build_engine
from treetrain.engines.batch import TokenFields, TrainBatch
from treetrain.engines.fsdp import FSDPEngine
from treetrain.engines.grads import grad_norm
from treetrain.engines.source import ModelSource
from treetrain.rl.losses import PPOLoss

SEQS = [[1, 9, 12, 30, 31, 32], [1, 9, 12, 40, 41], [1, 9, 50, 51, 52, 53, 54]]
TREE = TreeTrainingSettings(max_tokens_per_mb=64, block_size=16)


pytestmark = pytest.mark.usefixtures("engine_env")


def _engine(path: str, role: str = "actor", optimizer: OptimizerSettings | None = None) -> FSDPEngine:
    engine = build_engine(ModelSettings(path=path, seed=5), "fsdp:d1", role=role, tree=TREE, optimizer=optimizer)
    assert isinstance(engine, FSDPEngine)
    return engine


def _batch(seqs: list[list[int]]) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    n = [len(s) - 1 for s in seqs]
    return TrainBatch(
        sequences=seqs,
        loss_mask=[torch.ones(k) for k in n],
        fields=TokenFields(
            advantages=[torch.randn(k, generator=g) for k in n],
            old_logprobs=[torch.full((k,), -6.0) for k in n],
        ),
    )


def test_build_engine_trains_one_step() -> None:
    engine = build_engine(
        "builtin:tiny-llama", "fsdp:d1", tree=TREE, optimizer=OptimizerSettings(lr=1e-2, max_grad_norm=0.5)
    )
    assert isinstance(engine, FSDPEngine) and engine.attention == "sparse" and engine.block_size == 16
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.forward_backward(_batch(SEQS), PPOLoss(LossSettings()))
    assert stats.tree_tokens < stats.original_tokens and stats.micro_batches == 1
    want = grad_norm(engine.model.parameters())
    ref = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in engine.model.parameters()]))
    torch.testing.assert_close(want, ref)
    assert engine.optimizer is not None
    real_step, seen = engine.optimizer.step, []

    def step(*args: object, **kwargs: object) -> None:
        seen.append(float(grad_norm(engine.model.parameters())))
        real_step()

    engine.optimizer.step = step  # type: ignore[method-assign]
    norm = engine.step()
    assert norm == pytest.approx(float(ref), rel=1e-6) and norm > 0.5  # the norm before clipping
    assert seen == [pytest.approx(0.5, rel=1e-5)]  # the optimizer saw clipped gradients
    assert all(p.grad is None for p in engine.model.parameters())
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)


def test_forward_equals_tree_logprobs_on_a_branching_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine("builtin:tiny-llama", "fsdp:d1", tree=TREE)  # no optimizer: forward only
    assert not any(p.requires_grad for p in engine.model.parameters())
    seqs = [*SEQS, [1, 9, 12, 30, 31, 32, 33, 34], [7, 8], [1, 9, 12]]
    got = engine.forward(seqs)
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "16")
    monkeypatch.delenv("TREETRAIN_ATTENTION")
    with torch.no_grad():
        want = treetrain.tree_logprobs(engine.model, seqs, max_tokens_per_mb=64, attention="sparse")
    assert [g.shape for g in got] == [(len(s) - 1,) for s in seqs]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("fsdp:c2d4", "context parallelism is not supported by the FSDP engine yet (c2 in 'fsdp:d4c2')"),
        ("fsdp:c2", "context parallelism is not supported by the FSDP engine yet (c2 in 'fsdp:c2'); fix: "),
        ("fsdp:x2", "fsdp:x2"),
        ("fsdp:d2", "backend 'fsdp:d2' needs 2 processes but 1 were started; run torchrun --nproc-per-node 2"),
    ],
)
def test_backends_the_factory_refuses(backend: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        build_engine("builtin:tiny-llama", backend, tree=TREE)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_bad_arguments_are_refused_before_any_work() -> None:
    with pytest.raises(EngineConfigError, match="role must be one of actor, critic, ref, got 'judge'"):
        build_engine("builtin:tiny-llama", "fsdp:d1", role="judge")
    with pytest.raises(EngineConfigError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        build_engine("builtin:tiny-llama", "fsdp:d1", dtype="fp8")
    with pytest.raises(EngineConfigError, match="dtype='bfloat16' conflicts with the settings' float32"):
        build_engine(ModelSettings(path="builtin:tiny-llama", dtype="float32"), "fsdp:d1", dtype="bfloat16")
    with pytest.raises(EngineConfigError, match="unknown built-in model 'builtin:gpt-5'"):
        build_engine("builtin:gpt-5", "fsdp:d1")
    with pytest.raises(EngineConfigError, match=r"cannot load model.path ./no/such/model."):
        build_engine("/no/such/model", "fsdp:d1")


def test_the_model_source_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from treetrain.engines import builtin

    calls = []
    real = builtin.random_config
    monkeypatch.setattr(builtin, "random_config", lambda path: calls.append(path) or real(path))
    engine = _engine("builtin:tiny-llama", role="critic", optimizer=OptimizerSettings())
    assert calls == ["builtin:tiny-llama"]
    assert engine.source.random and engine.source.directory is None and engine.source.load_tokenizer() is None
    assert engine.source.config.vocab_size == 512


@pytest.mark.usefixtures("megatron_one_process")  # leaves no one-rank process group behind
def test_bfloat16_in_one_process_computes_in_bf16_over_fp32_master_weights(tmp_path: Path) -> None:
    # d = 1 too: FSDP2 over a one-rank mesh casts the fp32 weights (treetrain/alloc/precision.py).
    engine = build_engine("builtin:tiny-llama", "fsdp:d1", tree=TREE, optimizer=OptimizerSettings(), dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert (engine.precision.compute, engine.precision.params, engine.precision.fsdp) == ("bfloat16", "float32", True)
    seen: list[torch.dtype] = []
    layer = engine.model.get_submodule("model.layers.0.mlp.down_proj")
    layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    engine.forward_backward(_batch(SEQS), PPOLoss(LossSettings()))
    assert seen == [torch.bfloat16]
    assert {p.grad.dtype for p in engine.model.parameters() if p.grad is not None} == {torch.float32}
    assert engine.step() > 0
    assert all(out.dtype == torch.float32 for out in engine.forward(SEQS))
    # Rollout servers get model.dtype, not the masters: bf16 tensors, a bf16 config.
    engine.export_hf(tmp_path)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_auto_dtype_is_float32_on_the_cpu() -> None:
    engine = build_engine("builtin:tiny-llama", "fsdp:d1", tree=TREE)
    assert (engine.settings.dtype, engine.precision.fsdp) == ("float32", False)  # nothing to cast: plain modules
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}


def test_export_then_train_from_the_directory(tmp_path: Path) -> None:
    actor = _engine("builtin:tiny-llama", optimizer=OptimizerSettings(lr=1e-3))
    want = actor.forward(SEQS)
    actor.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()

    reloaded = _engine(str(tmp_path / "hf"))
    assert reloaded.source.directory == str(tmp_path / "hf") and not reloaded.source.random
    for got, ref in zip(reloaded.forward(SEQS), want, strict=True):
        torch.testing.assert_close(got, ref)
    # Tree and flat log-probs agree (no-grad path).
    for a, b in zip(reloaded.forward(SEQS, tree=True), reloaded.forward(SEQS, tree=False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    critic = _engine(str(tmp_path / "hf"), role="critic", optimizer=OptimizerSettings(lr=1e-3))
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
    with pytest.raises(RuntimeError, match="without an optimizer"):
        ref.step()


def test_tree_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        build_engine("builtin:tiny-llama", "fsdp:d1", tree=TreeTrainingSettings(max_tokens_per_mb=40, block_size=16))
    with pytest.raises(ValueError, match="'flex' has no backward on cpu"):
        build_engine(
            "builtin:tiny-llama",
            "fsdp:d1",
            tree=TREE.model_copy(update={"attention": "flex"}),
            optimizer=OptimizerSettings(),
        )
    # Forward only, flex runs on the CPU (no backward needed).
    assert (
        build_engine("builtin:tiny-llama", "fsdp:d1", tree=TREE.model_copy(update={"attention": "flex"})).attention
        == "flex"
    )


def test_model_source_resolves_a_settings_object_or_a_path() -> None:
    a = ModelSource.resolve("builtin:tiny-llama")
    b = ModelSource.resolve(ModelSettings(path="builtin:tiny-llama", seed=2))
    assert a.path == b.path == "builtin:tiny-llama" and b.settings.seed == 2
    assert a.config.attention_dropout == 0.0


def test_train_batch_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must have shape \(5,\)"):
        TrainBatch(sequences=[SEQS[0]], loss_mask=[torch.ones(6)])
    with pytest.raises(ValueError, match="needs at least 2"):
        TrainBatch(sequences=[[3]], loss_mask=[torch.ones(0)])
