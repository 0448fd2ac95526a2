"""The `cluster` fixture: one real control plane (tests/cluster/up) for the whole test session.

The binaries must be built first (`make cluster-bin`; `make test` does it). When they are missing
the fixture fails with that instruction: cluster tests never skip. The cluster runs in the
session's pytest temporary directory; its logs are kept there when a test failed, and removed
otherwise. Nothing is left running when pytest ends: the fixture runs `down` at teardown (also
after Ctrl-C), and `up --owner-pid` starts a watchdog that stops the cluster if pytest is killed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Cluster lives in cluster_helpers: a test module importing `conftest` at run time could get
# another directory's conftest (tests/vllm's), whichever pytest loaded last.
from cluster_helpers import Cluster, scratch_namespace
from kubernetes import config

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launcher.py"
KEPT_LOGS = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    built = subprocess.run([str(HERE / "build"), "--print"], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail(
            "the test control plane is not built: run `make cluster-bin` (or tests/cluster/build) "
            "first; a cold build takes 10-15 minutes on 2 cores",
            pytrace=False,
        )
    state = tmp_path_factory.mktemp("cluster")
    up = subprocess.run(
        [sys.executable, str(LAUNCHER), "up", "--dir", str(state), "--no-build", "--owner-pid", str(os.getpid())],
        capture_output=True,
        text=True,
    )
    if up.returncode != 0:
        request.config.stash[KEPT_LOGS] = state / "logs"
        pytest.fail(f"tests/cluster/up failed:\n{up.stderr}", pytrace=False)
    exports = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in up.stdout.splitlines())
    kubeconfig = Path(exports["KUBECONFIG"])
    bin_dir = Path(built.stdout.strip())
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield Cluster(dir=state, kubeconfig=kubeconfig, bin=bin_dir, env=env, api=api)
    finally:
        api.close()
        subprocess.run(
            [sys.executable, str(LAUNCHER), "down", "--dir", str(state), "--keep-logs"],
            capture_output=True,
            text=True,
        )
        if request.session.testsfailed:
            request.config.stash[KEPT_LOGS] = state / "logs"
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting)."""
    with scratch_namespace(cluster.api, "t") as name:
        yield name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the cluster is marked `cluster`, also without an explicit mark."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    logs = config.stash.get(KEPT_LOGS, None)
    if logs is not None:
        terminalreporter.write_line(f"test cluster logs kept in {logs}")
