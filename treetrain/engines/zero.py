"""A ZeRO-1 AdamW: optimizer state sharded over data-parallel ranks.

Each bucket is a list of parameters replicated over one process group (for Megatron: dense
weights over the data x context ranks, experts over the expert-data ranks). Its gradients
live in one flat buffer (``p.grad`` are views of it), padded to a multiple of the group size;
rank ``r`` of the group owns the ``r``-th equal slice (its *shard*). A step is:

1. :meth:`ShardedAdamW.reduce_grads`: the buffer is reduce-scattered (sum) in place, so this
   rank's shard holds the summed gradient (the rest of the buffer keeps local values, as
   NCCL's in-place reduce-scatter leaves it);
2. :meth:`ShardedAdamW.grad_norm`: the global norm from the summed shards, each element
   counted once;
3. :meth:`ShardedAdamW.step`: AdamW on the shard (the same arithmetic as
   ``torch.optim.AdamW``'s single-tensor path), then the updated shards are all-gathered
   into the gradient buffer (no longer needed) and copied into the parameters.

Only ``exp_avg`` and ``exp_avg_sq`` of the shard persist (8 bytes per shard element), plus an
fp32 master copy of the shard when the parameters are not fp32. Clipping that scales
``p.grad`` (``base.scale_grads``) scales the buffer, the shard included.

The collectives are our own so they run on every backend: NCCL's ``reduce_scatter_tensor`` /
``all_gather_into_tensor``, elsewhere (gloo) one ``reduce`` / ``broadcast`` per shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from treetrain.engines.grads import global_norm

__all__ = ["Bucket", "ShardedAdamW", "all_gather_flat", "reduce_scatter_sum", "state_bytes"]


def _nccl(group: Any, t: torch.Tensor) -> bool:
    """Whether NCCL runs this collective (CUDA tensors; a mixed ``cpu:gloo,cuda:nccl`` backend too)."""
    return t.is_cuda and "nccl" in str(dist.get_backend(group))


def reduce_scatter_sum(out: torch.Tensor, flat: torch.Tensor, group: Any) -> None:
    """``out`` = this rank's slice of the sum of ``flat`` over ``group`` (``flat`` 1-D, ``size``
    equal slices of ``out.numel()``). ``out`` may be that slice of ``flat`` itself; the rest of
    ``flat`` is left as it was."""
    size = dist.get_world_size(group)
    if flat.numel() != size * out.numel():
        raise ValueError(f"reduce-scatter of {flat.numel()} elements into {size} slices of {out.numel()}")
    if _nccl(group, flat):
        dist.reduce_scatter_tensor(out, flat, group=group)
        return
    me = dist.get_rank(group)
    slices = flat.view(size, -1)
    for j in range(size):
        if j == me:
            out.copy_(slices[j])
            dist.reduce(out, dst=dist.get_global_rank(group, j), group=group)
        else:  # a copy: gloo may use a non-destination tensor as scratch
            dist.reduce(slices[j].clone(), dst=dist.get_global_rank(group, j), group=group)


def all_gather_flat(flat: torch.Tensor, group: Any) -> None:
    """Fill ``flat`` (1-D, ``size`` equal slices) in place with every rank's own slice."""
    size = dist.get_world_size(group)
    slices = flat.view(size, -1)
    if _nccl(group, flat):
        dist.all_gather_into_tensor(flat, slices[dist.get_rank(group)].clone(), group=group)
        return
    for j in range(size):
        dist.broadcast(slices[j], src=dist.get_global_rank(group, j), group=group)


@dataclass(slots=True)
class Bucket:
    """Parameters replicated over ``group`` (None: this process alone), sharded together."""

    named: list[tuple[str, torch.nn.Parameter]]
    group: Any = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None and dist.is_initialized() else 0


