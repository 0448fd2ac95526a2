"""Where episodes come from: one interface that a task and an agent both implement.

An :class:`EpisodeSource` plays the groups of one :class:`GroupCall` and returns their
:class:`~treetrain.rl.samples.Rollouts`; the group scheduler (treetrain.rl.scheduler) decides
which calls to make and when. A group ``g`` of step ``s`` is ``groupSize`` episodes of one
prompt (GRPO), seeded ``seed_of(seed, s, g)``; replacement groups count up from
``groupsPerStep``. :class:`TaskSource` plays a task's episodes turn by turn, all active episodes
of the call's groups in one generate call per turn (agents: treetrain.trainer.agents).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from treetrain.config import TrainerSettings
from treetrain.rl.limits import TaskClock
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.rollout import Generation, SamplingParams
from treetrain.rl.samples import Rollouts, Sample, seed_of
from treetrain.rl.task import Task, TaskError

_T = TypeVar("_T")

Generate = Callable[[list[list[int]], SamplingParams, int], list[Generation]]

EVAL_TEMPERATURE = 1e-3  # evaluation samples (nearly) greedily: a temperature of 0 divides by zero
# Mixed into a turn's sampling seed, so it never equals an episode's seed_of(seed, step, group).
TURN_SALT = 1_000_003


@dataclass(frozen=True, slots=True)
class GroupCall:
    """Groups of one step played together. ``round``: played inline by the trainer, 0 for the
    step's first groups and r for the r-th round of replacements; None for one group played in a
    rollout thread while the trainer trains."""

    step: int
    groups: tuple[int, ...]
    round: int | None = None

    def turn_seed(self, seed: int, turn: int) -> int:
        """The sampling seed of the call's generate call for ``turn``: the step and turn, then
        what tells calls of that turn apart (the replacement round; the thread's group)."""
        if self.round is None:
            return seed_of(seed, self.step, TURN_SALT, self.groups[0], turn)
        rounds = (self.round,) if self.round else ()
        return seed_of(seed, self.step, TURN_SALT, turn, *rounds)


def greedy(generate: Generate) -> Generate:
    """``generate`` at the evaluation temperature, whatever the caller asked."""

    def call(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        return generate(prompts, dataclasses.replace(params, temperature=EVAL_TEMPERATURE, top_p=1.0), seed)

    return call


class EpisodeSource(Protocol):
    """Plays the groups of ``call``; the task's own code runs under ``clock``."""

    def play(self, call: GroupCall, clock: TaskClock) -> Rollouts: ...


class TaskSource:
    """A task's episodes (built-in, a user's, or a dataset scored by a reward), sampled with
    ``generate``. ``version`` gives the weight version a generation without per-token versions
    was sampled with (read before the call); ``progress`` counts tokens and finished episodes."""

    def __init__(
        self,
        task: Task,
        generate: Generate,
        settings: TrainerSettings,
        *,
        version: Callable[[], int] | None = None,
        progress: RolloutProgress | None = None,
    ) -> None:
        self.task, self.generate, self.settings = task, generate, settings
        self.version, self.progress = version, progress

    def play(self, call: GroupCall, clock: TaskClock) -> Rollouts:
        t = self.settings
        groups = [g for g in call.groups for _ in range(t.group_size)]
        return play_episodes(
            self.task,
            self.generate,
            t,
            call.step,
            groups,
            turn_seed=lambda turn: call.turn_seed(t.seed, turn),
            clock=clock,
            version=self.version,
            progress=self.progress,
        )


def play_episodes(
    task: Task,
    generate: Generate,
    settings: TrainerSettings,
    step: int,
    groups: Sequence[int],
    *,
    turn_seed: Callable[[int], int],
    clock: TaskClock | None = None,
    version: Callable[[], int] | None = None,
    progress: RolloutProgress | None = None,
) -> Rollouts:
    """Play one episode per entry of ``groups`` (its group id; the episode's seed is
    ``seed_of(seed, step, group)``) to the end, all active episodes of a turn in one
    ``generate`` call seeded ``turn_seed(turn)``; every turn becomes one sample holding the whole
    conversation so far.

    Bounded: the task's code runs under ``clock`` (``trainer.episodeTimeoutSeconds`` per
    episode; SIGTERM stops it), an episode ends after ``trainer.maxTurns`` turns, or before a
    turn that could take it past ``trainer.maxEpisodeTokens`` (both counted in the result), and
    a first prompt with no room for a reply is refused."""
    t = settings
    clock = clock or TaskClock(t.task, t.episode_timeout_seconds)
    params = sampling_params(task, t)
    n = len(groups)
    spent = [0.0] * n  # seconds the task's code took per episode

    def call(i: int, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        result, took = clock.run(f"{what} of episode {i}", spent[i], fn, *args)
        spent[i] += took
        return result

    # A dataset task picks its row by (step, group); any other task plays episode(seed). Looked up on the
    # class: a user task behind CheckedTask keeps its checked episode().
    by_row = callable(getattr(type(task), "episode_at", None))
    episodes = [
        call(i, "episode_at()", task.episode_at, step, g, seed_of(t.seed, step, g))  # type: ignore[attr-defined]
        if by_row
        else call(i, "episode()", task.episode, seed_of(t.seed, step, g))
        for i, g in enumerate(groups)
    ]
    history = [list(call(i, "prompt()", ep.prompt)) for i, ep in enumerate(episodes)]
    for i, prompt in enumerate(history):
        if len(prompt) + params.max_new_tokens > t.max_episode_tokens:
            raise TaskError(
                f"task {t.task}: the first prompt of episode {i} has {len(prompt)} tokens, and a reply of up to "
                f"{params.max_new_tokens} would pass trainer.maxEpisodeTokens ({t.max_episode_tokens}); fix: raise "
                "trainer.maxEpisodeTokens or shorten the task's prompt"
            )
    totals = [0.0] * n
    turns = [0] * n
    started = [sys.maxsize] * n  # per episode: the oldest weight version it was sampled with
    capped = {"turns": 0, "tokens": 0}
    active = list(range(n))
    samples: list[Sample] = []
    turn = 0
    while active:
        now = version() if version is not None else 0
        gens = generate([history[i] for i in active], params, turn_seed(turn))
        if progress is not None:
            progress.generated(sum(len(g.tokens) for g in gens))
        still = []
        for i, gen in zip(active, gens, strict=True):
            started[i] = min(started[i], min(gen.versions, default=now))
            tokens = history[i] + gen.tokens
            logprobs = [0.0] * len(history[i]) + list(gen.logprobs)
            samples.append(
                Sample(episode=i, tokens=tokens, prompt_len=len(history[i]), logprobs=logprobs, version=started[i])
            )
            nxt, reward = call(i, "respond()", episodes[i].respond, list(gen.tokens))
            totals[i] += reward
            turns[i] += 1
            reason = episode_cap(turns[i], len(tokens), nxt, params.max_new_tokens, t.max_turns, t.max_episode_tokens)
            if reason is not None:
                capped[reason] += 1
            elif nxt is not None:
                history[i] = tokens + list(nxt)
                still.append(i)
        if progress is not None:
            progress.episodes_finished(len(active) - len(still))
        active = still
        turn += 1
    rewards = [total / max(k, 1) for total, k in zip(totals, turns, strict=True)]
    return Rollouts(
        samples=samples,
        rewards=rewards,
        groups=list(groups),
        capped_turns=capped["turns"],
        capped_tokens=capped["tokens"],
        max_new_tokens=params.max_new_tokens,
    )


def sampling_params(task: Task, settings: TrainerSettings) -> SamplingParams:
    """The sampling parameters of every turn: the task's reply length and stop tokens, the
    trainer's temperature and top-p."""
    return SamplingParams(
        max_new_tokens=task.max_new_tokens,
        temperature=settings.rollout.temperature,
        top_p=settings.rollout.top_p,
        stop_token_ids=tuple(getattr(task, "stop_token_ids", ())),
    )


def episode_cap(
    turns: int, tokens: int, nxt: Sequence[int] | None, max_new_tokens: int, max_turns: int, max_tokens: int
) -> str | None:
    """Why an episode that wants another turn (``nxt``, the next user turn) ends here: "turns"
    (it played ``max_turns``), "tokens" (its ``tokens`` so far, ``nxt`` and a full reply could
    pass ``max_tokens``), or None (it goes on, or it is over by itself)."""
    if nxt is None:
        return None
    if turns >= max_turns:
        return "turns"
    if tokens + len(nxt) + max_new_tokens > max_tokens:
        return "tokens"
    return None
