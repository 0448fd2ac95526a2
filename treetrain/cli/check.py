"""``treetrain check [CONFIG]``: what ``treetrain train`` would refuse, found without the model.

The config (the same schema, cross-section rules and environment as ``train``), every row of the
training and evaluation datasets, the user code the config names (the task, agent and reward
modules, imported; a task is not built) and an agent run's proxy session bound are checked; no
weights and no tokenizer are loaded, so it takes seconds.
Exit 0 with a short summary on stdout, or 2 with one line per problem on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

EXAMPLES = """\
examples:
  treetrain check examples/trainer-gsm8k.yaml
  treetrain check                  # $TREETRAIN_CONFIG, or the embedded default

Exit 0: the config, its rows and its code load; 2: one line per problem. docs/trainer.md
lists what is checked.
"""
PROG = "treetrain check"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check",
        help="check a trainer config, its dataset rows and its code, without loading the model",
        description="Check what `treetrain train CONFIG` reads before the model: the config, every dataset row, "
        "the task, agent and reward imports. Exit 0 when all load, 2 with one line per problem.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="trainer config YAML (default: $TREETRAIN_CONFIG)")
    p.set_defaults(func=run)


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the summary of what loaded


def run(args: argparse.Namespace) -> int:
    from treetrain import config as config_mod

    env = dict(os.environ)
    path = args.config or env.get("TREETRAIN_CONFIG") or None
    try:
        cfg, _ = config_mod.load(path, env=env) if path else config_mod.load_default(env=env)
    except config_mod.ConfigError as err:
        for where, message in err.problems:
            print(f"{PROG}: {where}: {message}" if where else f"{PROG}: {message}", file=sys.stderr)
        return 2
    report = inspect(cfg)
    if report.problems:
        for line in report.problems:
            print(f"{PROG}: {line}", file=sys.stderr)
        return 2
    print(f"{PROG}: {path or 'the embedded default'}: ok (the model was not loaded)")
    for line in report.lines:
        print(f"  {line}")
    return 0


def inspect(cfg: Any) -> Report:
    """Load what the config names, as the trainer does before its model; each failure one line."""
    t = cfg.trainer
    report = Report()
    report.lines.append(f"model: {cfg.model.path}, actor {cfg.actor.backend}")
    if t.dataset is None:
        _task(t.task, report)
    if t.agent is not None:
        _agent(cfg, report)
    if t.reward is not None:
        _reward(t.reward, t.reward_args, report)
    if t.dataset is not None:
        from treetrain.rl.rewards import reads_answer

        answer_for = t.reward if reads_answer(t.reward, t.reward_args) else None
        _rows("dataset", t.dataset, "trainer.dataset", (answer_for, t.max_episode_tokens), report)
        if t.eval is not None:
            _rows("eval", t.eval.dataset, "trainer.eval.dataset", (answer_for, t.max_episode_tokens), report)
    return report


def _task(spec: str, report: Report) -> None:
    if spec.startswith("builtin:"):  # the config check knows the built-in ones
        report.lines.append(f"task: {spec}")
        return
    from treetrain.rl.user_code import TaskError, import_spec

    try:
        module_name, attr, found = import_spec(spec, "task", TaskError, f"{spec!r} must be package.module:function")
    except TaskError as err:
        report.problems.append(f"trainer.task: {err}")
        return
    if not callable(found):
        report.problems.append(f"trainer.task: module {module_name!r} has no callable {attr!r}; fix: trainer.task")
        return
    report.lines.append(f"task: {spec} (imported; built when training starts)")


def _agent(cfg: Any, report: Report) -> None:
    from treetrain.rl.agent import load_agent
    from treetrain.rl.task import TaskError
    from treetrain.trainer.agents import check_sessions

    spec = cfg.trainer.agent
    try:
        load_agent(spec)
    except TaskError as err:
        report.problems.append(str(err))
        return
    try:
        check_sessions(cfg)  # the proxy must hold the runs in flight
    except TaskError as err:
        report.problems.append(str(err))
        return
    report.lines.append(f"agent: {spec} (an async def of (client, row))")


def _reward(spec: str, args: dict[str, Any], report: Report) -> None:
    from treetrain.rl.rewards import RewardError, load_reward, reads_answer

    try:
        load_reward(spec, args)
    except RewardError as err:
        report.problems.append(f"trainer.reward: {err}")
        return
    reads = "compares replies with each row's answer" if reads_answer(spec, args) else "gets the whole row"
    report.lines.append(f"reward: {spec} ({reads})")


def _rows(label: str, settings: Any, key: str, rules: tuple[str | None, int], report: Report) -> None:
    from treetrain.rl.dataset import ByteLimits, DatasetError, load_rows

    answer_for, max_episode_tokens = rules  # the trainer's: the reward that reads answers, the size bound
    try:
        rows: Any = load_rows(
            settings, key=key, answer_for=answer_for, limits=ByteLimits.for_episode(max_episode_tokens)
        )
    except DatasetError as err:
        report.problems.append(str(err))
        return
    columns = ", ".join(rows.column_names)
    report.lines.append(f"{label}: {settings.path}: {len(rows)} rows, columns {columns}")
