"""Rank 0's generate calls mirrored on every rank.

Local rollout samples with the trained model, which a layout of several ranks shards: every rank
must take part in every generate call. Only rank 0 plays episodes (a task's, an agent's runs
through its proxy, an evaluation), so rank 0 leads each call (:meth:`Lockstep.lead`: its
arguments are broadcast first) and the other ranks sit in :meth:`Lockstep.follow`, making the
same calls, until rank 0 sends the stop sentinel (:meth:`Lockstep.stop`). Rank 0 keeps its own
result; the others discard theirs. With rollout servers only rank 0 generates: ``world_size`` 1,
and leading is calling.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from treetrain.rl.episodes import Generate
from treetrain.rl.progress import RolloutStopped
from treetrain.rl.rollout import Generation, SamplingParams


class Lockstep:
    """See the module docstring. :meth:`lead` may be called from any thread (the proxy's
    sampler), one call at a time when the calls are mirrored."""

    def __init__(self, generate: Generate | None, world_size: int) -> None:
        self.generate = generate  # None: a rank that never generates (rollout servers, not rank 0)
        self.world_size = world_size
        self._lock = threading.Lock()

    def lead(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        assert self.generate is not None
        if self.world_size == 1:
            return self.generate(prompts, params, seed)
        with self._lock:
            dist.broadcast_object_list([(prompts, params, seed)], src=0)
            return self.generate(prompts, params, seed)

    def stop(self) -> None:
        if self.world_size > 1:
            with self._lock:
                dist.broadcast_object_list([None], src=0)

    def follow(self) -> None:
        if self.world_size == 1:
            return
        assert self.generate is not None
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                return
            prompts, params, seed = box[0]
            try:
                self.generate(prompts, params, seed)
            except RolloutStopped:
                continue  # rank 0 stopped too (the same token); it ends the following with stop()
