"""Lay an allocation out on nodes: how many pods, GPUs per pod, nodes.

Training ranks spread over whole nodes (one pod per node, torchrun inside), so a
world size larger than a node must be a multiple of it. Inference servers get one
pod per instance when an instance fits on a node, else several whole-node pods per
instance (multi-node tensor or pipeline parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.alloc.errors import PlacementError
from treetrain.alloc.model import Allocation


@dataclass(frozen=True, slots=True)
class PodPlan:
    """Where one engine's GPUs go."""

    pods: int
    gpus_per_pod: int
    nodes: int  # the fewest nodes that hold every pod
    pods_per_instance: int = 1  # pods that form one instance (training: the whole torchrun job)

    @property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod


def plan_pods(allocation: Allocation, gpus_per_node: int) -> PodPlan:
    """Pods, GPUs per pod and nodes for ``allocation`` on nodes of ``gpus_per_node`` GPUs."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise PlacementError(
            f"GPUs per node must be a whole number >= 1, got {gpus_per_node!r}",
            fix="set gpusPerNode to the GPU count of one node, e.g. 8",
        )
    if allocation.kind == "training":
        return _whole_nodes(allocation, allocation.world_size, gpus_per_node, instances=1)
    per_instance = allocation.gpus_per_instance
    if per_instance <= gpus_per_node:
        per_node = gpus_per_node // per_instance
        nodes = -(-allocation.instances // per_node)
        return PodPlan(pods=allocation.instances, gpus_per_pod=per_instance, nodes=nodes)
    return _whole_nodes(allocation, per_instance, gpus_per_node, instances=allocation.instances)


def _whole_nodes(allocation: Allocation, gpus: int, gpus_per_node: int, *, instances: int) -> PodPlan:
    """One pod per node for ``instances`` groups of ``gpus`` GPUs each."""
    if gpus <= gpus_per_node:
        return PodPlan(pods=1, gpus_per_pod=gpus, nodes=1)
    if gpus % gpus_per_node:
        what = "world size" if allocation.kind == "training" else "GPUs per instance (t*p)"
        below, above = gpus - gpus % gpus_per_node, gpus - gpus % gpus_per_node + gpus_per_node
        raise PlacementError(
            f"{allocation}: {what} {gpus} does not fill whole nodes of {gpus_per_node} GPUs",
            fix=f"make it at most {gpus_per_node} or a multiple of it (e.g. {below} or {above})",
        )
    pods_per_instance = gpus // gpus_per_node
    pods = pods_per_instance * instances
    return PodPlan(pods=pods, gpus_per_pod=gpus_per_node, nodes=pods, pods_per_instance=pods_per_instance)
