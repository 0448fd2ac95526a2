"""The FSDP engine on 2 CPU processes over gloo (torch.multiprocessing, like torchrun), built
with :func:`treetrain.engines.build_engine`: tree vs flat packing give the same loss and
gradients (fp32, relative <= 1e-4), and both match each sequence run alone through the plain
model, for the actor (FSDP2 over d2 and DTensor tensor parallel t2) and the critic (d2); the
gradient norm matches the unsharded gradients' with one collective per step; several engines
share the processes (one mesh per backend string); bfloat16 over d2 keeps fp32 weights. Four
processes check d2t2 (FSDP over a data x tensor parallel grid)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, backward_alone, losses_after_resume, make_batch, spawn_ranks

WORLD = 2
MODEL = TINY_LLAMA
# 64-token trees over 16-token blocks: several uneven micro-batches per rank.
TREE = {"max_tokens_per_mb": 64, "block_size": 16}


def reference(role: str, batch: Any, loss: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sequence alone through the unsharded model (plain sdpa), one global mean."""
    from treetrain.config import ModelSettings
    from treetrain.engines.contract import MicroBatchOutput
    from treetrain.engines.hf_model import build_model

    model = build_model(ModelSettings(**MODEL), role)

    def output(seq: list[int]) -> MicroBatchOutput:
        ids = torch.tensor(seq)[None]
        pos = torch.arange(len(seq))[None]
        if role == "critic":
            return MicroBatchOutput(values=model(input_ids=ids, position_ids=pos)[0, :-1])
        logits = model(input_ids=ids, position_ids=pos).logits[0, :-1].float()
        return MicroBatchOutput(logprobs=torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), ids[0, 1:]])

    value = backward_alone(batch, loss, output)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return value, grads


