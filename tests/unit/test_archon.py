"""The Archon engine in one process: each family's model against transformers' (tree-packed vs
flat vs each sequence alone), the weight adapter both ways, RoPE scaling honoured or refused,
the engine against the FSDP engine for one optimizer step, critic tree vs flat, export to a
directory transformers loads, exact resume, local rollout's sampling model, and the mesh
mapping of every letter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.archon import FAMILY_CONFIGS, SEQS, hf_config, hf_logprobs, save_tiny

from treetrain.alloc import parse
from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings, ValueLossSettings
from treetrain.engines import EngineConfigError, build_engine
from treetrain.engines.archon import ArchonEngine, mesh_shapes
from treetrain.engines.archon.model import ModelArgs
from treetrain.engines.batch import TokenFields, TrainBatch
from treetrain.engines.grads import grad_norm
from treetrain.rl.losses import PPOLoss, ValueLoss

TREE = TreeTrainingSettings(max_tokens_per_mb=64, block_size=16)


def _batch(seqs: list[list[int]], seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    n = [len(s) - 1 for s in seqs]
    return TrainBatch(
        sequences=seqs,
        loss_mask=[(torch.rand(k, generator=g) > 0.2).float() for k in n],
        fields=TokenFields(
            advantages=[torch.randn(k, generator=g) for k in n],
            old_logprobs=[torch.full((k,), -4.8) for k in n],
            returns=[torch.rand(k, generator=g) for k in n],
        ),
    )


pytestmark = pytest.mark.usefixtures("engine_env")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archon-models")
    return {family: save_tiny(family, root / family) for family in FAMILY_CONFIGS}


def _engine(path: str | Path, role: str = "actor", optimizer: OptimizerSettings | None = None) -> ArchonEngine:
    engine = build_engine(ModelSettings(path=str(path)), "archon:d1", role=role, tree=TREE, optimizer=optimizer)
    assert isinstance(engine, ArchonEngine)
    return engine


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_tree_flat_and_alone_match_transformers(models: dict[str, Path], family: str) -> None:
    engine = _engine(models[family], optimizer=OptimizerSettings())
    want = hf_logprobs(models[family], SEQS)
    for use_tree in (True, False):
        got = engine.forward(SEQS, tree=use_tree)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    # Gradients: tree-packed equals flat (relative 1e-4), per parameter and in norm.
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    grads = []
    for use_tree in (True, False):
        stats = engine.forward_backward(_batch(SEQS), loss, tree=use_tree)
        grads.append((stats, engine.full_grads(), grad_norm(engine.model.parameters())))
        engine.zero_grad()
    (ts, tg, tn), (fs, fg, fn) = grads
    assert ts.tree_tokens < fs.tree_tokens
    assert abs(ts.loss - fs.loss) <= 1e-5 * abs(fs.loss) + 1e-7
    torch.testing.assert_close(tn, fn, rtol=1e-4, atol=0)
    for name in fg:
        torch.testing.assert_close(tg[name], fg[name], rtol=1e-4, atol=1e-6, msg=name)


def test_one_optimizer_step_equals_the_fsdp_engine(models: dict[str, Path]) -> None:
    opt = OptimizerSettings(lr=1e-3)
    loss = PPOLoss(LossSettings(clip_eps=0.2))
    for path in ("builtin:tiny-llama", str(models["qwen2"])):
        archon = build_engine(path, "archon:d1", tree=TREE, optimizer=opt)
        fsdp = build_engine(path, "fsdp:d1", tree=TREE, optimizer=opt)
        a, f = archon.forward_backward(_batch(SEQS), loss), fsdp.forward_backward(_batch(SEQS), loss)
        assert a.loss == pytest.approx(f.loss, rel=1e-5, abs=1e-7)
        assert archon.step() == pytest.approx(fsdp.step(), rel=1e-4)
        for x, y in zip(archon.forward(SEQS), fsdp.forward(SEQS), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_critic_tree_equals_flat(models: dict[str, Path]) -> None:
    critic = _engine(models["qwen3"], role="critic", optimizer=OptimizerSettings())
    loss = ValueLoss(ValueLossSettings())
    out = []
    for use_tree in (True, False):
        stats = critic.forward_backward(_batch(SEQS), loss, tree=use_tree)
        out.append((stats.loss, critic.full_grads()))
        critic.zero_grad()
    assert out[0][0] == pytest.approx(out[1][0], rel=1e-5)
    for name, g in out[1][1].items():
        torch.testing.assert_close(out[0][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    values = critic.forward(SEQS)
    assert torch.equal(values[1], values[2])  # a duplicate reads the same tokens
    with pytest.raises(EngineConfigError, match="only an actor exports"):
        critic.export_hf(Path("/nonexistent"))


def test_export_resume_and_sampling_model(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = _engine(models["qwen3_moe"], optimizer=OptimizerSettings(lr=1e-2))
    loss = PPOLoss(LossSettings())
    sampler = engine.sampling_model()
    versions = [p._version for p in sampler.parameters()]
    engine.forward_backward(_batch(SEQS), loss)
    engine.step()
    assert [p._version for p in sampler.parameters()] != versions, "the sampling model follows the steps"
    engine.export_hf(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, p in hf.state_dict().items():
        torch.testing.assert_close(p, sampler.state_dict()[name], msg=name)
    for got, want in zip(engine.forward(SEQS), hf_logprobs(tmp_path / "hf", SEQS), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Exact resume: the step after a load repeats the step after the save.
    engine.save(tmp_path / "ckpt", {"step": 1})
    after = []
    for _ in range(2):
        engine.forward_backward(_batch(SEQS), loss)
        engine.step()
        after.append(engine.forward_backward(_batch(SEQS, seed=1), loss).loss)
        engine.zero_grad()
        assert engine.load(tmp_path / "ckpt") == {"step": 1}
    assert after[0] == after[1]


def test_padding_is_never_routed(models: dict[str, Path]) -> None:
    from treetrain.engines.archon.model import MoE

    engine = _engine(models["qwen3_moe"])
    moe = next(m for m in engine.model.modules() if isinstance(m, MoE))
    counts = []
    moe.experts.register_forward_hook(lambda mod, args, out: counts.append(int(args[1].sum())))
    engine.forward([SEQS[-1]])  # 7 real tokens in a 16-token tree
    assert counts == [7 * 2]


def test_rope_scaling_and_unsupported_configs_are_refused() -> None:
    from transformers import AutoConfig

    yarn = AutoConfig.for_model("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(EngineConfigError, match="RoPE scaling 'yarn' is not supported"):
        ModelArgs.from_hf(yarn)
    with pytest.raises(EngineConfigError, match="sliding-window"):
        ModelArgs.from_hf(AutoConfig.for_model("qwen2", use_sliding_window=True))
    with pytest.raises(EngineConfigError, match="no 'gpt2' model"):
        ModelArgs.from_hf(AutoConfig.for_model("gpt2"))


@pytest.mark.parametrize(
    ("backend", "mesh", "grid", "experts"),
    [
        ("archon:d4", (1, 4, 1), (1, 4, 1, 1), (1, 4, 1, 1)),
        ("archon:t4", (1, 1, 4), (1, 1, 1, 4), (1, 4, 1, 1)),
        ("archon:p2d2", (2, 2, 1), (2, 2, 1, 1), (2, 2, 1, 1)),
        ("archon:d2c2", (1, 4, 1), (1, 2, 2, 1), (1, 4, 1, 1)),
        ("archon:d4e2", (1, 4, 1), (1, 4, 1, 1), (1, 2, 2, 1)),
        ("archon:(attn:d2t2|ffn:t2e2)", (1, 2, 2), (1, 2, 1, 2), (1, 1, 2, 2)),
        ("archon:p2d2t2c2", (2, 4, 2), (2, 2, 2, 2), (2, 8, 1, 1)),
    ],
)
def test_one_mesh_mapping_for_every_letter(
    backend: str, mesh: tuple[int, ...], grid: tuple[int, ...], experts: tuple[int, ...]
) -> None:
    shapes = mesh_shapes(parse(backend))
    assert (shapes["mesh"], shapes["grid"], shapes["experts"]) == (mesh, grid, experts)


def test_tensor_parallel_sizes_are_checked(models: dict[str, Path]) -> None:
    from treetrain.engines.archon.parallelize import check_tp

    args = ModelArgs.from_hf(hf_config("llama3"))
    with pytest.raises(EngineConfigError, match=r"t2 must divide the attention heads \(3\).*fix: t in \{1\}"):
        check_tp(args, 2)
