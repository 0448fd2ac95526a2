"""The trainer's weight sync: after each step, the rollout servers get the new weights.

One :class:`WeightSync` holds what a sync needs (the actor, the rollout client, the checkpoint
directory, the layout and the config's rollout section) and runs on every rank: every rank joins
the weight gather or the export, rank 0 talks to the servers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from treetrain.config import RolloutServers
from treetrain.engines.base import Engine
from treetrain.engines.errors import EngineConfigError
from treetrain.rl.rollout import HTTPRollout, LocalRollout, MixedRollout, RolloutClient, WeightGate
from treetrain.rl.weight_sync import WeightSender
from treetrain.trainer.checkpoints import Checkpoints


class WeightSync:
    """Pushes the actor's weights to the rollout servers, by disk or by broadcast
    (``rollout.weightSync.method``).

    :meth:`sync` runs inside the client's weight gate (treetrain.rl.rollout.gate): the gate is
    closed for the whole update (pause, push, resume), so no request is sent meanwhile, and only
    when every server took the new weights does ``gate.version`` move to ``version`` and the gate
    open. A failed update raises RolloutError naming the server and leaves the gate closed and
    failed with ``gate.version`` unchanged: the servers may hold either version or a mix, so no
    token can be labelled with a version they might not hold. With local rollout the sampler is
    the trained model itself: :meth:`sync` only records the version.
    """

    def __init__(
        self,
        *,
        actor: Engine,
        client: RolloutClient | None,
        checkpoints: Checkpoints,
        settings: RolloutServers,
        log: Callable[[str], None],
    ) -> None:
        self.actor = actor
        self.client = client  # None on ranks other than 0 with remote servers
        self.checkpoints = checkpoints
        self.settings = settings
        self.layout = actor.layout
        self.log = log
        self.remote = not isinstance(client, LocalRollout)
        self.sender: WeightSender | None = None  # distributed weight sync, joined at the first sync
        # The weight version's one owner: the client's gate; a rank without a client (remote
        # servers, not rank 0) keeps a gate of its own that only records the version.
        self.gate = client.gate if client is not None else WeightGate()

    @property
    def version(self) -> int:
        """The weights the rollout side serves (0: the initial ones)."""
        return self.gate.version

    def sync(self, version: int) -> None:
        """Every rank: the servers serve the actor's current weights as ``version``."""
        if not self.remote or self.client is None:
            if self.remote:  # not rank 0: join the gather or the export, rank 0 pushes
                self._push(version)
            self.gate.set_version(version)
            return
        with self.gate.update(version):
            self._push(version)

    def resend_if_restarted(self) -> None:
        """A server that restarted since the last sync serves the weights it started with: send it
        (every server) the current version again before sampling."""
        version = self.gate.version
        if not self.remote or version == 0:  # no sync yet: a restarted server holds the initial weights too
            return
        stale: list[Any] = [self.client.stale_servers(version) if self.layout.is_main and self.client else []]
        if self.layout.world_size > 1:
            dist.broadcast_object_list(stale, src=0)  # every rank joins the weight gather
        if stale[0]:
            self.log(
                f"rollout: {', '.join(stale[0])} does not hold weight version {version} (restarted?); sending it again"
            )
            if self.sender is not None:
                self.sender.reset()  # its ranks left the weight-update group with it
            self.sync(version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def _push(self, version: int) -> None:
        main = self.layout.is_main
        if self.settings.weight_sync.method == "distributed":
            weights = self.actor.hf_weights()  # every rank joins the gather; rank 0 holds them
            if main:
                assert weights is not None
                self._sender().push(weights.items(), version)
            self._barrier()
            return
        if self.checkpoints.root is None:
            raise EngineConfigError("disk weight sync needs checkpoint.dir (a path the rollout servers also mount)")
        path = self.checkpoints.weights_dir(version)
        self.actor.export_hf(path)
        if main:
            assert self.client is not None
            self.client.update_weights(str(path), version)
            self.checkpoints.prune_weights()  # every server has loaded this version: older ones go
        self._barrier()

    def _sender(self) -> WeightSender:
        """Rank 0's end of the weight-update group, joined with every server at the first sync."""
        if self.sender is None:
            assert isinstance(self.client, HTTPRollout | MixedRollout)
            self.sender = WeightSender(self.client.sync_targets(), self.settings.servers, self.settings.weight_sync)
            self.sender.connect()
        return self.sender

    def _barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier()
