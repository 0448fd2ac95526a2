"""The weight gate: the version the servers serve, closed around each update, failed by a failed one."""

from __future__ import annotations

import threading

import pytest

from treetrain.rl.rollout import RolloutError, WeightGate


def test_a_new_gate_is_open_on_the_initial_weights() -> None:
    gate = WeightGate()
    assert gate.is_open and gate.version == 0 and gate.wait_open(0.0) == 0
    assert not gate.changed_since(0) and gate.changed_since(1)


def test_an_update_closes_the_gate_and_opens_it_on_the_new_version() -> None:
    gate = WeightGate()
    inside = threading.Event()
    release = threading.Event()
    seen: list[int] = []

    def update() -> None:
        with gate.update(1):
            inside.set()
            assert release.wait(30)

    updater = threading.Thread(target=update)
    updater.start()
    assert inside.wait(30)
    assert not gate.is_open and gate.version == 0 and gate.changed_since(0)
    waiter = threading.Thread(target=lambda: seen.append(gate.wait_open(30)))
    waiter.start()
    release.set()
    updater.join(30)
    waiter.join(30)
    assert seen == [1]  # the waiter returned only once the update was done: it saw the new version
    assert gate.is_open and gate.version == 1 and not gate.changed_since(1)


def test_a_failed_update_keeps_the_gate_closed_and_the_version_where_it_was() -> None:
    gate = WeightGate(version=3)
    with pytest.raises(OSError, match="server gone"), gate.update(4):
        raise OSError("server gone")
    assert not gate.is_open and gate.version == 3
    with pytest.raises(RolloutError, match=r"update to version 4 failed.*weights are unknown: server gone"):
        gate.wait_open(30)  # fails at once: nothing to wait for
    with gate.update(4):  # a later update that succeeds opens it again
        pass
    assert gate.is_open and gate.wait_open(0) == 4


def test_a_failure_wakes_every_waiter() -> None:
    gate = WeightGate()
    errors: list[str] = []

    def wait() -> None:
        try:
            gate.wait_open(30)
        except RolloutError as err:
            errors.append(str(err))

    with pytest.raises(RuntimeError), gate.update(1):
        waiters = [threading.Thread(target=wait) for _ in range(4)]
        for t in waiters:
            t.start()
        raise RuntimeError("push failed")
    for t in waiters:
        t.join(30)
    assert len(errors) == 4 and all("push failed" in e for e in errors)


def test_a_wait_is_bounded() -> None:
    gate = WeightGate()
    with gate.update(1), pytest.raises(RolloutError, match=r"version 1 did not finish within 0s.*timeoutSeconds"):
        gate.wait_open(0.0)


def test_set_version_moves_the_label_without_closing() -> None:
    gate = WeightGate()
    gate.set_version(5)
    assert gate.is_open and gate.wait_open(0) == 5
