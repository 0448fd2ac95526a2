"""SIGTERM as a request to stop, agreed by every rank.

Kubernetes sends SIGTERM before it kills a pod. The handler only records the request, says so at
once (the ticker prints the line) and asks what runs to stop soon: local generation stops within a
few tokens (the step is abandoned, the last one trained kept), a task or reward call in progress
gets its grace, and the rollout threads start no group of a later step. A step in training
finishes and is saved. Every rank must stop at the same point: any rank's SIGTERM stops them all
(:meth:`StopSignal.agreed`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from treetrain.engines.layout import Layout
from treetrain.trainer.ticker import Ticker


class StopSignal:
    """See the module docstring. ``stop_soon``: called from the handler, once per signal."""

    def __init__(self, layout: Layout, ticker: Ticker, stop_soon: Callable[[], None]) -> None:
        self.layout, self.ticker, self.stop_soon = layout, ticker, stop_soon
        self.requested = False

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """SIGTERM is a request to stop within the body (main thread only)."""
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if not self.requested:
                self.ticker.say(self.line())
            self.requested = True
            self.stop_soon()

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def line(self) -> str:
        step, phase = self.ticker.step, self.ticker.phase
        if step is None:
            return "SIGTERM received: stopping"
        if phase in ("rollout", "evaluation"):
            return f"SIGTERM received: stopping now; step {step}'s {phase} is abandoned, the last step trained is kept"
        return f"SIGTERM received: stopping after step {step} ({phase} in progress), which is kept"

    def agreed(self) -> bool:
        """Whether any rank received SIGTERM, known on every rank at once (a collective)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.layout.device)
        if self.layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # host sync: once per step, and every few tokens of local rollout

    def generation_check(self) -> bool:
        """Local generation's stop check, made by every rank at the same token."""
        return self.requested if self.layout.world_size == 1 else self.agreed()
