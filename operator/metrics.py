"""Operator metrics (prefix ``rljob_``), on their own registry and port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from treetrain import __version__

PHASES = ("Pending", "Running", "Succeeded", "Failed", "Suspended")


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
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
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
