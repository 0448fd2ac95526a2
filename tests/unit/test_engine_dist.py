"""The FSDP engine on 2 CPU processes over gloo (torch.multiprocessing, like torchrun):
tree vs flat packing give the same loss and gradients (fp32, relative <= 1e-4), and both
match each sequence run alone through the plain model, for the actor (FSDP2 over d2 and
DTensor tensor parallel t2) and the critic (d2)."""

from __future__ import annotations

import os
import random
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
MODEL = {"path": "builtin:tiny-llama", "seed": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_batch(seed: int = 0, vocab: int = 500) -> Any:
    """Agent-shaped sequences: a shared system prompt, branching turns, uneven lengths."""
    from treetrain.engines.base import TrainBatch

    rng = random.Random(seed)
    system = [rng.randrange(8, vocab) for _ in range(20)]
    seqs = []
    for _ in range(3):
        history = system + [rng.randrange(8, vocab) for _ in range(rng.randint(3, 9))]
        for _ in range(3):
            history = history + [rng.randrange(8, vocab) for _ in range(rng.randint(2, 7))]
            seqs.append(list(history))
    seqs.append([rng.randrange(8, vocab) for _ in range(11)])  # shares nothing
    g = torch.Generator().manual_seed(seed)
    masks, adv, old, rets = [], [], [], []
    for s in seqs:
        n = len(s) - 1
        m = torch.zeros(n)
        m[rng.randint(0, n - 1) :] = 1.0
        masks.append(m)
        adv.append(torch.full((n,), float(torch.randn((), generator=g))))
        old.append(-6.2 + 0.1 * torch.randn(n, generator=g))
        rets.append(torch.rand(n, generator=g))
    tensors = {"advantages": adv, "old_logprobs": old, "returns": rets}
    return TrainBatch(sequences=seqs, loss_mask=masks, tensors=tensors)


def reference(role: str, batch: Any, loss: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """Each sequence alone through the unsharded model (plain sdpa), one global mean."""
    from treetrain.engines.base import MicroBatchOutput
    from treetrain.engines.fsdp import ModelConfig, build_model

    model = build_model(ModelConfig(**MODEL), role)
    total = batch.num_loss_tokens()
    value = 0.0
    for i, seq in enumerate(batch.sequences):
        ids = torch.tensor(seq)[None]
        pos = torch.arange(len(seq))[None]
        if role == "critic":
            out = MicroBatchOutput(values=model(input_ids=ids, position_ids=pos)[0, :-1])
        else:
            logits = model(input_ids=ids, position_ids=pos).logits[0, :-1].float()
            out = MicroBatchOutput(logprobs=torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), ids[0, 1:]])
        inputs = {k: v[i] for k, v in batch.tensors.items()}
        mb_loss, _ = loss(out, batch.loss_mask[i], inputs)
        (mb_loss / total).backward()
        value += float(mb_loss.detach()) / total
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return value, grads


def _check(backend: str, role: str, tmp: Path) -> None:
    from torch.distributed.tensor import DTensor

    from treetrain.engines.base import OptimConfig, TreeTrainingConfig
    from treetrain.engines.fsdp import FSDPEngine, ModelConfig
    from treetrain.engines.parallel import init_distributed
    from treetrain.rl.losses import PPOLoss, ValueLoss

    layout = init_distributed(backend)
    loss = ValueLoss(ValueLoss.Config()) if role == "critic" else PPOLoss(PPOLoss.Config(clip_eps=0.2))
    batch = make_batch()
    # 64-token trees over 16-token blocks: several uneven micro-batches per rank.
    tree_cfg = TreeTrainingConfig(max_tokens_per_mb=64)
    engine = FSDPEngine(ModelConfig(**MODEL), layout, tree_cfg, OptimConfig(lr=1e-3), role=role)
    assert any(isinstance(p, DTensor) for p in engine.model.parameters()), "nothing was sharded"
    results = {}
    for tree in (True, False):
        stats = engine.forward_backward(batch, loss, tree=tree)
        results[tree] = (stats, engine.full_grads())
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
        # An optimizer step and a full-weight export work on sharded parameters.
        engine.forward_backward(batch, loss)
        assert engine.step() > 0
        exported = tmp / f"export-{backend.replace(':', '-')}"
        engine.export_hf(exported)
        # Loading that directory on 2 ranks (meta device, shard, rank 0 broadcasts) gives the same model.
        loaded = FSDPEngine(ModelConfig(path=str(exported)), layout, tree_cfg, None, role="actor")
        for got, want in zip(loaded.forward(batch.sequences), engine.forward(batch.sequences), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if backend == "fsdp:d2":
            critic = FSDPEngine(ModelConfig(path=str(exported)), layout, tree_cfg, None, role="critic")
            assert [len(v) for v in critic.forward(batch.sequences)] == [len(s) - 1 for s in batch.sequences]
        # A sharded checkpoint (DCP) restores model and optimizer exactly: the next step matches.
        ckpt = tmp / f"ckpt-{backend.replace(':', '-')}"
        engine.save(ckpt, {"step": 1})
        after = []
        for _ in range(2):
            engine.forward_backward(batch, loss)
            engine.step()
            after.append(engine.forward_backward(batch, loss).loss)
            engine.zero_grad()
            assert engine.load(ckpt) == {"step": 1}
        assert after[0] == after[1], after


def _worker(rank: int, port: int, tmp: str, errors: Any) -> None:
    os.environ.update(
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TREETRAIN_BLOCK_SIZE="16",
    )
    os.environ.pop("TREETRAIN_ATTENTION", None)
    torch.set_num_threads(1)
    try:
        for backend, role in (("fsdp:d2", "actor"), ("fsdp:d2", "critic"), ("fsdp:t2", "actor")):
            _check(backend, role, Path(tmp))
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_tree_and_flat_match_the_reference(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(_free_port(), str(tmp_path), errors), nprocs=WORLD, start_method="spawn")
    except Exception:
        found = []
        while not errors.empty():
            found.append(errors.get())
        pytest.fail("\n".join(found) or "a rank failed")
    exported = tmp_path / "export-fsdp-d2"
    assert (exported / "config.json").is_file()
    assert any(exported.glob("*.safetensors"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.vocab_size == 512
