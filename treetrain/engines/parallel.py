"""Process groups and device meshes from a checked allocation (``fsdp:d4t2`` -> a dp x tp mesh).

:func:`init_distributed` joins torchrun's process group once per process; every later call
(the critic's and the reference model's engines, built on the same processes) reuses it.
Layouts are cached per allocation, so engines with the same backend string share one mesh
(one set of sub-groups), and another string of the same world size (actor ``fsdp:d2``,
critic ``fsdp:t2``) gets its own mesh over the same ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treetrain.alloc import Allocation
from treetrain.engines.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """This process's place in the data x tensor parallel grid (reusable by several engines)."""

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
    def cp(self) -> int:
        return self.allocation.dims.cp

    @property
    def pp(self) -> int:
        return self.allocation.dims.pp

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# allocation -> (the default group it was built in, its layout). A destroyed and re-created
# default group (tests do that) invalidates the entry: its meshes' sub-groups are gone.
_LAYOUTS: dict[Allocation, tuple[object, ParallelLayout]] = {}


def _device() -> torch.device:
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def join(allocation: Allocation, *, timeout_s: float = 1800.0) -> tuple[torch.device, int]:
    """This process's device and the world size, checked against ``allocation``; joins
    torchrun's process group once when there is more than one process."""
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


def init_distributed(allocation: Allocation, *, timeout_s: float = 1800.0) -> ParallelLayout:
    """Join torchrun's process group (once per process) and build the mesh of ``allocation``
    (from :func:`treetrain.config.check_training_backend`).

    One process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) needs no process group at all; an
    allocation for more ranks than were started is an error that names both. Every rank
    must call this with the same allocations in the same order (a new mesh creates
    sub-groups, a collective call).
    """
    device, world = join(allocation, timeout_s=timeout_s)
    if world == 1:
        return ParallelLayout(allocation=allocation, world_size=1, rank=0, device=device, mesh=None)
    group = dist.group.WORLD
    cached = _LAYOUTS.get(allocation)
    if cached is not None and cached[0] is group:
        return cached[1]
    mesh = init_device_mesh(device.type, (allocation.dims.dp, allocation.dims.tp), mesh_dim_names=("dp", "tp"))
    layout = ParallelLayout(allocation=allocation, world_size=world, rank=dist.get_rank(), device=device, mesh=mesh)
    _LAYOUTS[allocation] = (group, layout)
    return layout
