"""The global gradient norm, one function for every engine.

Each engine says which gradients it holds and how many ranks hold each same tensor (its
*copies*): replicated weights count on every rank that holds them, shards once per distinct
piece. :func:`global_norm` divides every local sum of squares by its copies, so the sum over
all ranks counts every distinct tensor once, and adds them up in one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["dtensor_pieces", "global_norm", "grad_norm", "world_size"]


def world_size() -> int:
    """Ranks of the default group (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_norm(pieces: Iterable[tuple[torch.Tensor, int]], *, device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of every distinct gradient over all ranks, a 0-d fp32 tensor on ``device``
    (default: the first piece's device, else the CPU).

    ``pieces``: this rank's ``(local gradient, copies)`` pairs, ``copies`` the number of ranks
    of the default group that hold that same tensor. Every rank must call it (one
    ``all_reduce`` when there is more than one rank)."""
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g, copies in pieces:
        if copies < 1:
            raise ValueError(f"a gradient must be held by at least one rank, got copies={copies}")
        if device is None:
            device = g.device
        if g.numel():
            by_copies.setdefault(copies, []).append(g.detach())
    total = torch.zeros((), dtype=torch.float32, device=device or torch.device("cpu"))
    for copies, tensors in by_copies.items():
        # One fused kernel per copy count; the norms are fp32 whatever the gradients' dtype.
        norms = torch.stack([n.to(total.device) for n in torch.foreach.norm(tensors, dtype=torch.float32)])
        total += norms.square().sum() / copies
    if world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def dtensor_pieces(params: Iterable[torch.Tensor], *, holders: int | None = None) -> Iterator[tuple[torch.Tensor, int]]:
    """Each gradient's local tensor and its copies, for FSDP and Archon modules.

    ``holders``: the ranks that hold these parameters at all (default: the whole world; a
    pipeline stage's ``world / stages``). A DTensor's local shard is one of ``prod(mesh sizes
    of its non-replicated placements)`` distinct pieces, each held by ``holders / pieces``
    ranks; a plain tensor is the same on all ``holders`` ranks."""
    holders = world_size() if holders is None else holders
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                # A pending sum: reduce it first (a collective; never the case after FSDP's
                # reduce-scatter or tensor parallel's backward, so never paid there).
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            # Shard, and FSDP2's _StridedShard (not a Shard subclass), split over their mesh dim.
            pieces = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
            yield g.to_local(), holders // pieces
        else:
            yield g, holders


def grad_norm(params: Iterable[torch.Tensor], *, stages: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """The global L2 norm of the gradients of ``params`` (plain tensors and DTensors), every
    pipeline stage holding its own parameters on ``world / stages`` ranks."""
    return global_norm(dtensor_pieces(params, holders=world_size() // stages), device=device)
