"""The optimizer every engine trains with and its step: AdamW, one gradient norm
(:mod:`treetrain.engines.grads`), clipping, the warm-up learning rate."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from treetrain.engines.grads import dtensor_pieces, global_norm
from treetrain.engines.sampler import LocalSampler


def adamw(model: torch.nn.Module, settings: Any) -> torch.optim.Optimizer | None:
    """The optimizer every engine trains with (``settings``: an ``OptimizerSettings``, or None
    for a forward-only engine, whose parameters then need no gradient). It steps the parameters
    that require a gradient: all of them, or a LoRA adapter's over a frozen base."""
    if settings is None:
        model.requires_grad_(False)
        return None
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=settings.lr,
        betas=(settings.betas[0], settings.betas[1]),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


class Optimization(LocalSampler):
    """The optimizer step of the engine core; an engine's hooks: :meth:`_grad_pieces` (which
    gradients it holds and how many ranks hold each) or a whole :meth:`grad_norm`."""

    def _grad_pieces(self) -> Iterable[tuple[torch.Tensor, int]]:
        """This rank's gradients and how many ranks of the world hold each same tensor."""
        return dtensor_pieces(self.model.parameters())

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients (one collective; every distinct tensor once)."""
        return global_norm(self._grad_pieces(), device=self.layout.device)

    def step(self) -> float:
        """Clip the gradients to ``max_grad_norm`` (one all-reduce, one host sync), apply AdamW
        with the warm-up learning rate, zero the gradients; returns the norm before clipping."""
        if self.optimizer is None or self.optim is None:
            raise RuntimeError(f"the {self.role} engine was built without an optimizer: it cannot step")
        cfg = self.optim
        norm = float(self.grad_norm())  # host sync: once per step, logged too
        if cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm:
            scale_grads(self.model.parameters(), cfg.max_grad_norm / (norm + 1e-6))
        warm = cfg.warmup_steps
        lr = cfg.lr * min(1.0, (self.steps + 1) / warm) if warm else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self._refresh_sampler()
        return norm

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)


def scale_grads(params: Iterable[torch.Tensor], coef: float) -> None:
    """Multiply every gradient in place (each rank its local shards; a pending sum's parts
    scale its sum)."""
    grads = []
    for p in params:
        g = p.grad
        if g is not None:
            local = g.to_local() if isinstance(g, DTensor) else g
            if local.numel():
                grads.append(local)
    if grads:
        torch.foreach.mul_(grads, coef)
