"""Rollout collection and batch building: episodes played turn by turn, then one training
batch whose samples (every turn of every episode) share prefixes, so they pack into trees.

Pure of torch.distributed: ``generate`` is whatever gives one generation per prompt (the
trainer's rank-0 rollout broadcast to every rank, or a client directly).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from treetrain.config import TrainerSettings
from treetrain.config.algorithms import Objective, objective
from treetrain.engines.base import TrainBatch
from treetrain.rl.advantages import advantages, informative_groups, overlong_penalty
from treetrain.rl.limits import TaskClock
from treetrain.rl.progress import RolloutProgress
from treetrain.rl.rollout import Generation, SamplingParams
from treetrain.rl.task import Task, TaskError

_T = TypeVar("_T")

Generate = Callable[[list[list[int]], SamplingParams, int], list[Generation]]


@dataclass(slots=True)
class Sample:
    episode: int
    tokens: list[int]
    prompt_len: int
    behav_logprobs: list[float]
    version: int = 0  # the oldest weight version the episode was sampled with, up to this turn


@dataclass(slots=True)
class Rollouts:
    samples: list[Sample]
    rewards: list[float]  # per episode: mean reward over its turns
    groups: list[int]  # per episode: its GRPO group
    capped_turns: int = 0  # episodes ended at trainer.maxTurns
    capped_tokens: int = 0  # episodes ended before passing trainer.maxEpisodeTokens
    dropped_groups: int = 0  # dynamic sampling: groups played and left out (all rewards equal)
    max_new_tokens: int = 0  # the task's reply length (overlong penalty, constant-length aggregation)

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


def seed_of(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's hash of ints is stable, but spell it out)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2))) & ((1 << 63) - 1)
    return x


# Mixed into a turn's sampling seed, so it never equals an episode's seed_of(seed, step, group).
TURN_SALT = 1_000_003


def turn_seed_of(seed: int, step: int, *parts: int) -> int:
    """The sampling seed of one turn's generate call: the step's turn, then what tells calls of
    that turn apart (a dynamic-sampling round; the asynchronous controller's group)."""
    return seed_of(seed, step, TURN_SALT, *parts)


def collect_rollouts(
    task: Task,
    generate: Generate,
    settings: TrainerSettings,
    step: int,
    *,
    clock: TaskClock | None = None,
    log: Callable[[str], None] | None = None,
    progress: RolloutProgress | None = None,
) -> Rollouts:
    """Play ``groupsPerStep`` groups of ``groupSize`` episodes to the end, all active episodes
    of a turn in one ``generate`` call; every turn becomes one sample holding the whole
    conversation so far. A group's episodes share their seed (same prompts, GRPO).

    Bounded: the task's code runs under ``clock`` (``trainer.episodeTimeoutSeconds`` per
    episode; SIGTERM stops it), an episode ends after ``trainer.maxTurns`` turns, or before a
    turn that could take it past ``trainer.maxEpisodeTokens`` (both counted in the result), and
    a first prompt with no room for a reply is refused.

    With dynamic sampling (``trainer.dynamicSampling``, on for dapo) groups whose rewards are
    all equal are dropped and more are played until the batch is full (:func:`fill_informative`)."""
    t = settings
    groups = [g for g in range(t.groups_per_step) for _ in range(t.group_size)]
    first = play_episodes(
        task,
        generate,
        t,
        step,
        groups,
        turn_seed=lambda turn: turn_seed_of(t.seed, step, turn),
        clock=clock,
        progress=progress,
    )
    if not objective(t).dynamic_sampling:
        return first

    def play(ids: Sequence[int], rnd: int) -> Rollouts:
        if progress is not None:
            progress.add_episodes(len(ids) * t.group_size)
        return play_episodes(
            task,
            generate,
            t,
            step,
            [g for g in ids for _ in range(t.group_size)],
            # Round 0 is the step's first groups, seeded as without dynamic sampling.
            turn_seed=lambda turn: turn_seed_of(t.seed, step, turn, rnd),
            clock=clock,
            progress=progress,
        )

    return fill_informative(first, play, t.groups_per_step, step, log=log)


# Extra groups per step, times groupsPerStep, that dynamic sampling plays (and the asynchronous
# controller, replacing dropped groups): a task whose groups are nearly all solved (or all failed)
# must not sample for ever.
EXTRA_GROUPS_FACTOR = 4


def fill_informative(
    first: Rollouts,
    play: Callable[[Sequence[int], int], Rollouts],
    need: int,
    step: int,
    *,
    log: Callable[[str], None] | None,
) -> Rollouts:
    """Dynamic sampling: keep the groups of ``first`` whose rewards differ and play more groups
    (``play(ids, round)``: ids groupsPerStep (``need``), groupsPerStep + 1, ..., each seeded as
    the first ones) until ``need`` are kept or the extra groups run out; then train what there
    is. The task's episodes and an agent's runs share it."""
    good = informative_groups(first.rewards, first.groups)
    parts = [select_groups(first, good)]
    have, dropped = len(good), need - len(good)
    next_id, limit, rnd = need, need + EXTRA_GROUPS_FACTOR * need, 1
    while have < need and next_id < limit:
        ids = range(next_id, min(next_id + need - have, limit))
        part = play(ids, rnd)
        good = informative_groups(part.rewards, part.groups)
        parts.append(select_groups(part, good))
        have, dropped = have + len(good), dropped + len(ids) - len(good)
        next_id, rnd = ids.stop, rnd + 1
    if have == 0:
        # No group had any signal: train the first ones (zero advantages) rather than nothing.
        parts, dropped = [first], dropped - need
    out = merge_rollouts(parts)
    out.dropped_groups = dropped
    if have < need:
        (log or _stderr)(
            f"step {step + 1}: dynamic sampling kept {have} of {need} groups after {next_id - need} extra "
            f"({dropped} dropped: all rewards equal); training "
            + ("those" if have else "the first groups, which carry no signal")
        )
    return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def select_groups(rollouts: Rollouts, keep: set[int]) -> Rollouts:
    """The episodes of ``rollouts`` whose group is in ``keep``, renumbered in order (counts kept)."""
    index = {e: i for i, e in enumerate(e for e, g in enumerate(rollouts.groups) if g in keep)}
    return Rollouts(
        samples=[dataclasses.replace(s, episode=index[s.episode]) for s in rollouts.samples if s.episode in index],
        rewards=[r for r, g in zip(rollouts.rewards, rollouts.groups, strict=True) if g in keep],
        groups=[g for g in rollouts.groups if g in keep],
        capped_turns=rollouts.capped_turns,
        capped_tokens=rollouts.capped_tokens,
        dropped_groups=rollouts.dropped_groups,
        max_new_tokens=rollouts.max_new_tokens,
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
    ``seed_of(seed, step, group)``) turn by turn, all active episodes of a turn in one
    ``generate`` call seeded ``turn_seed(turn)``: what :func:`collect_rollouts` does for a whole
    step, and the asynchronous controller for one group. ``version`` gives the weight version
    a generation without per-token versions was sampled with (read before the call);
    ``progress`` counts the tokens generated and the episodes finished."""
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
            samples.append(
                Sample(
                    episode=i,
                    tokens=tokens,
                    prompt_len=len(history[i]),
                    behav_logprobs=gen.logprobs,
                    version=started[i],
                )
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


def merge_rollouts(parts: Sequence[Rollouts]) -> Rollouts:
    """Several groups' rollouts as one: episode indices renumbered in order, counts summed."""
    samples: list[Sample] = []
    rewards: list[float] = []
    groups: list[int] = []
    for part in parts:
        base = len(rewards)
        samples += [dataclasses.replace(s, episode=base + s.episode) for s in part.samples]
        rewards += part.rewards
        groups += part.groups
    return Rollouts(
        samples=samples,
        rewards=rewards,
        groups=groups,
        capped_turns=sum(p.capped_turns for p in parts),
        capped_tokens=sum(p.capped_tokens for p in parts),
        dropped_groups=sum(p.dropped_groups for p in parts),
        max_new_tokens=max((p.max_new_tokens for p in parts), default=0),
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


def make_batch(rollouts: Rollouts, settings: TrainerSettings) -> TrainBatch:
    """The training batch: response tokens masked in, the algorithm's advantages (PPO: the
    returns, whose advantages the critic fills in), the sampler's log-probs for decoupled PPO,
    and what a non-default objective needs: per-token ``loss_weights`` for a per-sample
    aggregation, ``sample_index`` for a sequence ratio or sequence weight mode."""
    obj = objective(settings)
    rewards = shaped_rewards(rollouts, obj)
    adv = advantages(obj.advantage, rewards, rollouts.groups, normalize_std=obj.normalize_advantages)
    weights = loss_weights(rollouts, obj)
    seqs, masks, advs, behav, returns, index, scale = [], [], [], [], [], [], []
    for i, s in enumerate(rollouts.samples):
        n = len(s.tokens) - 1
        mask = torch.zeros(n)
        mask[s.prompt_len - 1 :] = 1.0  # position i predicts token i + 1: the response tokens
        b = torch.zeros(n)
        b[s.prompt_len - 1 :] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
        seqs.append(s.tokens)
        masks.append(mask)
        advs.append(torch.full((n,), float(adv[s.episode])))
        returns.append(torch.full((n,), float(rewards[s.episode])))
        behav.append(b)
        if obj.per_sample:
            index.append(torch.full((n,), float(i)))
        if weights is not None:
            scale.append(torch.full((n,), weights[i]))
    tensors: dict[str, list[torch.Tensor]] = {"advantages": advs, "behav_logprobs": behav}
    if obj.advantage == "critic":
        tensors["returns"] = returns
    if obj.per_sample:
        tensors["sample_index"] = index
    if weights is not None:
        tensors["loss_weights"] = scale
    return TrainBatch(sequences=seqs, loss_mask=masks, tensors=tensors)


def reply_lengths(rollouts: Rollouts) -> list[int]:
    """Each sample's trained tokens: its last reply."""
    return [len(s.tokens) - s.prompt_len for s in rollouts.samples]


def shaped_rewards(rollouts: Rollouts, obj: Objective) -> list[float]:
    """The episodes' rewards plus, with the overlong penalty on, the mean penalty of their
    replies (an episode's reward is the mean over its turns, so each turn's reply counts once)."""
    if obj.overlong is None:
        return rollouts.rewards
    if rollouts.max_new_tokens < 1:
        raise ValueError("the overlong penalty needs Rollouts.max_new_tokens (the task's reply length)")
    cap, buffer = rollouts.max_new_tokens, obj.overlong_buffer(rollouts.max_new_tokens)
    pen = [0.0] * len(rollouts.rewards)
    turns = [0] * len(rollouts.rewards)
    for s, length in zip(rollouts.samples, reply_lengths(rollouts), strict=True):
        pen[s.episode] += overlong_penalty(length, cap, buffer, obj.overlong.penalty)
        turns[s.episode] += 1
    return [r + p / max(k, 1) for r, p, k in zip(rollouts.rewards, pen, turns, strict=True)]


def loss_weights(rollouts: Rollouts, obj: Objective) -> list[float] | None:
    """Per-sample token weights that turn the engines' division by the batch's trained-token
    count T into the objective's aggregation (None: token-mean, nothing to weigh). Over S
    samples, sequence-mean weighs sample i's n_i tokens T / (S n_i) (its token mean, averaged
    over samples); constant-length weighs every token T / (S L) (the sum over S L)."""
    if obj.aggregation == "token-mean":
        return None
    lengths = reply_lengths(rollouts)
    total, count = max(sum(lengths), 1), max(len(lengths), 1)
    if obj.aggregation == "sequence-mean":
        return [total / (count * max(n, 1)) for n in lengths]
    if obj.aggregation_length is None and rollouts.max_new_tokens < 1:
        raise ValueError("constant-length aggregation needs Rollouts.max_new_tokens or trainer.loss.aggregationLength")
    length = obj.aggregation_tokens(rollouts.max_new_tokens)
    return [total / (count * length)] * len(lengths)
