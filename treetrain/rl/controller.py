"""The asynchronous rollout controller (``trainer.rollout.maxStaleness`` N >= 1): worker threads
on rank 0 play the groups of the next steps while the trainer trains, within a staleness bound.

A group is named by ``(step, g)``; group ``g`` of step ``s`` plays ``groupSize`` episodes seeded
``seed_of(seed, s, g)``, as the synchronous loop's groups are. Replacements of dropped groups
count up from ``groupsPerStep``.

The bound is kept by admission, never by discarding finished work: a group of step ``s`` may
start only while the weight version is at least ``s - N``, so a trajectory trained at step k was
sampled with weights of version >= k - N (versions only grow while it plays). At most
``(N + 1) * groupsPerStep`` groups are started and not yet trained at any time, which bounds
the buffer. A group whose rewards are all equal (dynamic sampling) or whose generation failed on
every server is dropped, counted and replaced, up to ``4 * groupsPerStep`` replacements per step;
past that the step trains the groups it has.

The task's code runs in the worker threads, where a hung call cannot be interrupted: every call
is watched, and :meth:`RolloutController.take` fails naming the task once one has run past its
episode budget plus ``WATCH_MARGIN_S``. Threads are daemons: the process can always exit.

:meth:`RolloutController.state` is a JSON-able snapshot (finished untrained groups, groups to
start again, the next replacement id per step) that a resumed run passes back in, so that no
group is lost or repeated; groups in flight at the snapshot are simply started again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treetrain.metrics import DROP_REASONS
from treetrain.rl.collect import EXTRA_GROUPS_FACTOR, Rollouts, Sample, merge_rollouts
from treetrain.rl.limits import EpisodeTimeoutError, TaskClock, budget_left
from treetrain.rl.rollout import RolloutError

WATCH_MARGIN_S = 10.0  # a task call this long past its episode budget fails the step
TICK_S = 0.25  # how often a waiting take() looks at the watched task calls
STATE_VERSION = 1

PlayGroup = Callable[[int, int, TaskClock], Rollouts]  # (step, g, the worker's clock) -> the group's rollouts


class WatchedClock(TaskClock):
    """A worker thread's TaskClock that says which call runs, and until when it may run."""

    def __init__(self, task: str, timeout_s: float, running: dict[int, tuple[str, float, float]]) -> None:
        super().__init__(task, timeout_s)
        self._running = running  # thread id -> (call, started, budget end), shared by the workers

    def run(self, what: str, spent_s: float, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        now = time.monotonic()
        key = threading.get_ident()
        self._running[key] = (what, now, now + budget_left(self.timeout_s, spent_s))
        try:
            return super().run(what, spent_s, fn, *args)
        finally:
            self._running.pop(key, None)


@dataclass(slots=True)
class _Step:
    """One step's groups: to start, running, finished and kept; and the next fresh id."""

    todo: list[int]
    next_id: int
    running: set[int] = field(default_factory=set)
    done: dict[int, Rollouts] = field(default_factory=dict)
    # Dynamic sampling found no signal in these first groups: trained only if no group has any.
    fallback: dict[int, Rollouts] = field(default_factory=dict)


class RolloutController:
    """See the module docstring. ``keep`` (dynamic sampling) says whether a finished group is
    trained; ``version`` is the weight version the servers hold when it starts."""

    def __init__(
        self,
        play: PlayGroup,
        *,
        task: str,
        episode_timeout_s: float,
        groups_per_step: int,
        max_staleness: int,
        steps: int,
        start_step: int = 0,
        version: int = 0,
        keep: Callable[[Rollouts], bool] | None = None,
        workers: int | None = None,
        state: dict[str, Any] | None = None,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"the rollout controller needs maxStaleness >= 1 (got {max_staleness})")
        self.play, self.keep, self.log = play, keep, log
        self.task, self.episode_timeout_s = task, episode_timeout_s
        self.groups_per_step, self.max_staleness, self.steps = groups_per_step, max_staleness, steps
        self.capacity = (max_staleness + 1) * groups_per_step
        self.max_ids = groups_per_step * (1 + EXTRA_GROUPS_FACTOR)  # replacements as the synchronous loop plays
        self.next_take = start_step
        self._version = version
        self._cond = threading.Condition()
        self._steps: dict[int, _Step] = {}
        self._running_calls: dict[int, tuple[str, float, float]] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._halted = False  # SIGTERM: only the step the trainer waits for may start groups
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # groups dropped so far, by reason
        self.last_failure = ""  # the newest group's generation error: the step's final error names it
        self._idle_s = 0.0
        self._idle_since: float | None = time.monotonic()
        if state is not None:
            self._restore(state)
        n = workers or min(self.capacity, 64)
        self._threads = [threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    # -- the trainer's side --------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The servers hold weight ``version`` now (after the sync that follows a step)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def take(self, step: int, timeout_s: float | None = None) -> Rollouts:
        """Block until ``step``'s groups are finished; they come back as one Rollouts, in group
        order. Steps are taken in order, each once."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if step != self.next_take:
                raise ValueError(f"take({step}): the next step to train is {self.next_take}")
            while True:
                if self._error is not None:
                    raise self._error
                st = self._step(step)
                if len(st.done) >= self.groups_per_step or (not st.running and not self._can_start(st)):
                    break
                self._check_watch()
                if deadline is not None and time.monotonic() >= deadline:
                    raise RolloutError(
                        f"rollout: step {step + 1} has {len(st.done)} of {self.groups_per_step} groups after "
                        f"{timeout_s:g}s ({len(st.running)} playing)"
                    )
                self._cond.wait(TICK_S)
            del self._steps[step]
            self.next_take = step + 1
            self._cond.notify_all()  # room for more groups
        if not st.done and st.fallback:
            self.log(
                f"rollout: step {step + 1}: dynamic sampling found no group whose rewards differ in {st.next_id} "
                "tried; training the first groups, which carry no signal"
            )
            return merge_rollouts([st.fallback[g] for g in sorted(st.fallback)])
        if not st.done:
            last = f"; the last failure: {self.last_failure}" if self.last_failure else ""
            raise RolloutError(
                f"rollout: step {step + 1} has no group to train: all {st.next_id} tried were dropped "
                f"({self.dropped['failed']} failed on every server, {self.dropped['filtered']} had equal rewards "
                f"so far in this run{last}); fix: check the rollout servers, or turn trainer.dynamicSampling off"
            )
        if len(st.done) < self.groups_per_step:
            self.log(
                f"rollout: step {step + 1} trains {len(st.done)} of {self.groups_per_step} groups "
                f"({st.next_id} tried; the others were dropped)"
            )
        return merge_rollouts([st.done[g] for g in sorted(st.done)])

    def buffered(self) -> int:
        """Finished groups waiting to be trained."""
        with self._cond:
            return sum(len(st.done) for st in self._steps.values())

    def in_flight(self) -> int:
        """Groups started and not yet trained (playing or finished): at most the capacity."""
        with self._cond:
            return self._held()

    def idle_seconds(self) -> float:
        """Seconds no group was playing (the rollout side had nothing to generate)."""
        with self._cond:
            open_s = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
            return self._idle_s + open_s

    def halt(self) -> None:
        """Start groups of the step the trainer waits for only (safe in a signal handler: no
        lock; the workers see it at their next look)."""
        self._halted = True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Start no more groups; wait up to ``timeout_s`` for the workers (a group in flight is
        started again after a resume)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        end = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    def state(self) -> dict[str, Any]:
        """The snapshot a resumed run passes back as ``state`` (see the module docstring)."""
        with self._cond:
            steps = {
                str(s): {
                    "todo": sorted(set(st.todo) | st.running),
                    "next_id": st.next_id,
                    "done": {str(g): _rollouts_json(r) for g, r in sorted(st.done.items())},
                }
                for s, st in sorted(self._steps.items())
                if s >= self.next_take
            }
            return {"version": STATE_VERSION, "next_step": self.next_take, "steps": steps}

    # -- the workers ---------------------------------------------------------------------
    def _work(self) -> None:
        clock = WatchedClock(self.task, self.episode_timeout_s, self._running_calls)
        while True:
            with self._cond:
                job = self._next_job()
                while job is None and not self._stopping and self._error is None:
                    self._cond.wait()
                    job = self._next_job()
                if job is None:
                    return
                step, g = job
            result: Rollouts | None = None
            try:
                result = self.play(step, g, clock)
                reason = None if self.keep is None or self.keep(result) else "filtered"
            except RolloutError as err:
                reason = "failed"
                with self._cond:
                    self.last_failure = str(err)
                self.log(f"rollout: group {g} of step {step + 1} dropped: {err}")
            except BaseException as err:  # the task's code or a bug: the trainer stops with it
                with self._cond:
                    self._error = self._error or err
                    self._finish(step, g)
                return
            with self._cond:
                self._finish(step, g)
                st = self._steps.get(step)
                if reason is not None:
                    self.dropped[reason] += 1
                if st is not None and result is not None:
                    if reason is None:
                        st.done[g] = result
                    elif g < self.groups_per_step:
                        st.fallback[g] = result

    def _next_job(self) -> tuple[int, int] | None:
        """The first group admission allows now (lowest step first), marked running; None when
        none may start. Called with the lock held."""
        if self._stopping or self._error is not None or self._held() >= self.capacity:
            return None
        last = self.next_take if self._halted else min(self._version + self.max_staleness, self.steps - 1)
        for s in range(self.next_take, last + 1):
            st = self._step(s)
            if len(st.done) + len(st.running) >= self.groups_per_step or not self._can_start(st):
                continue
            if st.todo:
                g = st.todo.pop(0)  # a first group, or one a stop interrupted
            else:
                g, st.next_id = st.next_id, st.next_id + 1  # a replacement
            st.running.add(g)
            if self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
            return s, g
        return None

    def _finish(self, step: int, g: int) -> None:
        st = self._steps.get(step)
        if st is not None:
            st.running.discard(g)
        if self._idle_since is None and not any(s.running for s in self._steps.values()):
            self._idle_since = time.monotonic()
        self._cond.notify_all()

    def _step(self, s: int) -> _Step:
        st = self._steps.get(s)
        if st is None:
            st = self._steps[s] = _Step(todo=list(range(self.groups_per_step)), next_id=self.groups_per_step)
        return st

    def _can_start(self, st: _Step) -> bool:
        return bool(st.todo) or st.next_id < self.max_ids

    def _held(self) -> int:
        return sum(len(st.running) + len(st.done) for st in self._steps.values())

    def _check_watch(self) -> None:
        now = time.monotonic()
        for what, started, ends in list(self._running_calls.values()):
            if now > ends + WATCH_MARGIN_S:
                raise EpisodeTimeoutError(
                    f"task {self.task}: {what} did not return within the episode's budget of "
                    f"{self.episode_timeout_s:g}s (trainer.episodeTimeoutSeconds; it has run {now - started:.1f}s in "
                    "a rollout thread, where it cannot be stopped); fix: make the task answer, or raise the key"
                )

    def _restore(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("next_step") != self.next_take:
            self.log(
                f"rollout: the checkpoint's controller state is for step {state.get('next_step')}, not "
                f"{self.next_take}; starting that step's groups afresh"
            )
            return
        for key, raw in state["steps"].items():
            s, todo = int(key), [int(g) for g in raw["todo"]]
            done = {int(g): _rollouts_of(r) for g, r in raw["done"].items()}
            # A run resumed with a smaller maxStaleness plays again what its bound would not admit.
            late = sorted(
                g for g, r in done.items() if min((x.version for x in r.samples), default=s) < s - self.max_staleness
            )
            for g in late:
                del done[g]
            self._steps[s] = _Step(todo=sorted(todo + late), next_id=int(raw["next_id"]), done=done)


def _rollouts_json(r: Rollouts) -> dict[str, Any]:
    return dataclasses.asdict(r)


def _rollouts_of(raw: dict[str, Any]) -> Rollouts:
    fields = dict(raw)
    fields["samples"] = [Sample(**s) for s in raw["samples"]]
    return Rollouts(**fields)
