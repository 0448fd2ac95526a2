"""Distributed weight sync, the trainer's side: join the weight-update group with every rollout
server (each asked in its own API), then per version pause them, broadcast the weights bucket by
bucket while each server is asked to receive that bucket, and resume them.

Ranks: the trainer is 0; server i's GPUs follow the servers before it in the config
(``rank_offset = 1 + sum of their gpus``), as the operator wrote them (``rollout.servers[].gpus``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from treetrain.config import RolloutServer, WeightSyncSettings
from treetrain.rl import weight_group as wg
from treetrain.rl.rollout import BucketRequest, GroupRequest, HTTPRollout, RolloutError


class WeightSender:
    """Trainer rank 0's end of the weight-update group."""

    def __init__(
        self, targets: Sequence[tuple[HTTPRollout, str]], servers: Sequence[RolloutServer], settings: WeightSyncSettings
    ) -> None:
        gpus = {s.url.rstrip("/"): s.gpus for s in servers}
        offsets, first = {}, 1
        for s in servers:
            offsets[s.url.rstrip("/")] = first
            first += s.gpus
        missing = [ep for _, ep in targets if ep not in gpus]
        if missing:
            raise RolloutError(f"weight sync: {', '.join(missing)} not in rollout.servers, so it has no ranks")
        self.targets = list(targets)
        self.offsets = offsets
        backend = settings.backend if settings.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.request = GroupRequest(
            address=settings.master_address,
            port=settings.master_port,
            world_size=first,
            name=wg.GROUP_NAME,
            backend=backend,
            timeout_s=settings.timeout_seconds,
        )
        self.bucket_bytes = settings.bucket_mb * 1024 * 1024
        self.group: Any = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.targets)), thread_name_prefix="weight-sync")

    @property
    def where(self) -> str:
        return f"{self.request.address}:{self.request.port}"

    def connect(self) -> None:
        """Every server joins the group while rank 0 hosts its rendezvous; a server that does not
        join within the timeout is named."""
        r = self.request
        asked = {ep: self._pool.submit(c.join_group, ep, r, self.offsets[ep]) for c, ep in self.targets}
        try:
            self.group = wg.join(
                address=r.address,  # rank 0's store listens on every interface; its own client dials this
                port=r.port,
                rank=0,
                world_size=r.world_size,
                group_name=r.name,
                backend=r.backend,
                timeout_s=r.timeout_s,
            )
        except Exception as err:  # the rendezvous timed out or broke: say which servers never joined
            raise RolloutError(
                f"weight sync: {self._who(asked)} did not join the weight-update group at {self.where} "
                f"(world size {r.world_size}) within {r.timeout_s:.0f}s: {err}"
            ) from None
        self._wait(asked, "join the weight-update group")

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast ``weights`` as ``version``: every server paused, bucket by bucket, resumed."""
        if self.group is None:
            self.connect()
        paused = dict(zip([ep for _, ep in self.targets], self._all(lambda c, ep: c.pause(ep)), strict=True))
        try:
            pending = list(wg.buckets(weights, self.bucket_bytes))
            for i, bucket in enumerate(pending):
                specs = [wg.spec_of(name, t) for name, t in bucket]
                req = BucketRequest(
                    group=self.request,
                    names=[s.name for s in specs],
                    dtypes=[s.dtype for s in specs],
                    shapes=[list(s.shape) for s in specs],
                    version=version,
                    first=i == 0,
                    last=i == len(pending) - 1,
                )
                asked = {ep: self._pool.submit(c.receive_bucket, ep, req) for c, ep in self.targets}
                try:
                    wg.send(self.group, wg.pack(bucket, self.device))
                except Exception as err:
                    self.group = None  # a broken group is joined afresh next time
                    raise RolloutError(f"weight sync to {self._who(asked)} failed at bucket {i + 1}: {err}") from None
                self._wait(asked, f"load weights version {version}")
        finally:
            self._all(lambda c, ep: c.resume(ep) if paused[ep] else None)

    def reset(self) -> None:
        """Leave the group (a server restarted: its ranks are gone), so the next push joins every
        server afresh. The live servers are asked to leave too; their answers do not matter."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                wg.leave(self.group)
            self.group = None
            for c, ep in self.targets:
                with contextlib.suppress(Exception):
                    c.leave_group(ep, self.request)

    def close(self) -> None:
        if self.group is not None:
            wg.leave(self.group)
            self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ---------------------------------------------------------------------------
    def _all(self, fn: Callable[[HTTPRollout, str], Any]) -> list[Any]:
        futures = [self._pool.submit(fn, c, ep) for c, ep in self.targets]
        return [f.result() for f in futures]

    def _who(self, asked: dict[str, Future[None]]) -> str:
        """The servers whose request failed, with their error; else those that have not answered
        (within 5 s: a failure of the group breaks the requests of the servers in it too, later)."""
        if not any(f.done() and f.exception() is not None for f in asked.values()):
            wait(asked.values(), timeout=5.0)
        failed = [f"{ep} ({f.exception()})" for ep, f in asked.items() if f.done() and f.exception() is not None]
        silent = [f"{ep} (no answer)" for ep, f in asked.items() if not f.done()]
        return ", ".join(failed or silent) or "a rollout server"

    def _wait(self, asked: dict[str, Future[None]], what: str) -> None:
        done, _ = wait(asked.values(), timeout=self.request.timeout_s)
        failed = [ep for ep, f in asked.items() if f not in done or f.exception() is not None]
        if failed:
            raise RolloutError(f"weight sync: {self._who(asked)} did not {what}")
