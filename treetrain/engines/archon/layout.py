"""One mapping from a checked :class:`Allocation` to Archon's device meshes.

Ranks are laid out row-major over ``(pp, dp, cp, tp)``, tensor parallel fastest. Three meshes
over the same ranks and in the same order:

- ``mesh`` ``(pp, dp_cp, tp)``: what parameters live on. Tensor parallel shards over ``tp``;
  FSDP2 shards over ``dp_cp`` (data and context ranks together: context-parallel ranks hold
  the same weights and split tokens, so their gradients add up like data-parallel ones).
- ``grid`` ``(pp, dp, cp, tp)``: no parameters; its groups place a rank (which trees it runs,
  which context chunk) and carry context parallel's exchanges.
- ``experts`` ``(pp, edp, ep, etp)``: the ffn side of a MoE string (``e`` re-slices the same
  ranks; a hybrid ``archon:(attn:...|ffn:...)`` takes ``etp`` from the ffn ``t``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from treetrain.alloc import Allocation
from treetrain.engines.layout import Dim, Layout, join

MESH_DIMS = ("pp", "dp_cp", "tp")
GRID_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_DIMS = ("pp", "edp", "ep", "etp")


def mesh_shapes(allocation: Allocation) -> dict[str, tuple[int, ...]]:
    """The three mesh shapes of ``allocation`` (named by :data:`MESH_DIMS` etc.)."""
    d = allocation.dims
    return {
        "mesh": (d.pp, d.dp * d.cp, d.tp),
        "grid": (d.pp, d.dp, d.cp, d.tp),
        "experts": (d.pp, d.edp, d.ep, d.etp),
    }


@dataclass(frozen=True, slots=True)
class ArchonLayout(Layout):
    """This process's place in the ``(pp, dp, cp, tp)`` grid, implementing the engines' layout
    protocol: ``dp_cp`` is the parameter mesh's dimension, ``ep``, ``etp`` and ``edp`` the
    expert mesh's, the rest the grid's."""

    mesh: DeviceMesh | None = None  # (pp, dp_cp, tp): what parameters live on
    grid: DeviceMesh | None = None
    experts: DeviceMesh | None = None  # only when experts are sharded (e or ffn t > 1)

    def _mesh_of(self, dim: Dim) -> DeviceMesh:
        mesh = self.mesh if dim == "dp_cp" else self.experts if dim in ("edp", "ep", "etp") else self.grid
        assert mesh is not None, f"no mesh holds {dim}"
        return mesh[dim]

    def _rank_in(self, dim: Dim) -> int:
        return self._mesh_of(dim).get_local_rank()

    def _group(self, dim: Dim) -> dist.ProcessGroup:
        return self._mesh_of(dim).get_group()


_LAYOUTS: dict[Allocation, tuple[object, ArchonLayout]] = {}


def init_layout(allocation: Allocation, *, timeout_s: float = 1800.0) -> ArchonLayout:
    """Join the process group (or reuse the one the trainer's other engines joined) and build
    the meshes; cached per allocation, so engines with one backend string share them."""
    device, world = join(allocation, timeout_s=timeout_s)
    if world == 1:
        return ArchonLayout(allocation=allocation, world_size=1, rank=0, device=device, mesh=None)
    cached = _LAYOUTS.get(allocation)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    shapes = mesh_shapes(allocation)
    kind = device.type
    layout = ArchonLayout(
        allocation=allocation,
        world_size=world,
        rank=dist.get_rank(),
        device=device,
        mesh=init_device_mesh(kind, shapes["mesh"], mesh_dim_names=MESH_DIMS),
        grid=init_device_mesh(kind, shapes["grid"], mesh_dim_names=GRID_DIMS),
        experts=init_device_mesh(kind, shapes["experts"], mesh_dim_names=EXPERT_DIMS)
        if allocation.dims.ep * allocation.dims.etp > 1
        else None,
    )
    _LAYOUTS[allocation] = (dist.group.WORLD, layout)
    return layout
