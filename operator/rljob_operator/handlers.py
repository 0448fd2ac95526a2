"""kopf wiring: watch RLJobs and their children, and queue the RLJob of every event.

The handlers are thin: any event on an RLJob or on one of its children (pods, Jobs,
StatefulSets, ...) only queues that RLJob in the controller's work queue
(operator/rljob_operator/workqueue.py); the controller (operator/rljob_operator/controller.py) reconciles one RLJob at a
time per key. Time-based steps (restart backoff, TTL) come back through the queue's delays; a
periodic resync catches anything missed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import kopf

from rljob_operator.controller import WORKERS, Controller
from rljob_operator.models import GROUP, PLURAL, VERSION
from rljob_operator.names import LABEL_RLJOB, MANAGED_BY

# Only a safety net: every RLJob and every kind of child is watched, a pass that waits for time
# (backoff, TTL) is requeued with its delay, and kopf lists everything again after a watch
# reconnects. Each idle pass costs 7 GETs per RLJob, so the interval sets the idle load.
RESYNC_SECONDS = 300.0


def tune_watching(settings: kopf.OperatorSettings) -> None:
    """Watch settings that bring the operator back quickly after the API server went away."""
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # kopf's default retry delays (1, 1, 2, 3, 5, 8, 13, 21 s) left a new RLJob unseen for up to
    # a minute after an API server restart (57 s measured): retry every 2 s at most instead,
    # for about as long in all (62 s) before kopf gives up on the attempt and lists again.
    settings.networking.error_backoffs = [0.5, 1.0, 1.0, *[2.0] * 30]
    # A dead endpoint is known in seconds on a healthy network (the default waits for the
    # 5-minute request timeout); and a watch that ended is opened again at once.
    settings.networking.connect_timeout = 5.0
    settings.watching.connect_timeout = 5.0
    settings.watching.reconnect_backoff = 0.5


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    """kopf handlers bound to ``controller``, in their own registry (no global state)."""
    registry = kopf.OperatorRegistry()
    children: dict[str, Any] = {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_RLJOB: kopf.PRESENT}

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.peering.standalone = True
        settings.posting.enabled = False  # events are posted by the controller, per transition
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        tune_watching(settings)
        memo["queue_task"] = asyncio.create_task(controller.queue.run(controller.worker, WORKERS), name="work queue")
        memo["resync_task"] = asyncio.create_task(_resync(controller), name="resync")
        controller.watch(memo["queue_task"])
        controller.watch(memo["resync_task"])

    @kopf.on.probe(id="background", registry=registry)
    def alive(**_: Any) -> str:
        # /healthz answers 500 once the reconcile loop is dead (kopf reports a failing probe).
        if controller.fatal:
            raise kopf.PermanentError(controller.fatal)  # permanent: fail this probe now, no retries
        return "ok"

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: kopf.Memo, **_: Any) -> None:
        for name in ("queue_task", "resync_task"):
            task = memo.get(name)
            if task is not None:
                task.cancel()
        controller.close()

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
        if controller.kube.in_cluster:
            return kopf.login_with_service_account(settings=settings)
        c = controller.kube.credentials()
        return kopf.ConnectionInfo(
            server=c.server,
            ca_path=c.ca_path,
            insecure=c.insecure,
            scheme="Bearer" if c.token else None,
            token=c.token,
            certificate_path=c.certificate_path,
            private_key_path=c.private_key_path,
        )

    # Async handlers run on the event loop itself (kopf runs sync ones in executor threads).
    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def rljob_changed(
        namespace: str | None, name: str, type: str | None, meta: Mapping[str, Any], **_: Any
    ) -> None:
        controller.event((namespace or "default", name), meta.get("generation"), deleted=type == "DELETED")

    async def child_changed(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        controller.queue.add((namespace or "default", labels[LABEL_RLJOB]))

    # Every kind of child is watched: one deleted by hand is recreated at once, not at the resync.
    children_kinds = (
        ("", "v1", "pods"),
        ("", "v1", "services"),
        ("", "v1", "configmaps"),
        ("batch", "v1", "jobs"),
        ("apps", "v1", "statefulsets"),
        ("networking.k8s.io", "v1", "networkpolicies"),
    )
    for group, version, plural in children_kinds:
        kopf.on.event(group, version, plural, labels=children, registry=registry)(child_changed)
    return registry


async def _resync(controller: Controller) -> None:
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        for key in list(controller.known):
            controller.queue.add(key)
