"""A real Prometheus on loopback for the cluster tests (Debian's package, fetched by
tests/prometheus/build): the binary, the process with a given config, and its HTTP API."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import http_get, wait_for
from suite_helpers import free_port

BUILD = Path(__file__).resolve().parents[1] / "prometheus" / "build"


def prometheus_binary() -> Path:
    done = subprocess.run([str(BUILD), "--print"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(
            f"no Prometheus binary: run `make prometheus-bin` (or tests/prometheus/build) first ({done.stderr.strip()})",
            pytrace=False,
        )
    return Path(done.stdout.strip())


class Prometheus:
    """The HTTP API of a Prometheus on loopback."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:  # loopback only
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"GET /api/v1/{path} {params}: HTTP {err.code}: {err.read()[:500]!r}") from None
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def query_range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1"
        )["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def last_evaluation(self) -> float:
        """The oldest of the rule groups' last evaluation times (Unix seconds; 0 before the first)."""
        stamps = [g.get("lastEvaluation", "") for g in self.api("rules")["groups"]]
        return min((_unix(s) for s in stamps), default=0.0)


def _unix(stamp: str) -> float:
    """An RFC 3339 time as Prometheus writes it (nanoseconds; Z or an offset) in Unix seconds; 0 for none."""
    if not stamp or stamp.startswith("0001-"):
        return 0.0
    # fromisoformat reads at most microseconds.
    stamp = re.sub(r"(\.\d{6})\d+", r"\1", stamp).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


@contextlib.contextmanager
def prometheus_process(binary: Path, workdir: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    port = free_port()
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (workdir / "prometheus.log").open("w")
    argv = [str(binary), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(
            "Prometheus ready",
            lambda: http_get(f"http://127.0.0.1:{port}/-/ready")[0] == 200 or proc.poll() is not None,
        )
        assert proc.poll() is None, f"Prometheus exited:\n{tail(workdir / 'prometheus.log')}"
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(workdir / "data", ignore_errors=True)  # its log stays, for a failed test


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
