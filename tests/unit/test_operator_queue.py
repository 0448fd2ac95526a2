"""The operator's work queue and its background tasks: safe when events arrive from many
threads at once, and never silent when the reconcile loop dies."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

from rljob_operator.handlers import Controller, WorkQueue
from rljob_operator.metrics import Metrics


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
