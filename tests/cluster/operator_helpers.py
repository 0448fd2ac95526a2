"""The operator as a child process on the test cluster: `rljob operator --namespace NS` under a
ServiceAccount bound to exactly its RBAC rules (:class:`OperatorProcess` and the module-scoped
``kubeconfig`` / per-test ``operator`` fixtures a test module imports), or with the Helm chart's
container arguments (:func:`operator_process`), and helm itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Cluster, http_get, operator_account, wait_for
from rljob_helpers import ROOT
from suite_helpers import free_port

from rljob_operator.models import GROUP, PLURAL
from rljob_operator.rbac import RULES

FATAL = ("the operator stops so that it is restarted", "Traceback")


@pytest.fixture(scope="module")
def kubeconfig(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A kubeconfig with the token of a ServiceAccount bound to the operator's rules only."""
    cluster.run("kubectl", "apply", "--server-side", "-f", str(ROOT / "crds" / "rljob.yaml"))
    cluster.run("kubectl", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
    path = tmp_path_factory.mktemp("faults") / "kubeconfig"
    with operator_account(cluster.api, cluster.kubeconfig, "rljob-faults", RULES, path):
        yield path


class OperatorProcess:
    """`rljob operator` for one namespace, in a child process whose output goes to a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path) -> None:
        self.kubeconfig, self.namespace, self.log = kubeconfig, namespace, log
        self.liveness = free_port()
        self.metrics = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        rljob_bin = str(Path(sys.executable).parent / "rljob")
        args = [rljob_bin, "operator", "--namespace", self.namespace, "--bind", "127.0.0.1",
                "--metrics-port", str(self.metrics), "--liveness-port", str(self.liveness)]  # fmt: skip
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for("operator /healthz 200", lambda: self.healthy() or self._exited(), timeout=90)
        assert self.healthy(), self.output()[-3000:]

    def healthy(self) -> bool:
        return http_get(f"http://127.0.0.1:{self.liveness}/healthz")[0] == 200

    def requests(self) -> dict[tuple[str, str, str], float]:
        """The operator's own API requests so far, (verb, resource, code) -> count, from its /metrics."""
        status, text = http_get(f"http://127.0.0.1:{self.metrics}/metrics")
        assert status == 200, self.output()[-3000:]
        counts: dict[tuple[str, str, str], float] = {}
        for line in text.splitlines():
            if line.startswith("rljob_operator_api_requests_total{"):
                labels, value = line[len("rljob_operator_api_requests_total{") :].rsplit("} ", 1)
                parts = {k: v.strip('"') for k, v in (part.split("=", 1) for part in labels.split(","))}
                counts[parts["verb"], parts["resource"], parts["code"]] = float(value)
        return counts

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def assert_alive_and_quiet(self) -> None:
        """Still running, /healthz answers 200, and no fatal line in its log."""
        assert self.proc is not None and self.proc.poll() is None, self.output()[-3000:]
        assert self.healthy()
        text = self.output()
        assert not [f for f in FATAL if f in text], text[-3000:]


@pytest.fixture
def operator(kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


def helm(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = cluster.run("helm", *args, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done


def deployment_of(manifest: str) -> dict[str, Any]:
    (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment"]
    return deployment


@contextmanager
def operator_process(kubeconfig: Path, chart_args: list[str]) -> Iterator[tuple[int, int]]:
    """`rljob` with the chart's container arguments; its ports moved to free loopback ports."""
    metrics, liveness = free_port(), free_port()
    args = [a for a in chart_args if not a.startswith(("--metrics-port=", "--liveness-port="))]
    assert len(args) == len(chart_args) - 2, chart_args
    argv = [str(Path(sys.executable).parent / "rljob"), *args, "--bind", "127.0.0.1",
            f"--metrics-port={metrics}", f"--liveness-port={liveness}"]  # fmt: skip
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = ""
    try:
        wait_for("operator /healthz", lambda: http_get(f"http://127.0.0.1:{liveness}/healthz")[0] == 200 or proc.poll())
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        yield metrics, liveness
    finally:
        proc.terminate()
        output = proc.communicate(timeout=60)[0]
    assert "Forbidden" not in output and "Traceback" not in output, output[-3000:]
