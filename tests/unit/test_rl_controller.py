"""The group scheduler with rollout threads (maxStaleness >= 1): admission by weight version, the
buffer bound, take() order, dropped groups replaced, a hung task call named, and (a property test
over random producer and consumer timings) no trained sample staler than the bound and no group
lost or repeated across a stop, a JSON save and a resume.

Fakes wait on events (or for at most a few milliseconds), never on wall-clock sleeps."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.rl import scheduler as C
from treetrain.rl.episodes import GroupCall
from treetrain.rl.limits import EpisodeTimeoutError, TaskClock
from treetrain.rl.rollout import RolloutError
from treetrain.rl.samples import Rollouts, Sample, rollouts_json

DEADLINE_S = 60.0  # waits are for conditions; this is only how long a broken controller may take to fail


def group(step: int, g: int, version: int, size: int = 2) -> Rollouts:
    """A group's rollouts that name it: every sample's tokens are (step, g, episode)."""
    samples = [Sample(episode=i, tokens=[step, g, i], prompt_len=1, logprobs=[0.0, -0.5, -0.5], version=version)
               for i in range(size)]  # fmt: skip
    return Rollouts(samples=samples, rewards=[float(g), float(g) + 1.0][:size], groups=[g] * size)


class Gated:
    """A play function whose groups wait for the test to release them."""

    def __init__(self, served: Callable[[], int]) -> None:
        self.served = served
        self.cond = threading.Condition()
        self.started: list[tuple[int, int]] = []
        self.released: set[tuple[int, int]] = set()
        self.fail: set[tuple[int, int]] = set()

    def play(self, call: GroupCall, clock: TaskClock) -> Rollouts:
        step, (g,) = call.step, call.groups
        version = self.served()
        with self.cond:
            self.started.append((step, g))
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: (step, g) in self.released, DEADLINE_S)
        if (step, g) in self.fail:
            raise RolloutError(f"every server failed for group {g}")
        return group(step, g, version)

    def release(self, *keys: tuple[int, int]) -> None:
        with self.cond:
            self.released.update(keys)
            self.cond.notify_all()

    def wait_started(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, DEADLINE_S), self.started

    def until(self, done: Callable[[], bool]) -> bool:
        """Wait for ``done``, which the controller makes true after a play returns, so nothing
        notifies this condition then: look again every few milliseconds, up to the deadline."""
        end = time.monotonic() + DEADLINE_S
        with self.cond:
            while not done():
                if time.monotonic() >= end:
                    return False
                self.cond.wait(0.005)
        return True

    def starts_nothing_more(self, n: int) -> bool:
        """No group beyond the first ``n`` starts within a few milliseconds."""
        with self.cond:
            return not self.cond.wait_for(lambda: len(self.started) > n, 0.05)


PlayGroup = Callable[[int, int, TaskClock], Rollouts]


class Played:
    """An episode source from a function of (step, group, clock): one group per call."""

    def __init__(self, play: PlayGroup) -> None:
        self.fn = play

    def play(self, call: GroupCall, clock: TaskClock) -> Rollouts:
        (g,) = call.groups
        return self.fn(call.step, g, clock)


def controller(play: Any, **kw: Any) -> C.GroupScheduler:
    version = kw.pop("version", 0)
    args: dict[str, Any] = {
        "task": "builtin:parity",
        "episode_timeout_s": 300.0,
        "groups_per_step": 2,
        "max_staleness": 1,
        "steps": 6,
        "version": version if callable(version) else (lambda: version),
    }
    source = play if isinstance(play, Gated) else Played(play)
    return C.GroupScheduler(source, **{**args, **kw})


@pytest.fixture
def made() -> Iterator[list[C.GroupScheduler]]:
    found: list[C.GroupScheduler] = []
    yield found
    for c in found:
        c.stop(timeout_s=0)


def test_groups_start_only_within_the_bound_and_the_buffer_holds_at_most_n_plus_one_steps(
    made: list[C.GroupScheduler],
) -> None:
    version = [0]
    play = Gated(lambda: version[0])
    c = controller(play, max_staleness=1, version=lambda: version[0])
    made.append(c)
    play.wait_started(4)  # steps 0 and 1 (version 0 >= s - 1), 2 groups each
    assert sorted(play.started) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert play.starts_nothing_more(4) and c.in_flight() == 4 == c.capacity
    play.release((0, 0), (0, 1))
    rollouts = c.take(0, timeout_s=DEADLINE_S)
    assert rollouts.groups == [0, 0, 1, 1]
    # Room for two groups, but step 2 needs version >= 1: admission waits for the sync.
    assert play.starts_nothing_more(4)
    version[0] = 1
    c.version_changed()
    play.wait_started(6)
    assert sorted(play.started[4:]) == [(2, 0), (2, 1)]
    play.release((1, 0), (1, 1), (2, 0), (2, 1))
    assert [s.version for s in c.take(1, timeout_s=DEADLINE_S).samples] == [0] * 4
    assert {s.version for s in c.take(2, timeout_s=DEADLINE_S).samples} == {1}


def test_take_returns_a_step_in_group_order_and_steps_in_order(made: list[C.GroupScheduler]) -> None:
    play = Gated(lambda: 0)
    c = controller(play, groups_per_step=3, max_staleness=1)
    made.append(c)
    play.wait_started(6)
    with pytest.raises(ValueError, match="the next step to train is 0"):
        c.take(1)
    play.release((0, 2))
    play.release((0, 1))
    with pytest.raises(RolloutError, match="step 1 has 2 of 3 groups"):
        c.take(0, timeout_s=0.01)
    play.release((0, 0))
    r = c.take(0, timeout_s=DEADLINE_S)
    assert r.groups == [0, 0, 1, 1, 2, 2] and [s.tokens[1] for s in r.samples] == [0, 0, 1, 1, 2, 2]
    assert [s.episode for s in r.samples] == list(range(6))  # renumbered across groups


def test_a_failed_group_is_dropped_counted_and_replaced(made: list[C.GroupScheduler]) -> None:
    play = Gated(lambda: 0)
    play.fail.add((0, 1))
    c = controller(play, steps=1)
    made.append(c)
    play.release((0, 0), (0, 1), (0, 2))
    r = c.take(0, timeout_s=DEADLINE_S)
    assert r.groups == [0, 0, 2, 2] and c.dropped == {"filtered": 0, "failed": 1}


def test_a_filtered_group_is_dropped_counted_and_replaced(made: list[C.GroupScheduler]) -> None:
    play = Gated(lambda: 0)
    c = controller(play, steps=1, keep=lambda r: r.groups[0] != 0)
    made.append(c)
    play.release((0, 0), (0, 1), (0, 2))
    assert c.take(0, timeout_s=DEADLINE_S).groups == [1, 1, 2, 2]
    assert c.dropped == {"filtered": 1, "failed": 0}


def test_a_step_with_no_informative_group_trains_its_first_groups(made: list[C.GroupScheduler]) -> None:
    """As the synchronous loop does: all groups filtered up to the cap, the first ones are trained."""
    c = controller(lambda step, g, clock: group(step, g, 0), steps=1, keep=lambda r: False)
    made.append(c)
    assert c.take(0, timeout_s=DEADLINE_S).groups == [0, 0, 1, 1]
    assert c.dropped == {"filtered": 10, "failed": 0}


def test_a_step_whose_groups_all_fail_says_so_instead_of_hanging(made: list[C.GroupScheduler]) -> None:
    def play(step: int, g: int, clock: TaskClock) -> Rollouts:
        raise RolloutError("connection refused")

    c = controller(play, steps=1)
    made.append(c)
    with pytest.raises(
        RolloutError, match=r"step 1 has no group to train: all 10 tried were dropped \(10 failed"
    ) as err:
        c.take(0, timeout_s=DEADLINE_S)
    assert "the last failure: connection refused" in str(err.value)  # the cause, not only the count


def test_a_hung_task_call_fails_take_naming_the_task(
    made: list[C.GroupScheduler], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(C, "WATCH_MARGIN_S", 0.0)
    unblock = threading.Event()

    def play(step: int, g: int, clock: TaskClock) -> Rollouts:
        clock.run(f"respond() of episode {g}", 0.0, unblock.wait, DEADLINE_S)
        return group(step, g, 0)

    c = controller(play, steps=1, episode_timeout_s=0.01, task="acme.tasks:slow")
    made.append(c)
    try:
        with pytest.raises(
            EpisodeTimeoutError, match=r"task acme.tasks:slow: respond\(\) of episode \d did not return"
        ):
            c.take(0, timeout_s=DEADLINE_S)
    finally:
        unblock.set()


def test_an_error_of_the_task_reaches_the_trainer(made: list[C.GroupScheduler]) -> None:
    def play(step: int, g: int, clock: TaskClock) -> Rollouts:
        raise KeyError("the task broke")

    c = controller(play)
    made.append(c)
    with pytest.raises(KeyError, match="the task broke"):
        c.take(0, timeout_s=DEADLINE_S)


def test_after_halt_only_the_step_being_waited_for_starts_groups(made: list[C.GroupScheduler]) -> None:
    """SIGTERM: the step in progress still gets its groups; no later step starts one."""
    play = Gated(lambda: 0)
    c = controller(play, groups_per_step=1, max_staleness=2, steps=6)
    made.append(c)
    play.wait_started(3)  # steps 0, 1, 2
    play.release((0, 0), (1, 0), (2, 0), (3, 0))
    c.take(0, timeout_s=DEADLINE_S)
    c.halt()
    c.version = lambda: 1
    c.version_changed()  # step 3 is admissible now, but halted
    assert play.starts_nothing_more(3)
    assert c.take(1, timeout_s=DEADLINE_S).groups == [0, 0]


def test_the_state_round_trips_through_json_and_resumes_the_buffer(made: list[C.GroupScheduler]) -> None:
    play = Gated(lambda: 0)
    c = controller(play, steps=3)
    made.append(c)
    play.release((0, 0), (0, 1), (1, 1))
    c.take(0, timeout_s=DEADLINE_S)
    assert play.until(lambda: c.buffered() == 1)  # (1, 1) is finished; (1, 0) still plays
    c.stop(timeout_s=0)
    state = json.loads(json.dumps(c.state()))
    assert state["next_step"] == 1 and state["steps"]["1"]["todo"] == [0] and list(state["steps"]["1"]["done"]) == ["1"]
    again = Gated(lambda: 1)
    d = controller(again, steps=3, start_step=1, version=1, state=state)
    made.append(d)
    again.release((1, 0), (2, 0), (2, 1))
    r = d.take(1, timeout_s=DEADLINE_S)
    assert [s.tokens for s in r.samples] == [[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
    assert [s.version for s in r.samples] == [1, 1, 0, 0]  # the buffered group kept its version
    assert (1, 1) not in again.started  # finished before the stop: not played again
    play.release(*[(s, g) for s in range(3) for g in range(2)])


def test_a_resume_with_a_smaller_bound_plays_again_what_it_would_not_admit(made: list[C.GroupScheduler]) -> None:
    state = {
        "version": C.STATE_VERSION,
        "next_step": 3,
        "steps": {"3": {"todo": [], "next_id": 2, "done": {"0": _json(group(3, 0, 1)), "1": _json(group(3, 1, 2))}}},
    }
    play = Gated(lambda: 3)
    c = controller(play, steps=4, start_step=3, version=3, state=state, max_staleness=1)
    made.append(c)
    play.wait_started(1)
    assert play.started == [(3, 0)]  # sampled at version 1: 2 steps stale, over the new bound of 1
    play.release((3, 0))
    assert [s.version for s in c.take(3, timeout_s=DEADLINE_S).samples] == [3, 3, 2, 2]


def _json(r: Rollouts) -> dict[str, Any]:
    return json.loads(json.dumps(rollouts_json(r)))


# -- the property test ---------------------------------------------------------------------


def filtered(step: int, g: int) -> bool:
    """Which groups dynamic sampling drops: fixed per group, so the trained ids are known."""
    return random.Random(step * 1000 + g).random() < 0.25


def expected_ids(step: int, per_step: int) -> list[int]:
    """The first ``per_step`` groups not filtered: the ids a step must train, whatever the timing."""
    return [g for g in range(10 * per_step) if not filtered(step, g)][:per_step]


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    bound=st.integers(1, 3),
    per_step=st.integers(1, 3),
    steps=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    stop_at=st.integers(0, 6),
)
def test_no_sample_is_staler_than_the_bound_and_no_group_is_lost_or_repeated_across_a_resume(
    bound: int, per_step: int, steps: int, seed: int, stop_at: int
) -> None:
    rng = random.Random(seed)
    lock = threading.Lock()
    served = [0]  # the weight version the fake servers hold
    delays = [rng.random() * 0.003 for _ in range(256)]  # a few ms at most: waits on an event that never fires
    never = threading.Event()
    peak = [0]
    current: list[C.GroupScheduler] = []

    def play(step: int, g: int, clock: TaskClock) -> Rollouts:
        with lock:
            version = served[0]
            pause = delays[(step * 31 + g * 7 + version) % len(delays)]
        never.wait(pause)
        if current:
            peak[0] = max(peak[0], current[-1].in_flight())
        return group(step, g, version)

    def make(start: int, state: dict[str, Any] | None) -> C.GroupScheduler:
        c = C.GroupScheduler(
            Played(play),
            task="builtin:parity",
            episode_timeout_s=300.0,
            groups_per_step=per_step,
            max_staleness=bound,
            steps=steps,
            start_step=start,
            version=lambda: served[0],
            keep=lambda r: not filtered(r.samples[0].tokens[0], r.groups[0]),
            state=state,
        )
        current.append(c)
        return c

    trained: dict[int, list[int]] = {}
    c = make(0, None)
    stop = min(stop_at, steps - 1)
    try:
        for k in range(steps):
            if k == stop and k > 0:  # SIGTERM after step k - 1: stop, save, resume from k
                c.stop(timeout_s=DEADLINE_S)
                state = json.loads(json.dumps(c.state()))
                c = make(k, state)
            r = c.take(k, timeout_s=DEADLINE_S)
            assert all(0 <= k - s.version <= bound for s in r.samples), (k, [s.version for s in r.samples])
            assert all(s.tokens[0] == k for s in r.samples)
            trained[k] = sorted(set(r.groups))
            never.wait(delays[(k * 13 + seed) % len(delays)])  # the train step
            with lock:
                served[0] = k + 1  # the weight sync, then the scheduler hears of it
            c.version_changed()
    finally:
        for made in current:
            made.stop(timeout_s=DEADLINE_S)
    assert trained == {k: expected_ids(k, per_step) for k in range(steps)}
    assert peak[0] <= (bound + 1) * per_step
