"""The controller runtime: one reconcile pass per RLJob key from the work queue. A pass reads the
RLJob and its children, asks the pure ``decide`` (operator/rljob_operator/reconcile.py) what to do, does it,
and patches the status when it changed; a child the API server refuses, or a pass that fails
otherwise, is retried with a backoff. The kopf wiring (operator/rljob_operator/handlers.py) only queues keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from rljob_operator.applied import stamped, unchanged
from rljob_operator.conditions import backoff_seconds, set_condition
from rljob_operator.key_secret import KeySecrets
from rljob_operator.kube import Conflict, Kube, NotOurs
from rljob_operator.metrics import Metrics
from rljob_operator.observe import Observed, controlled_by, owned
from rljob_operator.policy import Limits
from rljob_operator.reconcile import Decision, decide
from rljob_operator.workqueue import Key, WorkQueue

log = logging.getLogger("rljob_operator")

# RLJobs reconciled at once; the lists of a pass's six kinds of children, its applies and its
# events go out in parallel. More workers only added contention for the API server's CPU: with
# 8, 200 RLJobs took 34 s to run and p99 reconcile was 1.7 s on 2 cores; with 4, 24 s and 0.5 s.
WORKERS = 4
CHILD_KINDS = ("Job", "StatefulSet", "Pod", "ConfigMap", "Service", "NetworkPolicy")
REFUSAL_BACKOFF_SECONDS = 5.0  # a refused child is tried again after 5 s, 10 s, 20 s, ... 5 min
MAX_REFUSAL_BACKOFF_SECONDS = 300.0
ERROR_BACKOFF_SECONDS = 5.0  # a pass that failed otherwise (API server away, ...): 5 s, 10 s, ... 1 min
MAX_ERROR_BACKOFF_SECONDS = 60.0
# Children carry the RLJob's name as a label value, which the API allows up to 63 characters:
# an RLJob with a longer name (refused by plan) can have no children to list.
MAX_LABEL_VALUE = 63


class RefusedChild(Exception):
    """The API server answered 4xx to a child object the operator rendered."""

    def __init__(self, kind: str, name: str, status: int, message: str) -> None:
        self.kind, self.name, self.status, self.message = kind, name, status, message
        super().__init__(f"{kind} {name}: HTTP {status}: {message}" if status else message)


def refusal_message(status: Mapping[str, Any]) -> str | None:
    """The API server's words of a ReconcileError condition that is True, else None."""
    for c in status.get("conditions") or []:
        if c.get("type") == "ReconcileError" and c.get("status") == "True":
            return str(c.get("message") or "")
    return None


def still_invalid(rljob: Mapping[str, Any]) -> bool:
    """Whether the stored status already says Valid=False for the RLJob's current generation: the
    pass that found it invalid deleted its children, so there is nothing to list or delete."""
    status = rljob.get("status") or {}
    valid = next((c for c in status.get("conditions") or [] if c.get("type") == "Valid"), None)
    generation = (rljob.get("metadata") or {}).get("generation")
    return valid is not None and valid.get("status") == "False" and status.get("observedGeneration") == generation


def _with_refusal(status: dict[str, Any], message: str) -> dict[str, Any]:
    """``status`` (a copy) saying that the API server refused a child, in its words."""
    fresh = {**status, "conditions": [dict(c) for c in status.get("conditions", [])]}
    _set_refusal(fresh, message)
    fresh["message"] = f"the API server refused a child: {message}"
    return fresh


def _set_refusal(status: dict[str, Any], message: str | None) -> None:
    """The ReconcileError condition: True with the API server's words, or False once it passes."""
    conditions = status.setdefault("conditions", [])
    now = datetime.now(UTC)
    if message is None:
        if any(c["type"] == "ReconcileError" and c["status"] == "True" for c in conditions):
            set_condition(conditions, "ReconcileError", False, "Applied", "every child was accepted", now=now,
                          generation=status.get("observedGeneration"))  # fmt: skip
        return
    set_condition(conditions, "ReconcileError", True, "ChildRefused", message, now=now,
                  generation=status.get("observedGeneration"))  # fmt: skip


