"""Expert parallel in the Archon engine on 2 CPU processes over gloo, a tiny random Qwen3-MoE
(4 experts, top 2): ``archon:(attn:d2|ffn:e2)`` (two experts a rank, tokens dispatched by
all-to-all) and ``(attn:d2|ffn:t2)`` (expert tensor parallel: every expert's FFN width split)
give tree-packed and flat losses, gradient norms and log-probs equal to each sequence alone
through transformers; ``e2`` exports Hugging Face weights identical to the engine's and resumes
exactly from a DCP checkpoint; ``treetrain train`` runs a hybrid MoE string under torchrun; and
the refusals name their fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_batch, merge, save_hf_model, spawn_ranks, step_lines, torchrun
from helpers.archon import (
    FAMILY_CONFIGS,
    check_logprobs,
    check_tree_and_flat,
    hf_config,
    hf_logprobs,
    hf_reference,
    save_tiny,
)
from suite_helpers import small

TREE = {"max_tokens_per_mb": 64, "block_size": 16}


def _check(model_dir: str, backend: str, tmp: Path, *, round_trip: bool) -> None:
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch(vocab=128)
    tree = TreeTrainingSettings(**TREE)
    engine = build_engine(ModelSettings(path=model_dir), backend, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
    experts = engine.model.get_parameter("layers.0.moe.experts.w1")
    assert experts.to_local().shape[0] * engine.layout.ep == 4  # each rank holds E / ep experts
    reference = hf_reference(model_dir, "actor", batch, loss)
    check_tree_and_flat(engine, batch, loss, reference, engine.model.parameters, backend)
    want = hf_logprobs(model_dir, batch.sequences)
    check_logprobs(engine, batch.sequences, want)
    # One sequence: the other data rank runs an empty tree and still joins every exchange.
    (alone,) = engine.forward(batch.sequences[:1])
    torch.testing.assert_close(alone, want[0], rtol=0, atol=1e-5)
    if not round_trip:
        return
    # One step, then a Hugging Face round trip: transformers loads the very tensors we hold.
    engine.forward_backward(batch, loss)
    engine.step()
    exported = tmp / "export-e2"
    engine.export_hf(exported)
    from transformers import AutoModelForCausalLM

    from treetrain.engines.archon.model.hf import to_hf

    ours = to_hf(engine.full_state(), tie_embeddings=False)
    reloaded = AutoModelForCausalLM.from_pretrained(exported)
    on_disk = {**reloaded.state_dict()}
    for name in [k for k in on_disk if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate, up = on_disk.pop(name).chunk(2, dim=1)
        down = on_disk.pop(prefix + "down_proj")
        for e in range(gate.shape[0]):
            on_disk[f"{prefix}{e}.gate_proj.weight"] = gate[e]
            on_disk[f"{prefix}{e}.up_proj.weight"] = up[e]
            on_disk[f"{prefix}{e}.down_proj.weight"] = down[e]
    assert ours.keys() == on_disk.keys(), set(ours) ^ set(on_disk)
    for key, tensor in ours.items():
        assert torch.equal(tensor, on_disk[key]), key
    # Exact resume: DCP restores the sharded experts and their optimizer state.
    ckpt = tmp / "ckpt-e2"
    engine.save(ckpt, {"step": 1})
    after = []
    for _ in range(2):
        engine.forward_backward(batch, loss)
        engine.step()
        after.append((engine.forward_backward(batch, loss).loss, engine.step()))
        assert engine.load(ckpt) == {"step": 1}
    assert after[0] == after[1], after


def _checks(tmp: str, cases: list[tuple[str, bool]]) -> None:
    for backend, round_trip in cases:
        _check(str(Path(tmp) / "qwen3_moe"), backend, Path(tmp), round_trip=round_trip)


@pytest.mark.slow
def test_expert_parallel_matches_transformers(tmp_path: Path) -> None:
    save_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    spawn_ranks(_checks, 2, str(tmp_path), [("archon:(attn:d2|ffn:e2)", True), ("archon:(attn:d2|ffn:t2)", False)])


@pytest.mark.slow
def test_torchrun_trains_a_hybrid_moe_string(tmp_path: Path) -> None:
    """``treetrain train`` under torchrun (2 CPU ranks, gloo) with ``archon:(attn:d2|ffn:e2)``:
    2 tree-packed GRPO steps on a tiny Qwen3-MoE, local rollout sampled from the gathered experts."""

    fields = {**FAMILY_CONFIGS["qwen3_moe"], "vocab_size": 512}  # the parity task's token ids
    save_hf_model(tmp_path / "moe", fields.pop("model_type"), seed=0, **fields)
    backend = "archon:(attn:d2|ffn:e2)"
    raw = merge(small(), {"model": {"path": str(tmp_path / "moe")}, "actor": {"backend": backend}})
    raw["trainer"]["steps"] = 2
    done = torchrun(raw, tmp_path / "c.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_lines(done) == ["step 1/2", "step 2/2"], done.stdout[-2000:]
    assert backend in done.stdout and "tree packing on" in done.stdout


def test_expert_strings_pass_validation_and_bad_sizes_are_refused() -> None:

    from treetrain.alloc import parse
    from treetrain.config.backends import check_training_backend
    from treetrain.engines import EngineConfigError
    from treetrain.engines.archon.experts import check_ep
    from treetrain.engines.archon.model import ModelArgs

    for backend in ("archon:d2e2", "archon:(attn:d2|ffn:e2)", "archon:(attn:d4|ffn:e2t2)"):
        dims = check_training_backend(backend).dims
        assert dims.ep * dims.etp > 1
    moe = ModelArgs.from_hf(hf_config("qwen3_moe"))  # 4 experts, expert FFN width 32
    check_ep(moe, parse("archon:d4e4").dims)
    with pytest.raises(EngineConfigError, match=r"e3 must divide the experts \(4\); fix: e in \{1, 2, 4\}"):
        check_ep(moe, parse("archon:d3e3").dims)
    with pytest.raises(EngineConfigError, match=r"ffn t3 must divide the expert FFN width \(32\); fix: ffn t in"):
        check_ep(moe, parse("archon:(attn:d3|ffn:t3)").dims)
    with pytest.raises(EngineConfigError, match=r"this qwen3 model has none; fix: .* e\.g\. archon:d2c2$"):
        check_ep(ModelArgs.from_hf(hf_config("qwen3")), parse("archon:d2c2e4").dims)
