"""The Megatron engine's pipeline schedule over plain point-to-point sends.

Every rank holds the whole batch and packs it the same way, so every stage knows the shape of
every micro-batch's hidden states: stages exchange exactly those shapes (trees of different
sizes in one step need no padding to the largest). Activations cross stages in fp32.

Two training orders (:func:`order`): ``gpipe`` runs every forward, then every backward, so a
stage holds every micro-batch's activations at once; ``1f1b`` starts the backwards as soon as
the last stage can, so stage ``s`` of ``S`` holds at most ``S - s``. Both run the backwards in
micro-batch order and call ``on_output`` in micro-batch order, so the gradients accumulate in
the same order: the two give identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

Stage = Callable[[int, torch.Tensor | None], torch.Tensor]  # (micro-batch, received hidden) -> output
OnOutput = Callable[[int, torch.Tensor], torch.Tensor | None]  # last stage: (micro-batch, output) -> scalar
Schedule = Literal["1f1b", "gpipe"]
Action = tuple[Literal["F", "B"], int]  # a forward or backward of one micro-batch


def order(schedule: Schedule, *, stages: int, stage: int, micro_batches: int, train: bool = True) -> list[Action]:
    """The forwards and backwards of ``micro_batches`` on pipeline stage ``stage``, in order.

    ``1f1b``: ``stages - stage - 1`` warm-up forwards, then one forward and one backward in
    turn, then the remaining backwards. Neighbours agree on the order of what they exchange
    (forwards in micro-batch order down the pipeline, backwards in micro-batch order up it),
    and every receive is preceded on the sender by the computation it waits for: with
    non-blocking sends no rank waits on one that waits on it. Forward only: every forward."""
    m = micro_batches
    if not train:
        return [("F", i) for i in range(m)]
    if schedule == "gpipe":
        return [*(("F", i) for i in range(m)), *(("B", i) for i in range(m))]
    warm = min(stages - stage - 1, m)
    actions: list[Action] = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        actions += [("F", warm + i), ("B", i)]
    actions += [("B", i) for i in range(m - warm, m)]
    return actions


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
    schedule: Schedule = "1f1b",
) -> None:
    """Every micro-batch through this rank's stage, forward then (``train``) backward, in the
    order of :func:`order` for ``schedule``.

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
    index = ps.get_pipeline_model_parallel_rank()
    # Sends never block (only receives do); each buffer lives until its send is waited on.
    fwd_sends: dict[int, Any] = {}
    bwd_sends: list[Any] = []
    # Micro-batches between their forward and their backward: (received hidden, output or scalar).
    live: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    for kind, i in order(schedule, stages=stages, stage=index, micro_batches=len(shapes), train=train):
        if kind == "F":
            hidden = None
            if not first:
                hidden = torch.empty(shapes[i], dtype=torch.float32, device=device)
                dist.recv(hidden, src=prev)
                hidden.requires_grad_(train)
            out = stage(i, hidden)
            if last:
                scalar = on_output(i, out)
                if train:
                    assert scalar is not None
                    live[i] = (hidden, scalar)
            else:
                fwd_sends[i] = dist.isend(out.detach().float().contiguous(), dst=nxt)
                if train:
                    live[i] = (hidden, out)
            continue
        hidden, out = live.pop(i)  # its activations are freed once this backward is done
        if last:
            torch.autograd.backward(out)
        else:
            grad = torch.empty(shapes[i], dtype=torch.float32, device=device)
            dist.recv(grad, src=nxt)
            fwd_sends.pop(i).wait()  # the next stage used these hidden states: the send is done
            torch.autograd.backward(out, grad.to(out.dtype))
        if hidden is not None:
            assert hidden.grad is not None
            bwd_sends.append(dist.isend(hidden.grad.contiguous(), dst=prev))
    for work in [*fwd_sends.values(), *bwd_sends]:
        work.wait()