class Controller:
    """Reconciles RLJobs: shared by the kopf handlers and the work queue."""

    def __init__(self, kube: Kube, metrics: Metrics, limits: Limits | None = None) -> None:
        self.kube = kube
        self.metrics = metrics
        self.limits = limits or Limits()
        self.keys = KeySecrets(kube)  # the key Secrets: created once, someone else's refused
        self.queue = WorkQueue()
        self.known: set[Key] = set()
        self.refusals: dict[Key, int] = {}  # RLJobs whose children the API refuses: attempts in a row
        self.failures: dict[Key, int] = {}  # RLJobs whose passes fail otherwise: attempts in a row
        # The generation each RLJob had at its last pass: an event with another one is a spec
        # change, which ends any backoff at once.
        self.generations: dict[Key, int | None] = {}
        # Set when a background task (the work queue, the resync) died: the operator would go
        # silent, so liveness fails and the process stops (the Deployment restarts it).
        self.fatal: str | None = None
        self.on_fatal: Callable[[], None] = lambda: None
        # Threads for the passes, and for the requests each pass sends in parallel.
        self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="reconcile")
        self._io = ThreadPoolExecutor(WORKERS * len(CHILD_KINDS), thread_name_prefix="api")
        self.closed = False

    def close(self) -> None:
        """Let the threads go once the operator stops (a Controller serves one operator run)."""
        self.closed = True
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)

    def watch(self, task: asyncio.Task[None]) -> None:
        """Make the death of a background task fatal and visible instead of silent."""

        def done(t: asyncio.Task[None]) -> None:
            if t.cancelled():
                return
            error = t.exception()
            self.fatal = f"background task {t.get_name()} ended: {error!r}" if error else f"{t.get_name()} returned"
            log.critical("%s; the operator stops so that it is restarted", self.fatal, exc_info=error)
            self.on_fatal()

        task.add_done_callback(done)

    def event(self, key: Key, generation: int | None, deleted: bool = False) -> None:
        """An RLJob event: queue it; at once if its spec changed or it is gone, else after any
        backoff it is in (its own status writes must not turn the backoff into a hot loop)."""
        self.queue.add(key, urgent=deleted or generation != self.generations.get(key))

    async def worker(self, key: Key) -> None:
        started = time.monotonic()
        failed: str | None = None
        try:
            requeue = await asyncio.get_running_loop().run_in_executor(self._workers, self.reconcile_one, *key)
        except Conflict:
            requeue = 0.5  # someone changed the RLJob or a child meanwhile: read again
        except ApiException as exc:
            # The API server said no: one line, no traceback. A namespace being deleted takes
            # its RLJobs with it, so there is nothing to retry.
            if _terminating(exc):
                log.info("%s/%s: its namespace is being deleted; leaving it", *key)
                requeue = None
            else:
                failed = f"the API server answered {exc.status}: {_api_message(exc)}"
        except Exception as exc:  # one line per failure (the traceback at debug level); retried
            if self.closed:
                return  # the operator is stopping: a pass cut short by the closed threads is no failure
            failed = _describe_error(exc)
            log.debug("reconciling %s/%s failed", *key, exc_info=True)
        finally:
            self.metrics.reconcile.observe(time.monotonic() - started)
        if failed is not None:
            self.metrics.errors.inc()
            attempts = self.failures[key] = self.failures.get(key, 0) + 1
            delay = backoff_seconds(attempts, ERROR_BACKOFF_SECONDS, MAX_ERROR_BACKOFF_SECONDS)
            log.warning("reconciling %s/%s failed: %s; retrying in %.0f s", *key, failed, delay)
            self.queue.hold(key, delay)
            return
        self.failures.pop(key, None)
        if key in self.refusals and requeue is not None:
            self.queue.hold(key, requeue)  # the refusal's backoff
            return
        self.queue.release(key)
        if requeue is not None:
            self.queue.add(key, requeue)

    def reconcile_one(self, namespace: str, name: str) -> float | None:
        """One level-based pass over one RLJob; returns when to look again (seconds) or None."""
        key = (namespace, name)
        rljob = self.kube.get("RLJob", namespace, name)
        if rljob is None:
            self.known.discard(key)
            self.refusals.pop(key, None)
            self.generations.pop(key, None)
            self.metrics.observe(namespace, name, None, {})
            return None
        self.known.add(key)
        self.generations[key] = (rljob.get("metadata") or {}).get("generation")
        if still_invalid(rljob) and self._stays_invalid(rljob):
            return None
        if not rljob.get("status") or len(name) > MAX_LABEL_VALUE:
            # Never reconciled: the status is written before any child is made, so there are
            # none to list (5 requests saved per new RLJob; a wrong guess only costs idempotent
            # applies, and the status write queues a pass that lists them).
            children: dict[str, list[dict[str, Any]]] = {kind: [] for kind in CHILD_KINDS}
        else:
            lists = [self._io.submit(self.kube.children, kind, namespace, name) for kind in CHILD_KINDS]
            children = dict(zip(CHILD_KINDS, (f.result() for f in lists), strict=True))
        # Only what this RLJob controls (its uid in the controller ownerReference): the labels
        # listed by can be on anything, and nothing else may be deleted, updated or read as state.
        observed = owned(rljob, Observed(jobs=children["Job"], statefulsets=children["StatefulSet"],
                                         pods=children["Pod"], services=children["Service"],
                                         configmaps=children["ConfigMap"]))  # fmt: skip
        # The applied children as they are, to skip applying those that already match.
        live = {
            (o["kind"], o["metadata"]["name"]): o
            for kind in ("Job", "StatefulSet", "ConfigMap", "Service", "NetworkPolicy")
            for o in children[kind]
            if controlled_by(o, rljob["metadata"].get("uid"))
        }
        spec = rljob.get("spec") or {}
        if (spec.get("model") or {}).get("config") and spec.get("gpuMemoryGiB") is None:
            # The memory check's GPU size: the smallest labelled node the pods can land on.
            selector = (spec.get("scheduling") or {}).get("nodeSelector") or {}
            observed.node_gpu_mib = self.kube.node_gpu_mib(selector if isinstance(selector, dict) else {})
        decision = decide(rljob, observed, datetime.now(UTC), self.limits)
        if decision.delete_self:
            self.kube.delete("RLJob", namespace, name)
            return None
        # Status first: it records decisions such as a restart, so a pass that dies after
        # deleting the failed Job still has the restart counted. A Conflict here means the
        # RLJob changed meanwhile: nothing was done yet, and the next pass reads again.
        old = rljob.get("status") or {}
        computed = decision.status
        refused_before = refusal_message(old)
        if refused_before is not None:
            # Still refused until a pass gets every child accepted: the status keeps saying so
            # (a status cleared and set again on every pass flapped, and each write re-queued it).
            decision.status = _with_refusal(computed, refused_before)
        version = self._write_status(rljob, old, decision)
        try:
            self._carry_out(rljob, decision, live)
        except RefusedChild as refused:
            return self._refused(rljob, decision.status, refused, version)
        self.refusals.pop(key, None)
        if refused_before is not None:
            _set_refusal(computed, None)  # every child accepted: said once, in a second write
            self.kube.patch_status(namespace, name, merge_patch(decision.status, computed), version)
            decision.status = computed
        gpus = {c: a["gpus"] for c, a in decision.status.get("allocation", {}).items()}
        active = decision.status.get("phase") in ("Pending", "Running")
        self.metrics.observe(namespace, name, decision.status.get("phase"), gpus if active else {})
        return decision.requeue_after

    def _write_status(self, rljob: dict[str, Any], old: dict[str, Any], decision: Decision) -> str:
        """Patch the status if it changed and post the decision's events; the new resourceVersion."""
        meta = rljob["metadata"]
        version = str(meta["resourceVersion"])
        if _normalised(decision.status) == _normalised(old):
            return version
        version = self.kube.patch_status(meta["namespace"], meta["name"], merge_patch(old, decision.status), version)
        # A new RLJob posts 3 or 4 events at once: in parallel, one round trip.
        posted = [self._io.submit(self._event, rljob, *event) for event in decision.events]
        for done in posted:
            done.result()
        if decision.status.get("restarts", 0) > old.get("restarts", 0):
            self.metrics.restarts.labels(namespace=meta["namespace"]).inc()
        return version

    def _stays_invalid(self, rljob: dict[str, Any]) -> bool:
        """An RLJob already found invalid at this generation: decided again without listing its
        children (it has none left), the status patched only if it changed. False when it has
        become valid (the operator's limits changed): then a full pass follows."""
        decision = decide(rljob, Observed(), datetime.now(UTC), self.limits)
        if not still_invalid({**rljob, "status": decision.status}):
            return False
        self._write_status(rljob, rljob.get("status") or {}, decision)
        meta = rljob["metadata"]
        self.refusals.pop((meta["namespace"], meta["name"]), None)
        self.metrics.observe(meta["namespace"], meta["name"], decision.status.get("phase"), {})
        return True

    def _carry_out(
        self, rljob: dict[str, Any], decision: Decision, live: Mapping[tuple[str, str], dict[str, Any]]
    ) -> None:
        namespace = rljob["metadata"]["namespace"]

        def look(o: dict[str, Any]) -> dict[str, Any] | None:
            return live.get((o["kind"], o["metadata"]["name"]))

        def apply(o: dict[str, Any]) -> dict[str, Any]:
            return self.kube.apply(o, look(o))  # ownership re-checked when it is missing or replaced

        # The key Secret first: someone else's refuses the pass before anything would read it.
        for key in [o for o in decision.create_only if o["kind"] == "Secret"]:
            self._write(lambda o: self.keys.ensure(o, decision, lambda c: apply(stamped(c))), key)
        # The record of a restart or a finish first: written before the failed Job is deleted.
        for obj in (stamped(o) for o in decision.remember):
            if not unchanged(obj, look(obj)):
                self._write(apply, obj)
        for kind, child in decision.delete:  # only the object listed (its uid), never a successor
            self.kube.delete(kind, namespace, child, ((live.get((kind, child)) or {}).get("metadata") or {}).get("uid"))
        # A child that already is what the apply would make it costs no request (a steady
        # state sent one PATCH per child per pass before).
        applies = [stamped(o) for o in decision.apply]
        applies = [o for o in applies if not unchanged(o, look(o))]
        # The applies are independent of each other: in parallel (one round trip, not four). The
        # Jobs come after them, so their pods find the ConfigMap and Services in place.
        pending = [self._io.submit(self._write, apply, o) for o in applies]
        futures.wait(pending)
        for done in pending:
            done.result()  # the first refusal (or error), after every apply has ended
        for obj in (o for o in decision.create_only if o["kind"] != "Secret"):
            self._write(self.kube.create_if_missing, obj)

    @staticmethod
    def _write(write: Callable[[dict[str, Any]], object], obj: dict[str, Any]) -> None:
        try:
            write(obj)
        except NotOurs as taken:
            raise RefusedChild(taken.kind, taken.name, 0, str(taken)) from None
        except ApiException as exc:
            # 4xx on an object we render is the input's fault (or ours), never transient, and so
            # is a 500 from server-side apply (a toleration with an unknown field): retrying
            # every 5 s would loop for ever and say nothing. Both back off like a refusal.
            refused = 400 <= exc.status < 500 and exc.status not in (408, 429) and not _terminating(exc)
            if refused or exc.status == 500:
                raise RefusedChild(obj["kind"], obj["metadata"]["name"], exc.status, _api_message(exc)) from None
            raise

    def _refused(self, rljob: dict[str, Any], status: dict[str, Any], refused: RefusedChild, version: str) -> float:
        """Say on the RLJob what the API server refused (condition, one event per new message;
        nothing written when the status says so already) and look again later, backing off:
        other RLJobs keep being served meanwhile. ``status`` is what the pass wrote, at ``version``."""
        meta = rljob["metadata"]
        key = (meta["namespace"], meta["name"])
        attempts = self.refusals[key] = self.refusals.get(key, 0) + 1
        message = str(refused)
        fresh = _with_refusal(status, message)
        self.metrics.errors.inc()
        if _normalised(fresh) != _normalised(status):
            with contextlib.suppress(Conflict):  # the RLJob changed: the next pass reads it again
                self.kube.patch_status(*key, merge_patch(status, fresh), version)
        if refusal_message(rljob.get("status") or {}) != message:
            self._event(rljob, "Warning", "ChildRefused", message)
            log.warning("%s/%s: %s", *key, message)
        return backoff_seconds(attempts, REFUSAL_BACKOFF_SECONDS, MAX_REFUSAL_BACKOFF_SECONDS)

    def _event(self, rljob: dict[str, Any], kind: str, reason: str, message: str) -> None:
        try:
            self.kube.event(rljob, kind, reason, message)
        except ApiException as exc:  # events are best effort; never fail a reconcile for one
            if not _terminating(exc):
                log.warning("could not post event %s on %s: %s", reason, rljob["metadata"]["name"], _api_message(exc))


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def _describe_error(exc: BaseException) -> str:
    """One line for an error of a pass: its type and words, and where it was raised (no traceback)."""
    if isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
        return f"the API server cannot be reached: {type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _terminating(exc: ApiException) -> bool:
    return exc.status == 403 and "NamespaceTerminating" in str(exc.body)


def _normalised(value: Any) -> Any:
    """A status as the API server stores it: null members dropped (a merge patch removes them),
    so a status equal up to nulls is not patched again on every pass."""
    if isinstance(value, Mapping):
        return {k: _normalised(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalised(v) for v in value]
    return value


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that turns ``old`` into ``new`` (missing keys become null)."""
    patch: dict[str, Any] = dict(new)
    for key, value in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(value, dict) and isinstance(new[key], dict):
            patch[key] = merge_patch(value, new[key])
    return patch