class _Flat:
    """One bucket's flat gradient buffer, its offsets, and this rank's shard and state."""

    def __init__(self, bucket: Bucket, *, master: bool) -> None:
        params = [p for _, p in bucket.named]
        self.names = [n for n, _ in bucket.named]
        self.params = params
        self.group = bucket.group
        self.size, self.rank = bucket.size, bucket.rank
        numel = sum(p.numel() for p in params)
        self.numel = numel
        self.padded = -(-numel // self.size) * self.size  # pad < group size elements
        self.shard = self.padded // self.size
        self.lo = self.rank * self.shard
        first = params[0]
        self.grad = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.exp_avg = torch.zeros(self.shard, dtype=torch.float32, device=first.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.step = torch.zeros((), dtype=torch.float32)
        self.master = self.read_shard().float() if master else None

    def views(self) -> Iterable[tuple[torch.nn.Parameter, torch.Tensor]]:
        for p, offset in zip(self.params, self.offsets, strict=True):
            yield p, self.grad[offset : offset + p.numel()].view_as(p)

    def attach(self) -> None:
        """Make every ``p.grad`` a view of the buffer (autograd then accumulates in place);
        a gradient autograd allocated itself (after ``p.grad = None``) is copied in first."""
        for p, view in self.views():
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
            else:
                continue
            p.grad = view

    def overlaps(self) -> Iterable[tuple[int, int, int, int]]:
        """(parameter index, start in the parameter, start in the shard, length) of every
        parameter part inside this rank's shard."""
        hi = self.lo + self.shard
        for i, (p, offset) in enumerate(zip(self.params, self.offsets, strict=True)):
            a, b = max(offset, self.lo), min(offset + p.numel(), hi)
            if a < b:
                yield i, a - offset, a - self.lo, b - a

    def read_shard(self) -> torch.Tensor:
        """This rank's shard of the parameters, flat (padding zero)."""
        out = torch.zeros(self.shard, dtype=self.params[0].dtype, device=self.grad.device)
        for i, start, at, n in self.overlaps():
            out[at : at + n] = self.params[i].detach().reshape(-1)[start : start + n]
        return out

    def shard_grad(self) -> torch.Tensor:
        return self.grad[self.lo : self.lo + self.shard]


def _adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update in place, the operations of ``torch.optim.AdamW``'s single-tensor
    path in its order (so a sharded step equals the unsharded one element for element)."""
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW whose state is split over each bucket's group (see the module docstring).

    ``copies(name)``: how many ranks of the default group hold parameter ``name`` (replicas
    over every dimension; default: the ranks of its bucket's group); the norm counts a summed shard element ``copies / group size``
    times over, so the all-reduced sum of squares counts each distinct element once. Sums
    over other groups (tensor ranks, a tied embedding's two stages) run on ``p.grad`` before
    :meth:`reduce_grads`."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        copies: Callable[[str], int] | None = None,
    ) -> None:
        buckets = [b for b in buckets if b.named]
        if not buckets:
            raise ValueError("a sharded optimizer needs at least one parameter")
        params = [p for b in buckets for _, p in b.named]
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.flats = [_Flat(b, master=b.named[0][1].dtype != torch.float32) for b in buckets]
        for flat in self.flats:
            flat.attach()
            # What ``Optimizer.state`` holds (counted by memory checks like torch's AdamW's).
            self.state[flat.grad] = {"step": flat.step, "exp_avg": flat.exp_avg, "exp_avg_sq": flat.exp_avg_sq}
            if flat.master is not None:
                self.state[flat.grad]["master"] = flat.master
        self._weights = [self._norm_weights(f, copies) for f in self.flats]

    @staticmethod
    def _norm_weights(flat: _Flat, copies: Callable[[str], int] | None) -> list[tuple[int, int, int]]:
        """(start in the shard, length, copies of a summed element) of each parameter part."""
        out = []
        for i, _, at, n in flat.overlaps():
            c = flat.size if copies is None else copies(flat.names[i])
            if c % flat.size:
                raise ValueError(f"{flat.names[i]}: {c} copies do not divide over a group of {flat.size}")
            out.append((at, n, c // flat.size))
        return out

    # -- gradients ------------------------------------------------------------------------
    def attach_grads(self) -> None:
        """Every ``p.grad`` a view of its bucket's buffer (before any sum touches them)."""
        for flat in self.flats:
            flat.attach()

    def reduce_grads(self) -> None:
        """Sum each bucket's gradients over its group into this rank's shard."""
        self.attach_grads()
        for flat in self.flats:
            if flat.size > 1:
                reduce_scatter_sum(flat.shard_grad(), flat.grad, flat.group)

    def grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        """This rank's summed gradient shards with the ranks that hold each same element."""
        pieces = []
        for flat, weights in zip(self.flats, self._weights, strict=True):
            g = flat.shard_grad()
            pieces += [(g[at : at + n], c) for at, n, c in weights]
        return pieces

    def grad_norm(self, device: torch.device | None = None) -> torch.Tensor:
        """The global L2 norm from the summed shards (one all-reduce over the default group)."""
        return global_norm(self.grad_pieces(), device=device or self.flats[0].grad.device)

    def gather_grads(self) -> None:
        """Complete every ``p.grad`` with the other ranks' summed shards (tests and gradient
        exports; training does not need it)."""
        for flat in self.flats:
            if flat.size > 1:
                all_gather_flat(flat.grad, flat.group)

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW on this rank's shards, then every rank's updated shards into the parameters.
        Gradients must have gone through :meth:`reduce_grads`; they are zero afterwards."""
        if closure is not None:
            raise ValueError("ShardedAdamW takes no closure")
        group = self.param_groups[0]
        for flat in self.flats:
            flat.step += 1
            shard = flat.master if flat.master is not None else flat.read_shard()
            grad = flat.shard_grad().float() if flat.master is not None else flat.shard_grad()
            _adamw_(
                shard,
                grad,
                flat.exp_avg,
                flat.exp_avg_sq,
                int(flat.step),
                lr=float(group["lr"]),
                betas=(float(group["betas"][0]), float(group["betas"][1])),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
            )
            # The gradient buffer is free now: it carries the new weights between ranks.
            flat.shard_grad().copy_(shard)
            if flat.size > 1:
                all_gather_flat(flat.grad, flat.group)
            for p, view in flat.views():
                p.copy_(view)
            flat.grad.zero_()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buffers; ``p.grad`` stay views of them (``set_to_none`` is ignored)."""
        for flat in self.flats:
            flat.grad.zero_()
            flat.attach()

    # -- checkpoints ----------------------------------------------------------------------
    def _layout(self) -> list[list[int]]:
        return [[f.numel, f.size, f.rank] for f in self.flats]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state (each rank saves its own)."""
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, f in enumerate(self.flats):
            state[i] = {"step": f.step.clone(), "exp_avg": f.exp_avg.clone(), "exp_avg_sq": f.exp_avg_sq.clone()}
            if f.master is not None:
                state[i]["master"] = f.master.clone()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups, "zero": self._layout()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same shard layout (else a ValueError)."""
        if state_dict.get("zero") != self._layout():
            raise ValueError(
                f"the optimizer state was sharded as {state_dict.get('zero')} (elements, group size, rank per "
                f"bucket), this run shards {self._layout()}"
            )
        with torch.no_grad():
            for i, f in enumerate(self.flats):
                s = state_dict["state"][i]
                f.step.copy_(s["step"])
                f.exp_avg.copy_(s["exp_avg"])
                f.exp_avg_sq.copy_(s["exp_avg_sq"])
                if f.master is not None:
                    f.master.copy_(s["master"])
        for g, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update(saved)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps in its ``state`` (``torch.optim.AdamW`` or
    :class:`ShardedAdamW`)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
