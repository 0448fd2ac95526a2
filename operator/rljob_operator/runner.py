"""Run the operator: from ``rljob operator`` (a pod or a laptop) or inside a test process."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf
from prometheus_client import start_http_server

from rljob_operator.controller import Controller
from rljob_operator.handlers import build_registry
from rljob_operator.kube import Kube
from rljob_operator.kube_login import load_client
from rljob_operator.metrics import Metrics
from rljob_operator.policy import Limits
from rljob_operator.wire import tolerate_deep_objects_in_kopf


def make_controller(kubeconfig: str | None = None, limits: Limits | None = None) -> Controller:
    client, in_cluster = load_client(kubeconfig)
    metrics = Metrics()
    return Controller(Kube(client, in_cluster=in_cluster, on_request=metrics.api_request), metrics, limits)


async def serve(
    controller: Controller,
    *,
    namespaces: list[str],
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run kopf with this controller's handlers until ``stop_flag`` is set."""
    tolerate_deep_objects_in_kopf()  # an RLJob nested too deeply for Python's JSON reader cannot end the watch
    await kopf.operator(
        registry=build_registry(controller, namespaces),
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness_endpoint,
        standalone=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=kopf.Memo(),
    )


def run_operator(
    *, namespaces: list[str], metrics_port: int, liveness_port: int, bind: str, limits: Limits | None = None
) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handler call is noise
    controller = make_controller(limits=limits)
    if metrics_port:
        start_http_server(metrics_port, addr=bind, registry=controller.metrics.registry)
    liveness = f"http://{bind}:{liveness_port}/healthz" if liveness_port else None
    scope = ", ".join(namespaces) if namespaces else "all namespaces"
    logging.getLogger("rljob_operator").info("watching RLJobs in %s", scope)
    asyncio.run(_serve_until_fatal(controller, namespaces=namespaces, liveness_endpoint=liveness))
    return 1 if controller.fatal else 0


async def _serve_until_fatal(controller: Controller, *, namespaces: list[str], liveness_endpoint: str | None) -> None:
    # A dead reconcile loop stops the process, so the Deployment restarts it. An asyncio event
    # (not a threading one: kopf would wait for that in a thread that outlives the loop).
    stop = asyncio.Event()
    controller.on_fatal = stop.set
    asyncio.get_running_loop().set_exception_handler(_quiet_stream_close)
    await serve(controller, namespaces=namespaces, liveness_endpoint=liveness_endpoint, stop_flag=stop)


def _quiet_stream_close(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """kopf's watch streams are async generators. One that asyncio.run's final clean-up closes
    while its HTTP stream is still open fails with "generator didn't stop after athrow()" (seen
    on SIGTERM): the operator is stopping anyway, so one line, not a traceback in its log."""
    if "asyncgen" in context:
        logging.getLogger("rljob_operator").warning(
            "while stopping: %s (%r)", context.get("message"), context.get("exception")
        )
        return
    loop.default_exception_handler(context)
