"""The ``vllm`` fixture: ONE real vLLM server (tests/vllm/real_vllm.py) for the whole test session.

Its venv must be built first (`make vllm-venv`; `make test` does it). When it is missing the
fixture fails with that instruction: these tests never skip. The server runs in the session's
pytest temporary directory; its logs are kept there when a test failed (the path is printed at
the end), removed otherwise. Tests that kill or restart it leave it to :func:`vllm` to start it
again (same port) before the next test. Every test here is marked ``vllm``, and those that use
the server also ``slow``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from real_vllm import BUILD_HINT, ServerError, VLLMServer, venv_python
from real_vllm import request as http
from suite_helpers import free_port

KEPT_LOGS = pytest.StashKey[Path]()
STARTS = pytest.StashKey[list[float]]()
HEALTH_TIMEOUT_S = 900.0  # mostly imports: ~20 s warm, minutes on a cold, busy 2-core machine


def model_dir() -> Path:
    from treetrain.engines import builtin

    return Path(builtin.local_dir("builtin:smollm2-135m"))


def _up(server: VLLMServer, config: pytest.Config) -> None:
    server.start()
    try:
        config.stash.setdefault(STARTS, []).append(server.wait_healthy(HEALTH_TIMEOUT_S))
    except ServerError as err:
        config.stash[KEPT_LOGS] = server.workdir
        server.stop()
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    python = venv_python()
    if python is None:
        pytest.fail(f"the vLLM venv is not built: {BUILD_HINT}", pytrace=False)
    workdir = tmp_path_factory.mktemp("vllm")
    server = VLLMServer(python, model_dir(), workdir)
    _up(server, request.config)
    try:
        yield server
    finally:
        server.stop()
        if request.session.testsfailed:
            request.config.stash[KEPT_LOGS] = workdir
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def vllm(vllm_server: VLLMServer, request: pytest.FixtureRequest) -> VLLMServer:
    """The session's server, running (started again if a test before killed it), not paused,
    serving the model's own weights."""
    if vllm_server.proc is None or vllm_server.proc.poll() is not None:
        _up(vllm_server, request.config)
    assert http("POST", vllm_server.url + "/resume")[0] == 200
    # The model's own weights, broadcast as version 0 (they name no lm_head.weight: our extension
    # loads the tied lm_head too).
    from safetensors.torch import load_file

    from treetrain import config as C
    from treetrain.rl.rollout import VLLMRollout
    from treetrain.rl.weight_sync import WeightSender

    weights = {k: v for f in sorted(vllm_server.model.glob("*.safetensors")) for k, v in load_file(f).items()}
    client = VLLMRollout(endpoints=[vllm_server.url])
    settings = C.WeightSyncSettings(master_port=free_port(), backend="gloo", timeout_seconds=120)
    sender = WeightSender(client.sync_targets(), [C.RolloutServer(url=vllm_server.url, kind="vllm")], settings)
    try:
        sender.push(weights.items(), 0)
    finally:
        sender.close()
    client.leave_group(vllm_server.url, sender.request)
    return vllm_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if {"vllm", "vllm_server"} & set(getattr(item, "fixturenames", ())):
                item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    starts = config.stash.get(STARTS, None)
    if starts:
        took = ", ".join(f"{s:.1f}s" for s in starts)
        terminalreporter.write_line(f"vLLM server started {len(starts)} time(s), healthy after {took}")
    logs = config.stash.get(KEPT_LOGS, None)
    if logs is not None:
        terminalreporter.write_line(f"vLLM server logs kept in {logs}")
