"""``trainer.eval``: every ``everySteps`` steps (and after the last), the mean reward of one greedy
run per evaluation row (the first ``samples`` rows; a failed run scores 0).

A dataset task's evaluation replies to every row in one generate call, scored by
``trainer.reward``; an agent's runs against a second proxy of rank 0 that samples greedily. Runs
on rank 0, inside the rollout's rank-0 section (treetrain.trainer.rollout), whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from treetrain.config import TrainConfig
from treetrain.proxy.server import ProxyServer
from treetrain.rl.dataset import DataCursor
from treetrain.rl.episodes import Generate, greedy, play_episodes
from treetrain.rl.samples import seed_of
from treetrain.trainer.agents import Job, run_agents
from treetrain.trainer.data import RunData

EVAL_SALT = 7_000_001  # mixed into evaluation seeds, so they never equal a training run's


class Evaluation:
    """See the module docstring."""

    def __init__(self, cfg: TrainConfig, data: RunData, log: Callable[[str], None]) -> None:
        self.cfg, self.data, self.log = cfg, data, log

    def due(self, step: int) -> bool:
        """``step`` (1-based, just trained) is an evaluation step: every everySteps, and the last."""
        e = self.cfg.trainer.eval
        return e is not None and (step % e.every_steps == 0 or step == self.cfg.trainer.steps)

    def run(self, step: int, generate: Generate, server: ProxyServer | None) -> float:
        """Rank 0: the mean reward. ``generate``: the trainer's (a dataset task); ``server``: the
        greedy proxy (an agent)."""
        t, data = self.cfg.trainer, self.data
        assert t.eval is not None and data.eval_rows is not None
        rows = [dict(data.eval_rows[i]) for i in range(min(t.eval.samples, len(data.eval_rows)))]
        seeds = [seed_of(t.seed, EVAL_SALT, step, i) for i in range(len(rows))]
        if data.agent is not None:
            assert server is not None
            jobs = [
                Job(row=r, seed=s, where=f"eval at step {step}, row {i}")
                for i, (r, s) in enumerate(zip(rows, seeds, strict=True))
            ]
            runs = run_agents(
                data.agent,
                jobs,
                server=server,
                timeout_s=t.episode_timeout_seconds,
                reward_runner=data.eval_reward_runner,
                log=self.log,
            )
            rewards = [r.reward if r.error is None else 0.0 for r in runs]
        else:
            rewards = self._dataset(rows, step, generate)
        return sum(rewards) / max(len(rewards), 1)

    def _dataset(self, rows: list[dict[str, Any]], step: int, generate: Generate) -> list[float]:
        """One greedy reply per row, scored by trainer.reward: the dataset task's own episodes,
        all rows in one generate call."""
        t = self.cfg.trainer
        assert t.eval is not None
        n = len(rows)
        settings = t.model_copy(update={"dataset": t.eval.dataset})
        cursor = DataCursor(n, n, shuffle=False, seed=0)  # group g of step 0 is row g
        task = self.data.dataset_task(settings, rows, cursor, self.data.eval_reward_runner)
        out = play_episodes(
            task, greedy(generate), settings, 0, list(range(n)), turn_seed=lambda turn: seed_of(t.seed, EVAL_SALT, step)
        )
        return out.rewards
