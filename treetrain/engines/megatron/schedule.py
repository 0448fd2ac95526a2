"""The Megatron engine's pipeline schedule over plain point-to-point sends.

Every rank holds the whole batch and packs it the same way, so every stage knows the shape of
every micro-batch's hidden states: stages exchange exactly those shapes (trees of different
sizes in one step need no padding to the largest). Activations cross stages in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Stage = Callable[[int, torch.Tensor | None], torch.Tensor]  # (micro-batch, received hidden) -> output
OnOutput = Callable[[int, torch.Tensor], torch.Tensor | None]  # last stage: (micro-batch, output) -> scalar


def run_schedule(
    stage: Stage,
    shapes: Sequence[tuple[int, ...]],
    on_output: OnOutput,
    *,
    stages: int,
    first: bool,
    last: bool,
    device: torch.device,
    train: bool,
) -> None:
    """All forwards, then (``train``) all backwards, GPipe style.

    ``stage(i, hidden)`` runs micro-batch ``i`` through this rank's layers (``hidden`` is None
    on the first stage); ``shapes[i]`` is the shape of the hidden states micro-batch ``i``
    sends between stages; ``on_output(i, out)`` runs on the last stage and returns the scalar
    to backward (or None)."""
    if stages == 1:
        for i in range(len(shapes)):
            scalar = on_output(i, stage(i, None))
            if train:
                assert scalar is not None
                torch.autograd.backward(scalar)
        return
    from megatron.core import parallel_state as ps

    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    pending: list[Any] = []
    saved: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for i, shape in enumerate(shapes):
        hidden = None
        if not first:
            hidden = torch.empty(shape, dtype=torch.float32, device=device)
            dist.recv(hidden, src=prev)
            hidden.requires_grad_(train)
        out: torch.Tensor | None = stage(i, hidden)
        if last:
            assert out is not None
            out = on_output(i, out)
        else:
            assert out is not None
            pending.append(dist.isend(out.detach().float().contiguous(), dst=nxt))
        saved.append((hidden, out))
    for work in pending:
        work.wait()
    if not train:
        return
    pending = []
    for i, (hidden, out) in enumerate(saved):
        assert out is not None
        if last:
            torch.autograd.backward(out)
        else:
            grad = torch.empty(shapes[i], dtype=torch.float32, device=device)
            dist.recv(grad, src=nxt)
            torch.autograd.backward(out, grad.to(out.dtype))
        if hidden is not None:
            assert hidden.grad is not None
            pending.append(dist.isend(hidden.grad.contiguous(), dst=prev))
    for work in pending:
        work.wait()
