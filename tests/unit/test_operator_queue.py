"""The operator's work queue and its background tasks: safe when events arrive from many
threads at once, and never silent when the reconcile loop dies."""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from rljob_operator.controller import Controller
from rljob_operator.metrics import Metrics
from rljob_operator.workqueue import WorkQueue

ROOT = Path(__file__).resolve().parents[2]


def test_adds_from_many_threads_while_the_queue_runs() -> None:
    # What kopf's executor threads did to the old queue: mutate its due map while the loop
    # iterated it ("dictionary changed size during iteration", then silence).
    queue = WorkQueue()
    seen: set[tuple[str, str]] = set()
    threads, per_thread, keys = 8, 3000, 1500
    # Thread switches as often as the interpreter allows, so a race shows up in one run.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    async def main() -> None:
        async def worker(key: tuple[str, str]) -> None:
            seen.add(key)
            await asyncio.sleep(0)

        runner = asyncio.create_task(queue.run(worker, concurrency=4))
        await asyncio.sleep(0)  # the queue starts running

        def burst(t: int) -> None:
            for i in range(per_thread):
                # Most keys wait a little: the due map stays large while the loop scans it.
                queue.add((f"ns{t}", f"job{i % keys}"), delay=0.2 if i % 5 else 0.0)

        workers = [threading.Thread(target=burst, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        await asyncio.to_thread(lambda: [w.join() for w in workers])
        deadline = asyncio.get_running_loop().time() + 120  # generous: a busy 2-core machine
        while len(seen) < threads * keys and asyncio.get_running_loop().time() < deadline and not runner.done():
            await asyncio.sleep(0.01)
        assert not runner.done(), runner.exception() if runner.done() else None
        runner.cancel()

    try:
        asyncio.run(main())
    finally:
        sys.setswitchinterval(switch)
    assert seen == {(f"ns{t}", f"job{i}") for t in range(threads) for i in range(keys)}


def test_a_dead_background_task_is_fatal_and_visible(caplog: Any) -> None:
    controller = Controller(kube=None, metrics=Metrics())  # type: ignore[arg-type]  # no API calls here
    stopped = threading.Event()
    controller.on_fatal = stopped.set

    async def dies() -> None:
        raise RuntimeError("dictionary changed size during iteration")

    async def main() -> None:
        task = asyncio.create_task(dies(), name="work queue")
        controller.watch(task)
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn

    asyncio.run(main())
    assert stopped.is_set()
    assert controller.fatal is not None and "work queue" in controller.fatal
    assert any(r.levelname == "CRITICAL" and "operator stops" in r.getMessage() for r in caplog.records)


def test_a_cancelled_task_is_a_normal_stop() -> None:
    controller = Controller(kube=None, metrics=Metrics())  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.create_task(asyncio.sleep(60), name="resync")
        controller.watch(task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert controller.fatal is None


class _FakeKube:
    """Stands in for the API layer (no API server here): one RLJob, apply refused on demand."""

    def __init__(self, rljob: dict[str, Any]) -> None:
        self.rljob = rljob
        self.refuse: int | None = 400
        self.events: list[tuple[str, str, str]] = []
        self.applied: list[str] = []
        self.patches = 0

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.rljob)

    def children(self, kind: str, namespace: str, rljob: str) -> list[dict[str, Any]]:
        return []

    def patch_status(self, namespace: str, name: str, patch: dict[str, Any], resource_version: str) -> str:
        self.patches += 1
        status = self.rljob.setdefault("status", {})
        for key, value in patch.items():
            if value is None:
                status.pop(key, None)
            else:
                status[key] = value
        return "2"

    def apply(self, obj: dict[str, Any], live: dict[str, Any] | None = None) -> None:
        if self.refuse is not None:
            body = json.dumps({"message": f'{obj["kind"]} "{obj["metadata"]["name"]}" is invalid: data: bad bytes'})
            raise ApiException(status=self.refuse, reason="Bad Request", body=body)
        self.applied.append(obj["metadata"]["name"])

    def create_if_missing(self, obj: dict[str, Any]) -> bool:
        return True

    def create_key(self, obj: dict[str, Any]) -> bool:
        return True

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        pass

    def event(self, rljob: dict[str, Any], kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def _refusal(rljob: dict[str, Any]) -> dict[str, Any]:
    (refused,) = [c for c in rljob["status"]["conditions"] if c["type"] == "ReconcileError"]
    return refused


def test_a_child_the_api_server_refuses_is_said_on_the_rljob_with_backoff() -> None:
    # A 4xx on a child we render is never transient: it used to be retried every 5 s for ever
    # with nothing on the RLJob. Now: a condition with the server's words, one event, backoff.
    rljob = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    rljob["metadata"] = {"name": "demo", "namespace": "ml", "uid": "u", "generation": 1, "resourceVersion": "1"}
    kube = _FakeKube(rljob)
    controller = Controller(kube=kube, metrics=Metrics())  # type: ignore[arg-type]
    delays = [controller.reconcile_one("ml", "demo")]
    written, stamp = kube.patches, _refusal(kube.rljob)["lastTransitionTime"]
    delays += [controller.reconcile_one("ml", "demo") for _ in range(2)]
    assert delays == [5.0, 10.0, 20.0]
    # Passes that are refused the same way write nothing (each write was a watch event that
    # queued the next pass at once), and the condition does not flap.
    assert kube.patches == written and _refusal(kube.rljob)["lastTransitionTime"] == stamp
    (refused,) = [c for c in kube.rljob["status"]["conditions"] if c["type"] == "ReconcileError"]
    assert refused["status"] == "True" and refused["reason"] == "ChildRefused"
    assert "HTTP 400" in refused["message"] and "bad bytes" in refused["message"]
    assert [e[1] for e in kube.events].count("ChildRefused") == 1  # one event per new message, not per pass
    kube.refuse = None  # the user fixed the spec
    controller.reconcile_one("ml", "demo")
    (cleared,) = [c for c in kube.rljob["status"]["conditions"] if c["type"] == "ReconcileError"]
    assert cleared["status"] == "False" and kube.applied and ("ml", "demo") not in controller.refusals


def test_a_watch_stream_closed_at_shutdown_is_one_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio.run closing kopf's watch generator on SIGTERM: one warning; anything else still
    reaches asyncio's default handler."""
    from rljob_operator.runner import _quiet_stream_close

    async def stream() -> Any:
        yield 1

    loop = asyncio.new_event_loop()
    seen: list[dict[str, Any]] = []
    loop.default_exception_handler = seen.append  # type: ignore[method-assign]  # record, do not print
    try:
        error = RuntimeError("generator didn't stop after athrow()")
        with caplog.at_level("WARNING", logger="rljob_operator"):
            _quiet_stream_close(loop, {"message": "an error occurred during closing of asynchronous generator",
                                       "exception": error, "asyncgen": stream()})  # fmt: skip
        assert [r.getMessage() for r in caplog.records] == [
            "while stopping: an error occurred during closing of asynchronous generator "
            '(RuntimeError("generator didn\'t stop after athrow()"))'
        ]
        assert not any(r.exc_info for r in caplog.records) and seen == []
        other = {"message": "Task exception was never retrieved", "exception": ValueError("x")}
        _quiet_stream_close(loop, other)
        assert seen == [other]
    finally:
        loop.close()
