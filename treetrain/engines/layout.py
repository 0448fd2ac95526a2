"""One layout protocol for every engine: this process's place in its engine's grid, asked in one
vocabulary, and the process-group plumbing every engine's layout joins through.

An engine's layout (FSDP's ``dp x tp`` mesh, Archon's three meshes, Megatron's
``parallel_state``) answers the same questions: the size of a dimension, this rank's index in
it, and its process group. A dimension of one rank has no group (``group`` is None) whoever
built it, so the engine core never asks which engine it runs: Megatron keeps a one-rank context
group at ``c1`` and Archon none, and both answer ``group("cp") is None``.

Dimensions: ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``etp``, ``dp_cp`` (data x context: the
ranks whose loss parts add up, and the dense gradients' copies) and ``edp`` (expert data).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treetrain.alloc import Allocation
from treetrain.engines.errors import EngineConfigError

Dim = Literal["dp", "tp", "pp", "cp", "ep", "etp", "dp_cp", "edp"]


@dataclass(frozen=True, slots=True)
class Layout(ABC):
    """This process's place in an engine's grid over ``world_size`` ranks (reusable by several
    engines: layouts are cached per allocation). Sizes come from the allocation; an engine's
    layout says how it finds a rank's index and group (:meth:`_rank_in`, :meth:`_group`), and
    is asked only about dimensions of more than one rank."""

    allocation: Allocation
    world_size: int
    rank: int
    device: torch.device

    def size(self, dim: Dim) -> int:
        d = self.allocation.dims
        return d.dp * d.cp if dim == "dp_cp" else int(getattr(d, dim))

    def rank_in(self, dim: Dim) -> int:
        """This process's index along ``dim`` (0 when it has one rank)."""
        return 0 if self.world_size == 1 or self.size(dim) == 1 else self._rank_in(dim)

    def group(self, dim: Dim) -> dist.ProcessGroup | None:
        """The process group of this rank along ``dim``; None when ``dim`` has one rank."""
        return None if self.world_size == 1 or self.size(dim) == 1 else self._group(dim)

    def group_of(self, dim: Dim) -> dist.ProcessGroup:
        """The engine's own group along ``dim``, for its code that knows the group exists (a
        pipeline exchange at ``p > 1``; Megatron's one-rank groups, which its optimizer uses)."""
        return self._group(dim)

    @abstractmethod
    def _rank_in(self, dim: Dim) -> int: ...

    @abstractmethod
    def _group(self, dim: Dim) -> dist.ProcessGroup: ...

    # -- what the engine core asks --------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.allocation.dims.dp

    @property
    def tp(self) -> int:
        return self.allocation.dims.tp

    @property
    def pp(self) -> int:
        return self.allocation.dims.pp

    @property
    def cp(self) -> int:
        return self.allocation.dims.cp

    @property
    def ep(self) -> int:
        return self.allocation.dims.ep

    @property
    def etp(self) -> int:
        return self.allocation.dims.etp

    @property
    def dp_rank(self) -> int:
        """Which data-parallel rank's trees this process runs."""
        return self.rank_in("dp")

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def cp_rank(self) -> int:
        return self.rank_in("cp")

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        """Whether this rank runs the model's head (sees the loss and the outputs)."""
        return self.pp_rank == self.pp - 1

    @property
    def owns_outputs(self) -> bool:
        """Whether this rank's forward outputs are sent to the others: one copy of each, from
        the last stage's first tensor and context rank."""
        return self.last_stage and self.tp_rank == 0 and self.cp_rank == 0

    @property
    def grad_average(self) -> int:
        """How many ranks' gradients the backward averages: the ranks FSDP2 shards a parameter
        over (the engine's description, ``shards_over``); 1 where gradients are summed."""
        return self.allocation.spec.shard_size(self.allocation.dims)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# -- joining the process group ---------------------------------------------------------------


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def join(allocation: Allocation, *, timeout_s: float = 1800.0) -> tuple[torch.device, int]:
    """This process's device and the world size, checked against ``allocation``; joins
    torchrun's process group once when there is more than one process (every later engine of
    the process reuses it)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != allocation.world_size:
        raise EngineConfigError(
            f"backend {str(allocation)!r} needs {allocation.world_size} processes but {world} were started; "
            f"run torchrun --nproc-per-node {allocation.world_size} (or change the backend string)"
        )
    device = _device()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return device, world


def one_process_group(device: torch.device) -> None:
    """A process group of one rank for a single process that has none (an in-memory store, no
    rendezvous): megatron-core always needs one, and so does FSDP2 over a one-rank data mesh
    (see :func:`one_rank_mesh`). Later engines of the process reuse it; the trainer destroys it
    at the end as it does a torchrun group."""
    if not dist.is_initialized():
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)


def one_rank_mesh(device: torch.device, name: str) -> DeviceMesh:
    """A one-rank mesh named ``name`` over this single process: what FSDP2 wraps the model over
    when nothing is sharded but fp32 master weights are cast to a 16-bit compute dtype
    (:mod:`treetrain.alloc.precision`)."""
    one_process_group(device)
    return init_device_mesh(device.type, (1,), mesh_dim_names=(name,))
