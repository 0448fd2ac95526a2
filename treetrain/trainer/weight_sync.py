"""The trainer's weight sync: after each step, the rollout servers get the new weights.

One :class:`WeightSync` holds what a sync needs (the actor, the rollout client, the checkpoint
directory, the layout and the config's rollout section) and runs on every rank: every rank joins
the weight gather or the export, rank 0 talks to the servers.

What is sent (``payload``): the full weights, or with ``actor.lora`` the adapter alone
(``sync: adapter``, the default: exported under ``checkpoint.dir/adapters`` and loaded by every
server under a versioned name, treetrain.rl.rollout.adapters) or the adapter merged into full
weights (``sync: merged``: the engine's ``hf_weights``/``export_hf`` merge it, the trainer's own
weights stay unmerged) through the full-weight path. Each sync's seconds and bytes are kept in
:attr:`WeightSync.last` for the metrics.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from treetrain.config import RolloutServers
from treetrain.config.lora import LoraSettings
from treetrain.engines.base import Engine
from treetrain.engines.errors import EngineConfigError
from treetrain.metrics.record import SyncRecord
from treetrain.rl.rollout import (
    AdapterSlots,
    HTTPRollout,
    LocalRollout,
    MixedRollout,
    RolloutClient,
    WeightGate,
    use_adapter,
)
from treetrain.rl.rollout.adapters import check_adapter_dir
from treetrain.rl.weight_sync import WeightSender
from treetrain.trainer.checkpoints import Checkpoints

ADAPTER_NAME = "actor"  # the servers serve version k of the actor's adapter as "actor-vk"


class WeightSync:
    """Pushes the actor's weights to the rollout servers, by disk or by broadcast
    (``rollout.weightSync.method``).

    :meth:`sync` runs inside the client's weight gate (treetrain.rl.rollout.gate): the gate is
    closed for the whole update (pause, push, resume), so no request is sent meanwhile, and only
    when every server took the new weights does ``gate.version`` move to ``version`` and the gate
    open. A failed update raises RolloutError naming the server and leaves the gate closed and
    failed with ``gate.version`` unchanged: the servers may hold either version or a mix, so no
    token can be labelled with a version they might not hold. With local rollout the sampler is
    the trained model itself (with its adapter, when it has one): :meth:`sync` only records the
    version.

    Adapter sync keeps ``maxStaleness + 2`` versions on every server (``keep``): by admission a
    request in flight names one of the newest ``maxStaleness + 1``, and one more is margin.
    """

    def __init__(
        self,
        *,
        actor: Engine,
        client: RolloutClient | None,
        checkpoints: Checkpoints,
        settings: RolloutServers,
        log: Callable[[str], None],
        lora: LoraSettings | None = None,
        max_staleness: int = 0,
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
        self.payload = "adapter" if self.remote and lora is not None and lora.sync == "adapter" else "full"
        self.slots = AdapterSlots(ADAPTER_NAME, keep=max_staleness + 2) if self.payload == "adapter" else None
        self.last: SyncRecord | None = None  # the last sync's figures (rank 0's are the ones exported)
        if self.slots is not None:
            if checkpoints.root is None:
                raise EngineConfigError(
                    "actor.lora.sync adapter needs checkpoint.dir (a path the rollout servers also mount: the "
                    "adapters are saved there); fix: set checkpoint.dir, or actor.lora.sync: merged"
                )
            if client is not None:
                use_adapter(client, self.slots)

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
        t0 = time.perf_counter()
        sent = self._push_adapter(version, self.slots) if self.slots is not None else self._push_full(version)
        adapter = version if self.slots is not None else None
        self.last = SyncRecord(self.payload, time.perf_counter() - t0, sent, version, adapter_version=adapter)

    def _push_adapter(self, version: int, slots: AdapterSlots) -> int:
        """The adapter alone, as a PEFT directory every server loads (the bytes of its files)."""
        assert self.checkpoints.root is not None
        path = self.checkpoints.root / "adapters" / f"v{version:08d}"
        self.actor.export_adapter(path)
        sent = 0
        if self.layout.is_main:
            assert self.client is not None
            check_adapter_dir(str(path))
            self.client.update_adapter(str(path), version)
            sent = _bytes_of(path)
            # A server may read an adapter of the window again (vLLM reloads an evicted one from
            # its path): those stay, older ones go.
            _prune_versions(path.parent, keep=set(slots.window(version)))
        self._barrier()
        return sent

    def _push_full(self, version: int) -> int:
        """Full weights (merged with the adapter when there is one): their bytes."""
        main = self.layout.is_main
        if self.settings.weight_sync.method == "distributed":
            weights = self.actor.hf_weights()  # every rank joins the gather; rank 0 holds them
            sent = 0
            if main:
                assert weights is not None
                self._sender().push(weights.items(), version)
                sent = sum(t.numel() * t.element_size() for t in weights.values())
            self._barrier()
            return sent
        sent = 0
        if self.checkpoints.root is None:
            raise EngineConfigError("disk weight sync needs checkpoint.dir (a path the rollout servers also mount)")
        path = self.checkpoints.weights_dir(version)
        self.actor.export_hf(path)
        if main:
            assert self.client is not None
            self.client.update_weights(str(path), version)
            sent = _bytes_of(path)
            self.checkpoints.prune_weights()  # every server has loaded this version: older ones go
        self._barrier()
        return sent

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


def _bytes_of(directory: Path) -> int:
    """The bytes of the files a sync wrote (what each server reads)."""
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _prune_versions(root: Path, *, keep: set[int]) -> None:
    """Remove the ``vNNNNNNNN`` directories under ``root`` whose version is older than every kept one."""
    oldest = min(keep, default=0)
    for old in root.glob("v*"):
        if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < oldest:
            shutil.rmtree(old, ignore_errors=True)
