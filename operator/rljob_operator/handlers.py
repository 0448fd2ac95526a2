"""kopf wiring: watch RLJobs and their children, and queue the RLJob of every event.

The handlers are thin: any event on an RLJob or on one of its children (pods, Jobs,
StatefulSets, ...) only queues that RLJob in the controller's work queue
(operator/rljob_operator/workqueue.py); the controller (operator/rljob_operator/controller.py) reconciles one RLJob at a
time per key. Time-based steps (restart backoff, TTL) come back through the queue's delays; a
periodic resync catches anything missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from rljob_operator.controller import WORKERS, Controller
from rljob_operator.kube_login import Credentials, cannot_list_rljobs
from rljob_operator.models import GROUP, PLURAL, VERSION
from rljob_operator.names import LABEL_RLJOB, MANAGED_BY

# Only a safety net: every RLJob and every kind of child is watched, a pass that waits for time
# (backoff, TTL) is requeued with its delay, and kopf lists everything again after a watch
# reconnects. Each idle pass costs 7 GETs per RLJob, so the interval sets the idle load.
RESYNC_SECONDS = 300.0
log = logging.getLogger("rljob_operator")


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


class Readiness:
    """Ready once the operator has listed RLJobs with the login kopf watches with (address,
    certificate, token and RBAC all good), then for good: a later outage is kopf's to retry."""

    def __init__(self, namespaces: list[str]) -> None:
        self.namespaces = namespaces
        self.login: Credentials | None = None
        self.ready = False
        self.why = ""

    def check(self) -> None:
        if self.ready:
            return
        why = "not logged in to the API server yet"
        if self.login is not None:
            why = cannot_list_rljobs(self.login, self.namespaces) or ""
        if not why:
            self.ready = True
            log.info("ready: RLJobs listed at %s", self.login.server if self.login else "?")
            return
        if why != self.why and self.login is not None:  # before kopf's login is only a matter of time
            log.warning("not ready: %s", why)
        self.why = why
        raise kopf.PermanentError(f"not ready: {why}")  # permanent: fail this probe now, no retries


def build_registry(controller: Controller, namespaces: list[str] | None = None) -> kopf.OperatorRegistry:
    """kopf handlers bound to ``controller``, in their own registry (no global state)."""
    registry = kopf.OperatorRegistry()
    readiness = Readiness(namespaces or [])
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

    @kopf.on.probe(id="ready", registry=registry)
    def ready(**_: Any) -> str:
        # /healthz also answers 500 until RLJobs were listed once (the chart's readiness probe).
        readiness.check()
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
            info = kopf.login_with_service_account(settings=settings)
            if info is not None:
                readiness.login = Credentials(
                    server=info.server, ca_path=str(info.ca_path) if info.ca_path else None, insecure=False,
                    token=info.token, certificate_path=None, private_key_path=None,
                )  # fmt: skip
            return info
        c = readiness.login = controller.kube.credentials()
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
