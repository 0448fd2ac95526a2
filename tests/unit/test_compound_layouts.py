"""Layouts that combine two letters, on 4 CPU processes over gloo, for every engine that runs
them: d x t, d x c, t x p, p x c and a hybrid MoE with e4 (Megatron ``(attn:d2t2|ffn:e4)``:
tensor parallel attention into four expert ranks; Archon, which refuses t on a MoE model,
``(attn:d4|ffn:e4)``). The FSDP engine refuses c, p and e, so it runs ``d2t2`` only.

For each layout, one ``forward_backward`` with a plain loss (minus the sum of the trained
tokens' log-probs) over tree-packed branching batches (several sequences sharing prefixes, at
block boundaries and inside blocks; several micro-batches on every data rank) gives the loss,
the gradient norm and the full gradients of each sequence run alone through the Hugging Face
model (fp32, relative <= 1e-4), and ``forward`` its per-sequence log-probs (<= 1e-5 abs).

Two process groups in all: FSDP and Archon share one (each backend string builds its own mesh
over the same ranks); Megatron resets its one parallel state between layouts. A layout that
fails does not hide the others: every rank runs every layout, and the test then fails naming
each failed layout with its error (every wrong gradient by name)."""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spawn_ranks
from megatron_models import COMMON, FAMILIES, SumLogprobLoss, branching_sequences, make_batch, per_expert, reference

WORLD = 4
# 64-token trees over 16-token blocks: several micro-batches on every data rank.
MAX_TOKENS, BLOCK = 64, 16
# Model name -> (Hugging Face family, layers, branching sets in its batch): 2 layers without a
# pipeline, 4 with p2 (two a stage); four sets for the MoE model, whose d4 attention would
# leave each data rank a single micro-batch of two.
MODELS = {"qwen3": ("qwen3", 2, 2), "llama4": ("llama", 4, 2), "moe": ("qwen3_moe", 2, 4)}
# (model, layout after the engine's name) for Archon and Megatron. The hybrid MoE layout:
# Megatron runs tensor parallel attention into the experts; Archon refuses t on a MoE model
# (it needs the model to say so, hence at build time), so it runs data parallel attention.
DENSE = [("qwen3", "d2t2"), ("llama4", "p2t2"), ("llama4", "p2c2"), ("qwen3", "d2c2")]
LAYOUTS = {
    "archon": [*DENSE, ("moe", "(attn:d4|ffn:e4)")],
    "megatron": [*DENSE, ("moe", "(attn:d2t2|ffn:e4)")],
}
# One spawn per engine family: FSDP's one compound layout shares Archon's process group
# (both build a device mesh per backend string over the same ranks).
CASES = {
    "fsdp_archon": [("qwen3", "fsdp:d2t2"), *((m, f"archon:{lay}") for m, lay in LAYOUTS["archon"])],
    "megatron": [(m, f"megatron:{lay}") for m, lay in LAYOUTS["megatron"]],
}


def _save(name: str, root: Path) -> Path:
    """The tiny random model ``name`` of :data:`MODELS` as a Hugging Face directory, with
    random norms too (so a norm mapped to the wrong tensor shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family, layers, _ = MODELS[name]
    config = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], "num_hidden_layers": layers})
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM  # untyped
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = root / name
    model.save_pretrained(path)
    return path


def _batch(name: str) -> Any:
    return make_batch([seq for seed in range(MODELS[name][2]) for seq in branching_sequences(seed=seed)])


def _prepare(root: Path, names: set[str]) -> None:
    """Each model and its reference (loss, per-expert Hugging Face gradients, log-probs),
    computed once here rather than on every rank for every layout."""
    for name in names:
        path = _save(name, root)
        value, grads, logps = reference(path, _batch(name), SumLogprobLoss())
        torch.save({"loss": value, "grads": per_expert(grads), "logps": logps}, root / f"{name}-ref.pt")


def _hf_grads(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's full gradients by Hugging Face name (one tensor per expert)."""
    # Megatron's sharded optimizer (ZeRO-1, when d x c > 1) leaves each rank only its shard
    # summed; its full_grads does not complete them itself.
    gather = getattr(engine.optimizer, "gather_grads", None)
    if gather is not None:
        gather()
    grads: dict[str, torch.Tensor] = engine.full_grads()
    if type(engine).__name__.startswith("Archon"):
        from treetrain.engines.archon.model.hf import to_hf

        return to_hf(grads, tie_embeddings=False)
    return grads


