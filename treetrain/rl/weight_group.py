"""The weight-update group: trainer rank 0 and every rollout server GPU in one process group,
over which the trainer broadcasts its weights in buckets.

Both sides of it live here, and this module imports nothing of treetrain but itself: the
trainer sends with it, and our vLLM worker extension (:mod:`treetrain.rl.vllm_worker`, loaded
inside the vLLM server) receives with it.

Joining is exactly what SGLang's servers do when asked ``/init_weights_update_group``
(``init_custom_process_group`` in the pinned SGLang, 0.5.23): a TCP rendezvous at
``tcp://ADDRESS:PORT`` (rank 0, the trainer, hosts the TCPStore), the store wrapped in a
``PrefixStore`` named after the group, and a new process group of ``world_size`` ranks on it,
independent of any default group. The trainer is rank 0; a server's GPUs are
``rank_offset + its tensor/pipeline rank``.

A bucket travels as one flat ``uint8`` tensor: the tensors' bytes back to back, in order, the
layout SGLang's ``load_format: flattened_bucket`` receives (``FlattenedTensorBucket``), so one
broadcast serves SGLang servers and ours alike. Tensors of one bucket share a dtype, so every
offset is aligned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GROUP_NAME = "treetrain-weights"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a bucket, as the servers are told it (``dtype`` is torch's name: ``bfloat16``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _dtype(self.dtype).itemsize


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def join(
    *, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float
) -> Any:
    """Join the group as ``rank`` (blocks until all ``world_size`` ranks joined, or ``timeout_s``);
    returns the process group. Rank 0 hosts the rendezvous on ``port``."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    host = f"[{address}]" if ":" in address else address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,  # type: ignore[arg-type]  # a GroupName is a str
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave(group: Any) -> None:
    dist.destroy_process_group(group)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` in order, cut into buckets of at most ``bucket_bytes`` (a larger tensor goes
    alone) whose tensors share one dtype."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack(bucket: list[tuple[str, torch.Tensor]], device: torch.device | str = "cpu") -> torch.Tensor:
    """The bucket's bytes back to back, as one flat uint8 tensor on ``device``."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    return torch.cat(parts).to(device)


def unpack(flat: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a received bucket (views into ``flat``)."""
    out = []
    offset = 0
    for s in specs:
        raw = flat[offset : offset + s.nbytes]
        out.append((s.name, raw.view(_dtype(s.dtype)).view(s.shape)))
        offset += s.nbytes
    if offset != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} bytes, but its tensors take {offset}")
    return out


def send(group: Any, flat: torch.Tensor) -> None:
    """Broadcast one packed bucket from rank 0."""
    dist.broadcast(flat, src=0, group=group)


def receive(group: Any, specs: list[TensorSpec], device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket broadcast by rank 0."""
    flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0, group=group)
    return unpack(flat, specs)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
