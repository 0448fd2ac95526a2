"""The FSDP engine's layout: a ``dp x tp`` device mesh from a checked allocation
(``fsdp:d4t2`` -> a 4 x 2 mesh), implementing the engines' layout protocol
(:class:`treetrain.engines.layout.Layout`).

Layouts are cached per allocation, so engines with the same backend string share one mesh (one
set of sub-groups), and another string of the same world size (actor ``fsdp:d2``, critic
``fsdp:t2``) gets its own mesh over the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treetrain.alloc import Allocation
from treetrain.engines.layout import Dim, Layout, join

MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True, slots=True)
class FSDPLayout(Layout):
    """This process's place in the ``dp x tp`` grid (context, pipeline and expert sizes are 1)."""

    mesh: DeviceMesh | None = None  # None: one process, nothing to shard

    def _mesh_dim(self, dim: Dim) -> str:
        if dim in MESH_DIMS or dim == "dp_cp":  # c is 1: the data x context ranks are the data ranks
            return "dp" if dim == "dp_cp" else dim
        raise ValueError(f"the FSDP engine has no {dim} dimension")

    def _rank_in(self, dim: Dim) -> int:
        assert self.mesh is not None
        return self.mesh[self._mesh_dim(dim)].get_local_rank()

    def _group(self, dim: Dim) -> dist.ProcessGroup:
        assert self.mesh is not None
        return self.mesh[self._mesh_dim(dim)].get_group()


# allocation -> (the default group it was built in, its layout). A destroyed and re-created
# default group (tests do that) invalidates the entry: its meshes' sub-groups are gone.
_LAYOUTS: dict[Allocation, tuple[object, FSDPLayout]] = {}


def init_layout(allocation: Allocation, *, timeout_s: float = 1800.0) -> FSDPLayout:
    """Join torchrun's process group (once per process) and build the mesh of ``allocation``
    (from :func:`treetrain.config.check_training_backend`).

    One process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) needs no process group at all; an
    allocation for more ranks than were started is an error that names both. Every rank
    must call this with the same allocations in the same order (a new mesh creates
    sub-groups, a collective call).
    """
    device, world = join(allocation, timeout_s=timeout_s)
    if world == 1:
        return FSDPLayout(allocation=allocation, world_size=1, rank=0, device=device)
    group = dist.group.WORLD
    cached = _LAYOUTS.get(allocation)
    if cached is not None and cached[0] is group:
        return cached[1]
    mesh = init_device_mesh(device.type, (allocation.dims.dp, allocation.dims.tp), mesh_dim_names=MESH_DIMS)
    layout = FSDPLayout(allocation=allocation, world_size=world, rank=dist.get_rank(), device=device, mesh=mesh)
    _LAYOUTS[allocation] = (group, layout)
    return layout