def _check(name: str, backend: str, root: Path) -> None:
    from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine

    if backend.startswith("megatron:"):
        from treetrain.engines.megatron.parallel import reset_megatron

        reset_megatron()
    ref = torch.load(root / f"{name}-ref.pt")
    batch = _batch(name)
    engine = build_engine(
        ModelSettings(path=str(root / name)),
        backend,
        tree=TreeTrainingSettings.model_validate({"max_tokens_per_mb": MAX_TOKENS, "block_size": BLOCK}),
        optimizer=OptimizerSettings(lr=1e-3),
    )
    stats = engine.forward_backward(batch, SumLogprobLoss())
    assert stats.tree_tokens < stats.original_tokens, (backend, "the batch must share prefixes")
    assert stats.micro_batches >= 2, (backend, stats.micro_batches)
    assert abs(stats.loss - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (backend, stats.loss, ref["loss"])
    norm, want_norm = float(engine.grad_norm()), _norm(ref["grads"])
    assert abs(norm - want_norm) <= 1e-4 * want_norm, (backend, "gradient norm", norm, want_norm)
    grads = _hf_grads(engine)
    assert set(grads) == set(ref["grads"]), (backend, sorted(set(grads) ^ set(ref["grads"])))
    # Every mismatch at once (a wrong gradient names its tensors), then the log-probs.
    distances = {n: _distance(grads[n], want) for n, want in ref["grads"].items()}
    wrong = [f"{n}: {d}" for n, d in distances.items() if d]
    for i, (got, want) in enumerate(zip(engine.forward(batch.sequences), ref["logps"], strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{backend} log-probs of sequence {i}")
    assert not wrong, f"{backend}: {len(wrong)} of {len(grads)} gradients differ from transformers':\n" + "\n".join(
        wrong
    )


def _norm(grads: Mapping[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads.values()])))


def _distance(got: torch.Tensor, want: torch.Tensor) -> str:
    """Empty when ``got`` is within rtol 1e-4 (atol 1e-6) of ``want``, else the worst error."""
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    except AssertionError:
        err = (got - want).abs().max()
        return f"max abs error {float(err):.3g} (|want| max {float(want.abs().max()):.3g})"
    return ""


def _checks(root: str, cases: list[tuple[str, str]]) -> None:
    failed = []
    for name, backend in cases:
        try:
            _check(name, backend, Path(root))
        except Exception:
            failed.append(f"{backend}\n{traceback.format_exc()}")
    if failed:
        raise AssertionError(f"{len(failed)} of {len(cases)} layouts failed:\n" + "\n".join(failed))


def _run(cases: list[tuple[str, str]], root: Path) -> None:
    _prepare(root, {name for name, _ in cases})
    spawn_ranks(_checks, WORLD, str(root), cases)


@pytest.mark.slow
def test_fsdp_and_archon_compound_layouts_match_transformers(tmp_path: Path) -> None:
    _run(CASES["fsdp_archon"], tmp_path)


@pytest.mark.slow
def test_megatron_compound_layouts_match_transformers(tmp_path: Path) -> None:
    _run(CASES["megatron"], tmp_path)


def test_layouts_cover_each_compound_and_pass_validation() -> None:
    from treetrain.config.backends import check_training_backend

    for engine_name, layouts in LAYOUTS.items():
        dims = [check_training_backend(f"{engine_name}:{layout}").dims for _, layout in layouts]
        assert all(d.dp * d.tp * d.pp * d.cp == WORLD for d in dims)
        pairs = {frozenset(k for k in ("dp", "tp", "pp", "cp") if getattr(d, k) > 1) for d in dims}
        assert pairs >= {frozenset(p) for p in (("dp", "tp"), ("dp", "cp"), ("tp", "pp"), ("pp", "cp"))}
        assert any(d.ep == WORLD for d in dims)
    for layout in ("c2d2", "p2t2", "(attn:d2t2|ffn:e4)"):
        with pytest.raises(Exception, match="fsdp"):
            check_training_backend(f"fsdp:{layout}")
