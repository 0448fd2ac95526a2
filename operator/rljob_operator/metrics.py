"""Operator metrics (prefix ``rljob_``), on their own registry and port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from treetrain import __version__

PHASES = ("Pending", "Running", "Succeeded", "Failed", "Suspended")
# Fine enough below 1 s that a p50 or p99 read from the buckets is close to the truth (the bench
# reads them from /metrics; with the old 0.25, 0.5, 1 s steps a p99 could be anywhere in between).
RECONCILE_BUCKETS = (
    0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25,
    0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("rljob_jobs", "RLJobs by phase.", ["phase"], registry=r)
        self.gpus = Gauge(
            "rljob_gpus_requested",
            "GPUs requested, by RLJob and component.",
            ["namespace", "rljob", "component"],
            registry=r,
        )
        self.reconcile = Histogram(
            "rljob_reconcile_duration_seconds",
            "Time to reconcile one RLJob.",
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.api_requests = Counter(
            "rljob_operator_api_requests",
            "Requests the reconciler sent to the API server (kopf's watches not counted), by verb, "
            "resource and HTTP status code.",
            ["verb", "resource", "code"],
            registry=r,
        )
        self.errors = Counter("rljob_reconcile_errors", "Reconciles that raised an error.", registry=r)
        self.restarts = Counter("rljob_trainer_restarts", "Trainer gang restarts.", ["namespace"], registry=r)
        self.info = Gauge("rljob_build_info", "Operator build information.", ["version"], registry=r)
        self.info.labels(version=__version__).set(1)
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)
        self._phases: dict[tuple[str, str], str] = {}
        self._components: dict[tuple[str, str], set[str]] = {}

    def api_request(self, verb: str, resource: str, code: int) -> None:
        """Count one request of the reconciler (the callback :class:`~rljob_operator.kube.Kube` calls)."""
        self.api_requests.labels(verb=verb, resource=resource, code=str(code)).inc()

    def observe(self, namespace: str, name: str, phase: str | None, gpus: dict[str, int]) -> None:
        """Record one RLJob's phase and GPUs; ``phase=None`` forgets a deleted RLJob."""
        key = (namespace, name)
        self.restarts.labels(namespace=namespace)  # exists at 0 from the start, so increase() sees restart 1
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for phase_name in PHASES:
            self.jobs.labels(phase=phase_name).set(sum(1 for p in self._phases.values() if p == phase_name))
        for component in self._components.pop(key, set()) - set(gpus):
            self.gpus.remove(namespace, name, component)
        for component, count in gpus.items():
            self.gpus.labels(namespace=namespace, rljob=name, component=component).set(count)
        if gpus:
            self._components[key] = set(gpus)
