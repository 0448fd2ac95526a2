"""The group scheduler: which groups of which step are played when, which are trained, and what a
checkpoint keeps of them. One policy for the synchronous and the asynchronous loop.

A group is named by ``(step, g)`` (treetrain.rl.episodes). Dynamic sampling, and a group whose
generation failed on every server, drop a group; it is counted and replaced (ids from
``groupsPerStep`` up), up to ``4 * groupsPerStep`` replacements per step; past that the step
trains the groups it has, and when none had a signal, its first groups (zero advantages).

``max_staleness`` 0 (the synchronous loop): :meth:`GroupScheduler.take` plays the step's groups
inline, in the caller's thread, all of them in one call (one generate call per turn), then each
round of replacements in one call. A failed generation stops the step there (every group of the
call failed together).

``max_staleness`` N >= 1: worker threads play the groups of the next steps, one group per call,
while the trainer trains. The bound is kept by admission, never by discarding finished work: a
group of step ``s`` may start only while the weight version (read from its one owner, the
rollout client's gate) is at least ``s - N``, so a trajectory trained at step k was sampled with
weights of version >= k - N. At most ``(N + 1) * groupsPerStep`` groups are started and not yet
trained at any time, which bounds the buffer. The task's code runs in the worker threads, where a
hung call cannot be interrupted: every call is watched, and :meth:`GroupScheduler.take` fails
naming the task once one has run past its episode budget plus ``WATCH_MARGIN_S``. Threads are
daemons: the process can always exit. :meth:`GroupScheduler.state` is a JSON-able snapshot
(finished untrained groups, groups to start again, the next replacement id per step) that a
resumed run passes back in, so no group is lost or repeated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from treetrain.metrics import DROP_REASONS
from treetrain.rl.episodes import EpisodeSource, GroupCall
from treetrain.rl.limits import EpisodeTimeoutError, TaskClock, budget_left
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.rollout import RolloutError
from treetrain.rl.samples import Rollouts, merge_rollouts, rollouts_json, rollouts_of, select_groups

# Extra groups per step, times groupsPerStep, that replace dropped ones: a task whose groups are
# nearly all solved (or all failed) must not sample for ever.
EXTRA_GROUPS_FACTOR = 4
WATCH_MARGIN_S = 10.0  # a task call this long past its episode budget fails the step
TICK_S = 0.25  # how often a waiting take() looks at the watched task calls
STATE_VERSION = 2  # 2: samples carry token-aligned log-probs


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
    """One step's groups: to start, running, kept (by the first group of the call that played
    them), and the next fresh id."""

    todo: list[int]
    next_id: int
    running: set[int] = field(default_factory=set)
    done: dict[int, Rollouts] = field(default_factory=dict)
    kept: int = 0  # groups in ``done``
    # Dynamic sampling found no signal in these first groups: trained only if no group has any.
    fallback: dict[int, Rollouts] = field(default_factory=dict)


class GroupScheduler:
    """See the module docstring. ``keep`` (dynamic sampling) says whether a finished group is
    trained; ``version`` reads the weight version the rollout servers hold; ``clock`` runs the
    task's code of inline calls (the trainer's, which SIGTERM stops)."""

    def __init__(
        self,
        source: EpisodeSource,
        *,
        task: str,
        episode_timeout_s: float,
        groups_per_step: int,
        max_staleness: int,
        steps: int,
        start_step: int = 0,
        version: Callable[[], int] = lambda: 0,
        keep: Callable[[Rollouts], bool] | None = None,
        workers: int | None = None,
        state: dict[str, Any] | None = None,
        clock: TaskClock | None = None,
        progress: RolloutProgress | None = None,
        group_size: int = 1,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.source, self.keep, self.log = source, keep, log
        self.task, self.episode_timeout_s = task, episode_timeout_s
        self.groups_per_step, self.max_staleness, self.steps = groups_per_step, max_staleness, steps
        self.version, self.progress, self.group_size = version, progress, group_size
        self.clock = clock or TaskClock(task, episode_timeout_s)
        self.capacity = (max_staleness + 1) * groups_per_step
        self.max_ids = groups_per_step * (1 + EXTRA_GROUPS_FACTOR)
        self.next_take = start_step
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
        if state is not None and max_staleness >= 1:
            self._restore(state)
        n = 0 if max_staleness == 0 else workers or min(self.capacity, 64)
        self._threads = [threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    # -- the trainer's side --------------------------------------------------------------
    def version_changed(self) -> None:
        """The servers hold new weights (after the sync that follows a step): admit more groups."""
        with self._cond:
            self._cond.notify_all()

    def take(self, step: int, timeout_s: float | None = None) -> Rollouts:
        """``step``'s groups, as one Rollouts in group order (waiting for those not finished, or
        playing them here with bound 0). Steps are taken in order, each once."""
        with self._cond:
            if step != self.next_take:
                raise ValueError(f"take({step}): the next step to train is {self.next_take}")
        if not self._threads:
            self._play_inline(step)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                st = self._step(step)
                if st.kept >= self.groups_per_step or (not st.running and not self._can_start(st)):
                    break
                self._check_watch()
                if deadline is not None and time.monotonic() >= deadline:
                    raise RolloutError(
                        f"rollout: step {step + 1} has {st.kept} of {self.groups_per_step} groups after "
                        f"{timeout_s:g}s ({len(st.running)} playing)"
                    )
                self._cond.wait(TICK_S)
            del self._steps[step]
            self.next_take = step + 1
            self._cond.notify_all()  # room for more groups
        return self._trained(step, st)

    def _trained(self, step: int, st: _Step) -> Rollouts:
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
        if st.kept < self.groups_per_step:
            self.log(
                f"rollout: step {step + 1} trains {st.kept} of {self.groups_per_step} groups "
                f"({st.next_id} tried; the others were dropped)"
            )
        return merge_rollouts([st.done[g] for g in sorted(st.done)])

    def buffered(self) -> int:
        """Finished groups waiting to be trained."""
        with self._cond:
            return sum(st.kept for st in self._steps.values())

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

    def state(self) -> dict[str, Any] | None:
        """The snapshot a resumed run passes back as ``state`` (None with bound 0: a step is
        played and trained within the step, so nothing is left between steps)."""
        if not self._threads:
            return None
        with self._cond:
            steps = {
                str(s): {
                    "todo": sorted(set(st.todo) | st.running),
                    "next_id": st.next_id,
                    "done": {str(g): rollouts_json(r) for g, r in sorted(st.done.items())},
                }
                for s, st in sorted(self._steps.items())
                if s >= self.next_take
            }
            return {"version": STATE_VERSION, "next_step": self.next_take, "steps": steps}

    # -- playing -------------------------------------------------------------------------
    def _play_inline(self, step: int) -> None:
        """Bound 0: the step's first groups in one call, then rounds of replacements in one call
        each, until enough are kept or the replacements run out."""
        rnd = 0
        while True:
            with self._cond:
                st = self._step(step)
                if st.kept >= self.groups_per_step or not self._can_start(st):
                    return
                if st.todo:
                    ids, st.todo = st.todo, []
                else:
                    stop = min(st.next_id + self.groups_per_step - st.kept, self.max_ids)
                    ids, st.next_id = list(range(st.next_id, stop)), stop
                st.running.update(ids)
            if rnd > 0 and self.progress is not None:
                self.progress.add_episodes(len(ids) * self.group_size)
            self._play(GroupCall(step, tuple(ids), rnd), self.clock, inline=True)
            rnd += 1

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
            if not self._play(GroupCall(job[0], (job[1],)), clock, inline=False):
                return

    def _play(self, call: GroupCall, clock: TaskClock, *, inline: bool) -> bool:
        """Play ``call`` and file each of its groups as kept, dropped or a fallback; False when
        an error stops the scheduler. Inline, every error is raised here: a failed generation
        failed every group of the call, and the step with them."""
        with self._cond:
            self._busy()
        try:
            result = self.source.play(call, clock)
        except RolloutError as err:
            if inline:
                self._finish(call)
                raise
            with self._cond:
                self.last_failure = str(err)
                self.dropped["failed"] += len(call.groups)
            self.log(f"rollout: group {call.groups[0]} of step {call.step + 1} dropped: {err}")
            self._finish(call)
            return True
        except BaseException as err:  # the task's code or a bug: the trainer stops with it
            self._finish(call)
            if inline:
                raise
            with self._cond:
                self._error = self._error or err
            return False
        self._finish(call, result)
        return True

    def _finish(self, call: GroupCall, result: Rollouts | None = None) -> None:
        """``call`` is over: its groups filed (``result`` None: nothing to file), the idle clock
        started when nothing plays any more."""
        with self._cond:
            st = self._steps.get(call.step)
            if st is not None:
                st.running.difference_update(call.groups)
                if result is not None:
                    self._file(st, call, result)
            if self._idle_since is None and not any(s.running for s in self._steps.values()):
                self._idle_since = time.monotonic()
            self._cond.notify_all()

    def _file(self, st: _Step, call: GroupCall, result: Rollouts) -> None:
        kept = {g for g in call.groups if self.keep is None or self.keep(select_groups(result, {g}))}
        self.dropped["filtered"] += len(call.groups) - len(kept)
        if kept:
            st.done[call.groups[0]] = result if len(kept) == len(call.groups) else select_groups(result, kept)
            st.kept += len(kept)
        first = {g for g in call.groups if g < self.groups_per_step} - kept
        if first:
            st.fallback[min(first)] = select_groups(result, first)

    def _busy(self) -> None:
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None

    def _next_job(self) -> tuple[int, int] | None:
        """The first group admission allows now (lowest step first), marked running; None when
        none may start. Called with the lock held."""
        if self._stopping or self._error is not None or self._held() >= self.capacity:
            return None
        last = self.next_take if self._halted else min(self.version() + self.max_staleness, self.steps - 1)
        for s in range(self.next_take, last + 1):
            st = self._step(s)
            if st.kept + len(st.running) >= self.groups_per_step or not self._can_start(st):
                continue
            if st.todo:
                g = st.todo.pop(0)  # a first group, or one a stop interrupted
            else:
                g, st.next_id = st.next_id, st.next_id + 1  # a replacement
            st.running.add(g)
            return s, g
        return None

    def _step(self, s: int) -> _Step:
        st = self._steps.get(s)
        if st is None:
            st = self._steps[s] = _Step(todo=list(range(self.groups_per_step)), next_id=self.groups_per_step)
        return st

    def _can_start(self, st: _Step) -> bool:
        return bool(st.todo) or st.next_id < self.max_ids

    def _held(self) -> int:
        return sum(len(st.running) + st.kept for st in self._steps.values())

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
                f"rollout: the checkpoint's rollout state is for step {state.get('next_step')} (format "
                f"{state.get('version')}), not {self.next_take} (format {STATE_VERSION}); starting that step's "
                "groups afresh"
            )
            return
        for key, raw in state["steps"].items():
            s, todo = int(key), [int(g) for g in raw["todo"]]
            done = {int(g): rollouts_of(r) for g, r in raw["done"].items()}
            # A run resumed with a smaller maxStaleness plays again what its bound would not admit.
            late = sorted(
                g for g, r in done.items() if min((x.version for x in r.samples), default=s) < s - self.max_staleness
            )
            for g in late:
                del done[g]
            kept = sum(len(set(r.groups)) for r in done.values())
            self._steps[s] = _Step(todo=sorted(todo + late), next_id=int(raw["next_id"]), done=done, kept=kept)
