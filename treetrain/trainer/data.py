"""What a run's episodes are drawn from: a task, or a dataset's rows (scored by a reward, or played
by an agent), the cursor over the rows and its place in a checkpoint (``data.json``), and the
reward calls' worker processes.

Every rank builds it before the model loads, so a task, a dataset, a reward or an agent that
cannot load stops the run in one line (exit 2) before minutes of weight loading; the rows and
the cursor agree everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from treetrain.config import TrainConfig, TrainerSettings
from treetrain.engines.errors import CheckpointUnreadableError
from treetrain.proxy.chat import ChatRenderer
from treetrain.rl.agent import Agent, load_agent
from treetrain.rl.dataset import ByteLimits, DataCursor, DatasetTask, load_rows
from treetrain.rl.rewards import RewardRunner, load_reward, reads_answer
from treetrain.rl.rewards_pool import RewardPool
from treetrain.rl.task import Task, TaskError, load_task
from treetrain.trainer.agents import check_sessions

Log = Callable[[str], None]

DATA_STATE = "data.json"  # the DataCursor's state, beside the engines' files


class RunData:
    """See the module docstring. ``task`` is the task the episodes come from (None for an agent
    run: its runs are the episodes); ``row(step, group)`` a dataset row by the cursor."""

    def __init__(self, cfg: TrainConfig, get_tokenizer: Callable[[], Any], log: Log) -> None:
        self.cfg, self.log = cfg, log
        t = cfg.trainer
        self.agent: Agent | None = load_agent(t.agent) if t.agent is not None else None
        self.rows: Sequence[dict[str, Any]] | None = None
        self.eval_rows: Sequence[dict[str, Any]] | None = None
        self.reward_runner: RewardRunner | None = None
        self.eval_reward_runner: RewardRunner | None = None
        self.reward_pool: RewardPool | None = None
        self.cursor: DataCursor | None = None
        self.tokenizer: Any = None
        self.renderer: ChatRenderer | None = None  # an agent run's chat template, for rank 0's proxy
        self.task: Task | None = None
        if t.dataset is None:
            self.task = load_task(t.task, t.task_args, get_tokenizer)
            return
        try:
            self._load(t, get_tokenizer)
        except TaskError:
            raise
        except ValueError as err:  # DatasetError, RewardError: their line names the key and the fix
            raise TaskError(str(err)) from None

    def _load(self, t: TrainerSettings, get_tokenizer: Callable[[], Any]) -> None:
        assert t.dataset is not None
        # Every row checked here, before the tokenizer and the model: a bad one is one line, exit 2.
        # Sized by bytes against maxEpisodeTokens; a large file is mapped from its Arrow cache.
        answer_for = t.reward if reads_answer(t.reward, t.reward_args) else None
        limits = ByteLimits.for_episode(t.max_episode_tokens)
        self.rows = load_rows(t.dataset, answer_for=answer_for, limits=limits)
        if t.eval is not None:
            self.eval_rows = load_rows(t.eval.dataset, key="trainer.eval.dataset", answer_for=answer_for, limits=limits)
        if t.reward is not None:
            fn = load_reward(t.reward, t.reward_args)
            pool = self.reward_pool = RewardPool()  # training and evaluation share the workers
            pool.start()  # its server imports while the model loads

            def runner(answer_field: str) -> RewardRunner:
                return RewardRunner(
                    fn, timeout_s=t.reward_timeout_seconds, answer_field=answer_field, log=self.log, pool=pool
                )

            self.reward_runner = self.eval_reward_runner = runner(t.dataset.answer_field)
            if t.eval is not None and t.eval.dataset.answer_field != t.dataset.answer_field:
                self.eval_reward_runner = runner(t.eval.dataset.answer_field)  # the eval rows name theirs
        self.resume(None)
        tokenizer = get_tokenizer()
        if tokenizer is None:
            raise TaskError(
                "trainer.dataset needs a model with a tokenizer and chat template (e.g. model.path: "
                "builtin:smollm2-135m)"
            )
        self.tokenizer = tokenizer
        if self.agent is None:
            self.task = self.dataset_task(t, self.rows, self.cursor, self.reward_runner)
            return
        check_sessions(self.cfg)  # the proxy must hold the runs in flight
        self.renderer = ChatRenderer(tokenizer)  # every rank: a template it refuses stops them all

    # -- what the run trains on -------------------------------------------------------------
    def describe(self) -> str:
        """What the run trains on, for the first log line."""
        t = self.cfg.trainer
        if t.dataset is None:
            return t.task
        if self.agent is not None:
            return f"agent {t.agent} over {t.dataset.path}"
        return f"{t.dataset.path} scored by {t.reward}"

    @property
    def vocab_size(self) -> int:
        """The largest token id the episodes may hold, plus one (an agent run: the tokenizer's)."""
        return self.task.vocab_size if self.task is not None else len(self.tokenizer)

    @property
    def max_new_tokens(self) -> int:
        return self.task.max_new_tokens if self.task is not None else self.cfg.trainer.max_new_tokens

    def dataset_task(
        self, settings: TrainerSettings, rows: Any, cursor: DataCursor | None, runner: RewardRunner | None
    ) -> Task:
        """The dataset scored by ``runner`` as a task, its rows picked by ``cursor``."""
        if runner is None or rows is None or cursor is None:
            raise TaskError("trainer.dataset without an agent needs trainer.reward (the config check says so)")
        task: Task = DatasetTask(rows, settings, self.tokenizer, runner, cursor)
        return task

    # -- the data position ------------------------------------------------------------------
    def resume(self, state: dict[str, Any] | None) -> None:
        """The data cursor, from a checkpoint's ``data.json`` (None: from the first row)."""
        if self.rows is None:
            return
        t = self.cfg.trainer
        assert t.dataset is not None
        n, gps = len(self.rows), t.groups_per_step
        if state is None:
            self.cursor = DataCursor(n, gps, shuffle=t.dataset.shuffle, seed=t.dataset.seed)
        else:
            try:
                self.cursor = DataCursor.from_state(state, n, gps, shuffle=t.dataset.shuffle, seed=t.dataset.seed)
            except ValueError as err:  # a data.json of another version: the line says to remove it
                raise TaskError(str(err)) from None
        if self.cursor.note:
            self.log(f"data: {self.cursor.note}")
        if isinstance(self.task, DatasetTask):
            self.task.cursor = self.cursor  # the dataset task plays on from here

    def row(self, step: int, group: int) -> dict[str, Any]:
        assert self.rows is not None and self.cursor is not None
        return dict(self.rows[self.cursor.row_index(step, group)])

    def save(self, path: Path, next_step: int) -> None:
        """The cursor's state into checkpoint ``path`` (a resumed run trains the next rows)."""
        if self.cursor is not None:
            (path / DATA_STATE).write_text(json.dumps(self.cursor.state(next_step)))

    def load(self, path: Path) -> None:
        """The cursor from checkpoint ``path`` (a run without a dataset keeps none)."""
        file = path / DATA_STATE
        if not file.is_file():
            return self.resume(None)
        try:
            state: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointUnreadableError(
                f"{file} cannot be read ({err}); it holds the position in the data"
            ) from None
        self.resume(state)

    # -- rewards ----------------------------------------------------------------------------
    def reward_failures(self) -> dict[str, int] | None:
        """The reward calls that failed so far, by reason (training and evaluation: one count)."""
        runners = {id(r): r for r in (self.reward_runner, self.eval_reward_runner) if r is not None}.values()
        failures: dict[str, int] | None = None
        for r in runners:
            failures = {k: (failures or {}).get(k, 0) + v for k, v in r.failures.items()}
        return failures

    def stop_rewards(self) -> None:
        """SIGTERM (from its handler): reward calls in progress end within the grace."""
        if self.reward_pool is not None:
            self.reward_pool.stop()

    def close(self) -> None:
        if self.reward_pool is not None:
            self.reward_pool.close()  # every worker process ends with the trainer