class _CountAllReduce:
    """Wraps ``torch.distributed.all_reduce`` and counts its calls."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls = 0
        self._dist = dist
        self._real = dist.all_reduce

    def __enter__(self) -> _CountAllReduce:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._real(*args, **kwargs)

        self._dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self._dist.all_reduce = self._real


def _check_grad_norm(engine: Any, backend: str) -> None:
    """The one-collective norm equals the norm of the unsharded gradients; clipping scales the
    local shards in place."""
    from torch.distributed.tensor.debug import CommDebugMode

    from treetrain.engines.grads import grad_norm
    from treetrain.engines.optim import scale_grads

    full = engine.full_grads()
    want = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in full.values()])).float()
    params = list(engine.model.parameters())
    with CommDebugMode() as comm, _CountAllReduce() as counter:
        got = grad_norm(params, device=engine.layout.device)
    assert counter.calls == 1 and comm.get_total_counts() == 1, (backend, counter.calls, comm.get_comm_counts())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=f"{backend} grad norm")
    scale_grads(params, 0.5)
    torch.testing.assert_close(grad_norm(params), want / 2, rtol=1e-5, atol=0, msg=f"{backend} scaled")
    scale_grads(params, 2.0)


def _check(backend: str, role: str, tmp: Path) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings, ValueLossSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss, ValueLoss

    loss = ValueLoss(ValueLossSettings()) if role == "critic" else PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch()
    tree = TreeTrainingSettings(**TREE)
    engine = build_engine(ModelSettings(**MODEL), backend, role=role, tree=tree, optimizer=OptimizerSettings(lr=1e-3))
    assert any(isinstance(p, DTensor) for p in engine.model.parameters()), "nothing was sharded"
    results = {}
    for use_tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=use_tree)
        results[use_tree] = (stats, engine.full_grads())
        if use_tree:
            _check_grad_norm(engine, backend)
        engine.zero_grad()
    ref_loss, ref_grads = reference(role, batch, loss)
    (tree_stats, tree_grads), (flat_stats, flat_grads) = results[True], results[False]
    assert tree_stats.tree_tokens < flat_stats.tree_tokens, "the batch must share prefixes"
    assert flat_stats.micro_batches > tree_stats.micro_batches >= 1
    for name, got in (("tree", tree_stats.loss), ("flat", flat_stats.loss)):
        assert abs(got - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (backend, role, name, got, ref_loss)
    assert set(tree_grads) == set(ref_grads)
    for n, ref in ref_grads.items():
        torch.testing.assert_close(tree_grads[n], flat_grads[n], rtol=1e-4, atol=1e-6, msg=f"{backend} {role} {n}")
        torch.testing.assert_close(tree_grads[n], ref, rtol=1e-4, atol=1e-6, msg=f"{backend} {role} {n} vs ref")
    # The no-grad path too: per-sequence values/log-probs, gathered from both ranks.
    outs = engine.forward(batch.sequences)
    assert [len(o) for o in outs] == [len(s) - 1 for s in batch.sequences]
    if role == "actor":
        # An optimizer step (one collective: the gradient norm's all-reduce) and a full-weight
        # export work on sharded parameters.
        engine.forward_backward(batch, loss)
        with CommDebugMode() as comm:
            assert engine.step() > 0
        assert comm.get_total_counts() == 1, (backend, comm.get_comm_counts())
        exported = tmp / f"export-{backend.replace(':', '-')}"
        engine.export_hf(exported)
        # Loading that directory on 2 ranks (meta device, shard, rank 0 broadcasts) gives the same model.
        loaded = build_engine(str(exported), backend, tree=tree)
        assert loaded.layout is engine.layout, "one backend string, one mesh"
        for got, want in zip(loaded.forward(batch.sequences), engine.forward(batch.sequences), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if backend == "fsdp:d2":
            # A critic with another backend string of the same world size: its own mesh, same ranks.
            critic = build_engine(str(exported), "fsdp:t2", role="critic", tree=tree)
            assert critic.layout is not engine.layout and critic.layout.tp == 2
            assert [len(v) for v in critic.forward(batch.sequences)] == [len(s) - 1 for s in batch.sequences]
        # A sharded checkpoint (DCP) restores model and optimizer exactly: the next step matches.
        after = losses_after_resume(engine, batch, loss, tmp / f"ckpt-{backend.replace(':', '-')}")
        assert after[0] == after[1], after


def _check_bfloat16() -> None:
    """d2 with bfloat16: fp32 master weights (FSDP casts to bf16 for compute), a step runs."""
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    engine = build_engine(
        ModelSettings(**MODEL, dtype="bfloat16"),
        "fsdp:d2",
        tree=TreeTrainingSettings(**TREE),
        optimizer=OptimizerSettings(lr=1e-3),
    )
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    batch = make_batch()
    before = engine.forward(batch.sequences)
    stats = engine.forward_backward(batch, PPOLoss(LossSettings()))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in engine.model.parameters())
    norm = engine.step()
    assert stats.loss == stats.loss and 0 < norm < float("inf")
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    after = engine.forward(batch.sequences)
    assert all(a.dtype == torch.float32 for a in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)), "the step changed nothing"


def _check_2d() -> None:
    """d2t2 on 4 ranks: FSDP's _StridedShard over dp next to TP's Shard, and the replicated
    modules sharded over the dp sub-mesh only (each shard held by both tp ranks): the loss and
    gradients match the reference, and so does the one-collective gradient norm."""
    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.rl.losses import PPOLoss

    loss = PPOLoss(LossSettings(clip_eps=0.2))
    batch = make_batch()
    engine = build_engine(
        ModelSettings(**MODEL), "fsdp:d2t2", tree=TreeTrainingSettings(**TREE), optimizer=OptimizerSettings(lr=1e-3)
    )
    stats = engine.forward_backward(batch, loss)
    ref_loss, ref_grads = reference("actor", batch, loss)
    assert abs(stats.loss - ref_loss) <= 1e-4 * abs(ref_loss) + 1e-7, (stats.loss, ref_loss)
    grads = engine.full_grads()
    for n, ref in ref_grads.items():
        torch.testing.assert_close(grads[n], ref, rtol=1e-4, atol=1e-6, msg=f"d2t2 {n} vs ref")
    _check_grad_norm(engine, "fsdp:d2t2")
    assert engine.step() > 0


def _fsdp_checks(world: int, tmp: str) -> None:
    os.environ["TREETRAIN_ATTENTION"] = "bogus"  # the engine reads no environment
    if world == 4:
        _check_2d()
    else:
        for backend, role in (("fsdp:d2", "actor"), ("fsdp:d2", "critic"), ("fsdp:t2", "actor")):
            _check(backend, role, Path(tmp))
        _check_bfloat16()


def _spawn(world: int, tmp: Path) -> None:
    spawn_ranks(_fsdp_checks, world, world, str(tmp))


@pytest.mark.slow
def test_two_ranks_tree_and_flat_match_the_reference(tmp_path: Path) -> None:
    _spawn(WORLD, tmp_path)
    exported = tmp_path / "export-fsdp-d2"
    assert (exported / "config.json").is_file()
    assert any(exported.glob("*.safetensors"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.vocab_size == 512


@pytest.mark.slow
def test_four_ranks_data_and_tensor_parallel(tmp_path: Path) -> None:
    _spawn(4, tmp_path)
