"""Fixtures every unit test module may use (helpers/ holds the plain functions)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import TRAINER_ENV


@pytest.fixture
def trainer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads the environment: none of its variables may leak in from the caller's."""
    for name in TRAINER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines read no environment: variables the CLI would read must change nothing, and
    no ``WORLD_SIZE`` makes a test process look like a torchrun rank."""
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "5")
    monkeypatch.setenv("TREETRAIN_ATTENTION", "bogus")
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture(scope="module")
def megatron_one_process() -> Iterator[None]:
    """megatron-core needs a process group even for one process: a module that builds
    ``megatron:d1`` engines in the test process uses this fixture to leave none behind."""
    yield
    import torch.distributed as dist

    from treetrain.engines.megatron.parallel import reset_megatron

    reset_megatron()
    if dist.is_initialized():
        dist.destroy_process_group()
