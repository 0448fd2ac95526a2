"""Process groups and device meshes from a backend string (``fsdp:d4t2`` -> a dp x tp mesh)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treetrain.alloc import Allocation, parse
from treetrain.engines.base import EngineConfigError


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """This process's place in the data x tensor parallel grid."""

    allocation: Allocation
    world_size: int
    rank: int
    device: torch.device
    mesh: DeviceMesh | None  # None: one process, nothing to shard

    @property
    def dp(self) -> int:
        return self.allocation.dims.dp

    @property
    def tp(self) -> int:
        return self.allocation.dims.tp

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def allocation_for(backend: str) -> Allocation:
    """Parse and check a training backend string for this engine."""
    allocation = parse(backend)
    if allocation.backend != "fsdp":
        raise EngineConfigError(
            f"backend {backend!r} is a {allocation.backend} backend; this trainer runs the FSDP engine: use fsdp:d<N>t<M>"
        )
    dims = allocation.dims
    if dims.cp > 1:
        raise EngineConfigError(
            f"context parallelism (c{dims.cp} in {backend!r}) is not supported by the FSDP engine yet; "
            "drop the c letter and raise d or t instead"
        )
    return allocation


def init_distributed(backend: str, *, timeout_s: float = 1800.0) -> ParallelLayout:
    """Join torchrun's process group (if any) and build the mesh for ``backend``.

    One process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) needs no process group at all; a
    backend string for more ranks than torchrun started is an error that names both.
    """
    allocation = allocation_for(backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != allocation.world_size:
        raise EngineConfigError(
            f"backend {backend!r} needs {allocation.world_size} processes but {world} were started; "
            f"run torchrun --nproc-per-node {allocation.world_size} (or change the backend string)"
        )
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world == 1:
        return ParallelLayout(allocation=allocation, world_size=1, rank=0, device=device, mesh=None)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device.type, (allocation.dims.dp, allocation.dims.tp), mesh_dim_names=("dp", "tp"))
    return ParallelLayout(allocation=allocation, world_size=world, rank=dist.get_rank(), device=device, mesh=mesh)
