"""Shared by every test session: scratch files that libraries and subprocesses write to the
temp directory (torchrun's run directories, torch.multiprocessing error files, vLLM's dist
files) go to one directory of this session, removed when it ends, instead of piling up in /tmp
on the machine that runs CI."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_scratch_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    scratch = tmp_path_factory.mktemp("scratch")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(scratch)
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        tempfile.tempdir = None
        shutil.rmtree(scratch, ignore_errors=True)


# The suite never skips (a test that cannot run here fails with what to install): a skip from
# any test or module, an importorskip or a skip mark, is reported as a failure.
def _never_skipped(report: pytest.TestReport | pytest.CollectReport, where: str) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{where} was skipped ({reason}): tests never skip; run `make install` (or `make test`) for what it needs"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _never_skipped(outcome.get_result(), item.nodeid)  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _never_skipped(outcome.get_result(), collector.nodeid)  # type: ignore[attr-defined]
