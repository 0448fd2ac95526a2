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
