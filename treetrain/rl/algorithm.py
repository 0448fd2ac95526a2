"""The run's algorithm as one object: it builds the training batch from a step's rollouts, runs
the preparation passes (reference log-probs, the critic's values and the advantages they give,
the proximal log-probs) and the update. Nothing else writes a batch's fields: each pass returns a
new frozen batch, and the loss it trains with was built for exactly the fields it adds.

Built from the preset table (``trainer.algorithm``, treetrain.config.algorithms): the advantage,
the objective's options, dynamic sampling (:meth:`Algorithm.informative`, the group scheduler's
keep rule).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treetrain.config import OptimizerSettings, RoleSettings, TrainConfig, TrainerSettings, check_training_backend
from treetrain.config.algorithms import Objective, objective
from treetrain.engines import build_engine
from treetrain.engines.base import Engine
from treetrain.engines.batch import TokenFields, TrainBatch
from treetrain.engines.stats import StepStats
from treetrain.rl.advantages import advantages, informative_groups, overlong_penalty
from treetrain.rl.losses import PPOLoss, ValueLoss
from treetrain.rl.samples import Rollouts, reply_lengths


@dataclass(frozen=True, slots=True)
class Update:
    """What one step's update did: the actor's last pass, its gradient norm, the critic's loss."""

    stats: StepStats
    grad_norm: float
    value_loss: float | None = None


class Algorithm:
    """See the module docstring. ``ref`` is built only when the KL term uses it; ``critic`` for
    the critic-based advantage (PPO)."""

    def __init__(
        self, settings: TrainerSettings, *, actor: Engine, ref: Engine | None = None, critic: Engine | None = None
    ) -> None:
        self.settings, self.actor, self.ref, self.critic = settings, actor, ref, critic
        self.objective = objective(settings)
        self.epochs = settings.ppo_epochs
        # Several updates on one batch: the ratio needs the policy that generated it (before the
        # first update), recomputed once; one update alone uses the current log-probs.
        self.loss = PPOLoss(
            settings.loss, self.objective, proximal=self.epochs > 1, behaviour=True, reference=ref is not None
        )
        self.value_loss = ValueLoss(settings.value_loss, clipped=True)

    @classmethod
    def build(cls, cfg: TrainConfig, actor: Engine, log: Callable[[str], None]) -> Algorithm:
        """The algorithm of ``cfg`` for ``actor``, with the engines it needs beside it: a critic
        (``critic:``), and a reference model only where the KL term reads it (``ref:`` and
        ``trainer.loss.klCoef > 0``), each in the actor's processes, in its own layout when its
        backend differs."""
        t = cfg.trainer

        def colocated(settings: RoleSettings, role: str, optimizer: OptimizerSettings | None) -> Engine:
            backend = check_training_backend(settings.backend or cfg.actor.backend)
            return build_engine(cfg.model, backend, role=role, tree=cfg.actor.tree_training, optimizer=optimizer)

        ref = colocated(cfg.ref, "ref", None) if cfg.ref is not None and t.loss.kl_coef > 0 else None
        if cfg.ref is not None and ref is None:
            log("ref: configured but trainer.loss.klCoef is 0, so no reference model is built")
        critic = colocated(cfg.critic, "critic", t.optimizer) if cfg.critic is not None else None
        return cls(t, actor=actor, ref=ref, critic=critic)

    def informative(self, rollouts: Rollouts) -> bool:
        """Dynamic sampling's rule: a group is trained when its rewards differ."""
        return bool(informative_groups(rollouts.rewards, rollouts.groups))

    @property
    def keep(self) -> Callable[[Rollouts], bool] | None:
        """The group scheduler's keep rule: dynamic sampling's, or None (every group is trained)."""
        return self.informative if self.objective.dynamic_sampling else None

    def batch(self, rollouts: Rollouts) -> TrainBatch:
        """The training batch: response tokens masked in, the sampler's log-probs shifted onto the
        positions that predict them, the algorithm's advantages (the critic's: the returns, whose
        advantages :meth:`prepare` adds), and what a non-default objective needs: per-token
        ``loss_weights`` for a per-sample aggregation, ``sample_index`` for a sequence ratio or
        sequence weight mode."""
        return make_batch(rollouts, self.objective)

    def prepare(self, batch: TrainBatch) -> TrainBatch:
        """The passes before the update, each adding its fields: the reference's log-probs, the
        critic's values and advantages = return - value, the proximal log-probs."""
        add: dict[str, list[torch.Tensor]] = {}
        if self.ref is not None:
            add["ref_logprobs"] = self.ref.forward(batch.sequences)
        if self.critic is not None:
            values = self.critic.forward(batch.sequences)
            returns = batch.fields.need("returns")
            add["old_values"] = values
            add["advantages"] = [r - v for r, v in zip(returns, values, strict=True)]
        if self.loss.proximal:
            add["old_logprobs"] = self.actor.forward(batch.sequences)
        return dataclasses.replace(batch, fields=dataclasses.replace(batch.fields, **add))

    def update(self, batch: TrainBatch) -> Update:
        """One critic update, then ``trainer.ppoEpochs`` actor updates on ``batch``."""
        value_loss = None
        if self.critic is not None:
            value_loss = self.critic.forward_backward(batch, self.value_loss).loss
            self.critic.step()
        for _ in range(self.epochs):
            stats = self.actor.forward_backward(batch, self.loss)
            norm = self.actor.step()
        return Update(stats=stats, grad_norm=norm, value_loss=value_loss)


def make_batch(rollouts: Rollouts, obj: Objective) -> TrainBatch:
    """See :meth:`Algorithm.batch`."""
    rewards = shaped_rewards(rollouts, obj)
    adv = advantages(obj.advantage, rewards, rollouts.groups, normalize_std=obj.normalize_advantages)
    weights = loss_weights(rollouts, obj)
    seqs, masks, advs, behav, returns, index, scale = [], [], [], [], [], [], []
    for i, s in enumerate(rollouts.samples):
        n = len(s.tokens) - 1
        mask = torch.zeros(n)
        mask[s.prompt_len - 1 :] = 1.0  # position i predicts token i + 1: the response tokens
        seqs.append(s.tokens)
        masks.append(mask)
        advs.append(torch.full((n,), float(adv[s.episode])))
        returns.append(torch.full((n,), float(rewards[s.episode])))
        behav.append(torch.tensor(s.logprobs[1:], dtype=torch.float32))  # 0.0 on the prompt's positions
        if obj.per_sample:
            index.append(torch.full((n,), float(i)))
        if weights is not None:
            scale.append(torch.full((n,), weights[i]))
    critic = obj.advantage == "critic"
    fields = TokenFields(
        advantages=advs,
        behav_logprobs=behav,
        returns=returns if critic else None,
        sample_index=index if obj.per_sample else None,
        loss_weights=scale if weights is not None else None,
    )
    return TrainBatch(sequences=seqs, loss_mask=masks, fields=fields)


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
