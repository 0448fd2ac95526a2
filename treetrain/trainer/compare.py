"""Tree vs flat, side by side: the same batches trained tree-packed and flat by the same
engine (gradients thrown away). Not part of a training step: ``treetrain train`` runs it
after the last step when ``trainer.compareFlat`` is set (the embedded default does)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from treetrain.engines.base import Engine
from treetrain.engines.batch import TrainBatch
from treetrain.engines.contract import Loss


@dataclass(frozen=True, slots=True)
class Comparison:
    batches: int
    tree_seconds: float
    flat_seconds: float
    tree_token_ratio: float

    @property
    def speedup(self) -> float:
        return self.flat_seconds / self.tree_seconds if self.tree_seconds > 0 else 0.0


def compare_tree_vs_flat(
    engine: Engine,
    loss: Loss,
    batches: Sequence[TrainBatch],
    *,
    rounds: int,
    stop: Callable[[], bool] = lambda: False,
) -> Comparison | None:
    """One burn-in pass per mode (the flat micro-batches have shapes training never ran:
    without it their first allocations inflate the speedup by a third on a CPU), then
    ``rounds`` measured rounds that alternate the modes, so a load change on a shared machine
    hits both; the best round of each counts. ``stop`` is asked before every pass (every rank
    asks at the same points); None when it said stop."""
    times = {True: float("inf"), False: float("inf")}
    for tree in (True, False):
        if stop():
            return None
        engine.forward_backward(batches[0], loss, tree=tree)
        engine.zero_grad()
    tree_tokens = original_tokens = 0
    for _ in range(rounds):
        for tree in (True, False):
            if stop():
                return None
            _sync()
            start = time.perf_counter()
            stats = [engine.forward_backward(batch, loss, tree=tree) for batch in batches]
            _sync()
            times[tree] = min(times[tree], time.perf_counter() - start)
            engine.zero_grad()
            if tree:
                tree_tokens = sum(s.tree_tokens for s in stats)
                original_tokens = sum(s.original_tokens for s in stats)
    ratio = tree_tokens / max(original_tokens, 1)
    return Comparison(batches=len(batches), tree_seconds=times[True], flat_seconds=times[False], tree_token_ratio=ratio)


def _sync() -> None:
    # On a CPU every op has finished when the call returns; on a GPU, wait for the queue.
    if torch.cuda.is_available():
        torch.cuda.synchronize()
