"""`treetrain train` with agents and datasets: an agent's runs through rank 0's proxy train tree
packed on every engine, a dataset scored by a built-in reward trains without agent code, the
position in the data survives a resume, evaluation reports its reward, and a failing agent or
reward is counted while the run goes on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from treetrain import config as C
from treetrain.rl.dataset import DataCursor
from treetrain.rl.task import TaskError
from treetrain.trainer.data import DATA_STATE
from treetrain.trainer.loop import Trainer
from treetrain.trainer.run import run_training

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
QUESTIONS = [(a, b) for a in range(1, 5) for b in range(1, 3)]  # 8 rows


@pytest.fixture(autouse=True)
def _agents(monkeypatch: pytest.MonkeyPatch, trainer_env: None) -> Any:
    monkeypatch.syspath_prepend(str(HERE))
    import agents_for_tests

    agents_for_tests.SEEN.clear()
    agents_for_tests.RUNS.clear()
    return agents_for_tests


def rows(prefix: str = "r") -> list[dict[str, Any]]:
    return [
        {"id": f"{prefix}{i}", "prompt": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}
        for i, (a, b) in enumerate(QUESTIONS)
    ]


def jsonl(path: Path, prefix: str = "r") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(prefix)))
    return path


def config(
    tmp: Path,
    backend: str = "fsdp:d1",
    top: dict[str, Any] | None = None,
    lora: dict[str, Any] | None = None,
    **trainer: Any,
) -> C.TrainConfig:
    """SmolLM2-135M, 2 groups x 2 runs of a two-call agent, replies of up to 8 tokens."""
    tree = {"enabled": True, "maxTokensPerMicrobatch": 1024}
    raw: dict[str, Any] = {
        **(top or {}),
        "model": {"path": "builtin:smollm2-135m", "seed": 0},
        "actor": {"backend": backend, "treeTraining": tree, **({"lora": lora} if lora else {})},
        "trainer": {
            "steps": 2,
            "agent": "agents_for_tests:two_turns",
            "dataset": {"path": str(jsonl(tmp / "train.jsonl"))},
            "groupsPerStep": 2,
            "groupSize": 2,
            "maxNewTokens": 8,
            "optimizer": {"lr": 1e-5},
            "metrics": {"enabled": False},
            "proxy": {"port": 0},
            "threads": 1,
            **trainer,
        },
    }
    return C.validate(raw)


def step_lines(out: Path) -> list[str]:
    return [line for line in out.read_text().splitlines() if line.startswith("step ")]


def trained_rows(seen: list[str]) -> list[str]:
    return [s for s in seen if s.startswith("r")]


@pytest.mark.slow
def test_an_agent_trains_tree_packed_evaluates_and_resumes_with_the_next_rows(tmp_path: Path, _agents: Any) -> None:
    """Two calls per run (the second extends the first reply): 2 steps train, the runs of a group
    share their prefix (tree_token_ratio < 1), the eval line comes on eval steps, every checkpoint
    keeps the data position, and the resumed step 3 trains the next rows, none repeated."""
    evaluation = {"dataset": {"path": str(jsonl(tmp_path / "eval.jsonl", "e"))}, "everySteps": 2, "samples": 2}
    ckpt = {"dir": str(tmp_path / "ckpt"), "intervalSteps": 1}
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        summary = run_training(config(tmp_path, top={"checkpoint": ckpt}, eval=evaluation), out=out)
    assert [r.step for r in summary.records] == [1, 2]
    assert all(0 < r.tree_token_ratio < 1 and r.original_tokens > 0 for r in summary.records)
    lines = step_lines(log)
    assert len(lines) == 2 and "eval reward" not in lines[0] and " | eval reward " in lines[1]
    assert 0.0 <= summary.records[1].stats["eval_reward"] <= 1.0
    first = trained_rows(_agents.SEEN)
    assert len(first) == 2 * 2 * 2  # steps x groups x runs; a group's runs share their row
    assert first[0] == first[1] and first[2] == first[3]
    assert sorted(s for s in _agents.SEEN if s.startswith("e")) == ["e0", "e1"]
    assert any(line.startswith("proxy: http://127.0.0.1:") for line in log.read_text().splitlines())
    for step in (1, 2):
        state = json.loads((tmp_path / "ckpt" / f"step-{step:08d}" / DATA_STATE).read_text())
        assert state["next_step"] == step

    _agents.SEEN.clear()
    with log.open("w") as out:
        resumed = run_training(
            config(tmp_path, top={"checkpoint": ckpt}, eval=evaluation, steps=3), resume=True, out=out
        )
    assert resumed.start_step == 2 and [r.step for r in resumed.records] == [3]
    third = trained_rows(_agents.SEEN)
    cursor = DataCursor(len(QUESTIONS), 2, shuffle=True, seed=0)
    want = [f"r{cursor.row_index(2, g)}" for g in (0, 1) for _ in range(2)]
    assert third == want, (third, want)
    assert not set(third) & set(first)  # within one epoch of 8 rows no row trains twice
    assert " | eval reward " in step_lines(log)[0]


@pytest.mark.slow
def test_a_parquet_dataset_trains_with_a_builtin_reward_and_no_agent(tmp_path: Path) -> None:
    """No agent code: each row's prompt gets one reply per run, scored by builtin:math; the
    evaluation plays the dataset task greedily."""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows()), path)
    cfg = config(
        tmp_path,
        agent=None,
        dataset={"path": str(path)},
        reward="builtin:math",
        eval={"dataset": {"path": str(path)}, "everySteps": 1, "samples": 2},
    )
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        summary = run_training(cfg, out=out)
    assert [r.step for r in summary.records] == [1, 2]
    assert all(0 < r.tree_token_ratio < 1 for r in summary.records)  # a group's replies share the prompt
    assert all(" | eval reward " in line for line in step_lines(log))
    assert "scored by builtin:math" in log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["archon:d1", "megatron:d1"])
def test_the_agent_trains_on_every_engine(tmp_path: Path, backend: str, _agents: Any) -> None:
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        summary = run_training(config(tmp_path, backend, steps=1), out=out)
    assert [r.step for r in summary.records] == [1]
    assert 0 < summary.records[0].tree_token_ratio < 1
    assert len(trained_rows(_agents.SEEN)) == 4


@pytest.mark.slow
def test_agent_groups_play_ahead_with_rollout_servers(tmp_path: Path, _agents: Any) -> None:
    """maxStaleness 1 against the rollout stand-in: the controller plays agent groups of the next
    step while the trainer trains, through the same proxy; step 2 trains samples one step stale."""
    sys.path.insert(0, str(ROOT / "bench"))
    from rollout_standin import RolloutStandin

    rollout = {"kind": "sglang", "timeoutSeconds": 60, "retries": 1, "readyTimeoutSeconds": 60, "maxStaleness": 1}
    with RolloutStandin(token_delay_s=0.002, vocab=49152, seed=0) as server:
        servers = {"servers": [{"url": server.url, "kind": "sglang"}], "weightSync": {"method": "disk"}}
        top = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "intervalSteps": 1000}, "rollout": servers}
        lines: list[str] = []
        trainer = Trainer(config(tmp_path, top=top, rollout=rollout), log=lines.append)
        try:
            records = trainer.run().records
        finally:
            trainer.close()
    assert [r.step for r in records] == [1, 2]
    assert [r.stats["staleness_max"] for r in records] == [0.0, 1.0]
    assert len(trained_rows(_agents.SEEN)) == 2 * 2 * 2


@pytest.mark.slow
def test_a_failing_agent_and_a_failing_reward_are_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    """Rows r0, r1, r2 (no shuffle): the agent crashes on r1 (both runs left out of the group), the
    reward raises on r2 (both runs score 0, counted); r0's group trains."""
    cfg = config(
        tmp_path,
        steps=1,
        agent="agents_for_tests:flaky",
        reward="agents_for_tests:failing_reward",
        dataset={"path": str(jsonl(tmp_path / "train.jsonl")), "shuffle": False},
        groupsPerStep=3,
    )
    lines: list[str] = []
    trainer = Trainer(cfg, log=lines.append)
    try:
        summary = trainer.run()
        value = trainer.metrics.registry.get_sample_value
        assert value("treetrain_reward_failures_total", {"reason": "error"}) == 2
        assert value("treetrain_reward_failures_total", {"reason": "timeout"}) == 0
        assert value("treetrain_proxy_requests_total", {"code": "200"}) == 6
        assert value("treetrain_proxy_sessions_open") == 0
    finally:
        trainer.close()
    assert [r.step for r in summary.records] == [1]
    crashed = [line for line in lines if "raised RuntimeError: tool crashed on r1" in line]
    assert len(crashed) == 2 and all(line.startswith("agent: step 1, group 1, run ") for line in crashed)
    assert len([line for line in lines if line.startswith("reward error at ")]) == 2


# -- the agent runner, against the real proxy with a scripted model (fast) ------------------


@pytest.fixture(scope="module")
def renderer() -> Any:
    from treetrain.engines.builtin import load_tokenizer
    from treetrain.proxy.chat import ChatRenderer

    return ChatRenderer(load_tokenizer("builtin:smollm2-135m"))


def test_a_runs_reward_comes_from_the_agent_its_posts_the_reward_function_or_zero(renderer: Any, _agents: Any) -> None:
    """Returned float; else the session reward posted; else the mean of the completions' posted
    rewards; else trainer.reward on the last reply; else 0.0 with a line. A crash, a hang past
    the timeout or a result that is no number leaves the run out of its group (no samples)."""
    from proxy_helpers import Scripted, serving

    from treetrain.trainer.agents import Job, group_rollouts, run_agents

    class Runner:  # stands in for trainer.reward: scores the last reply's text
        def __init__(self) -> None:
            self.texts: list[str] = []

        def score(self, completion: str, row: dict[str, Any], where: str) -> float:
            self.texts.append(completion)
            return 0.75

    hows = ["returned", "session", "completions", "reward", "wrong", "crash"]
    lines: list[str] = []
    runner = Runner()
    with serving(Scripted(renderer, ["It is 4.", "Yes: 4."]), renderer) as server:

        def jobs(names: list[str]) -> list[Job]:
            row = {"prompt": "2+2?", "session_of": lambda key: server.service.store.authenticate(key).id}
            return [Job(row={**row, "how": h}, seed=i, where=h) for i, h in enumerate(names)]

        runs = run_agents(
            _agents.rewards_by_row, jobs(hows), server=server, timeout_s=60.0, reward_runner=runner, log=lines.append
        )
        [none] = run_agents(
            _agents.rewards_by_row, jobs(["none"]), server=server, timeout_s=60.0, reward_runner=None, log=lines.append
        )
        [hang] = run_agents(
            _agents.rewards_by_row, jobs(["hang"]), server=server, timeout_s=0.5, reward_runner=None, log=lines.append
        )
        assert server.stats.snapshot()["sessions_open"] == 0
    by = dict(zip(hows, runs, strict=True))
    assert [by[h].reward for h in hows[:4]] + [none.reward] == [0.25, 0.5, 0.5, 0.75, 0.0]
    assert runner.texts == ["Yes: 4."]  # the last completion's text
    assert "agent: none: no reward (the agent returned None and posted none); scored 0.0" in lines
    assert all(len(r.records) == 2 and r.error is None for r in [*runs[:4], none])
    assert [h for h in hows if by[h].error] == ["wrong", "crash"] and hang.error is not None
    assert not any(r.records for r in (by["wrong"], by["crash"], hang))
    assert any(line.startswith("agent: hang: did not finish within") for line in lines)
    assert any(line.startswith("agent: crash: raised KeyError") for line in lines)
    assert any(line.startswith("agent: wrong: returned str") for line in lines)
    rollouts = group_rollouts([*runs, none, hang], 3, 8)
    assert rollouts.rewards == [0.25, 0.5, 0.5, 0.75, 0.0] and rollouts.groups == [3] * 5
    assert len(rollouts.samples) == 10 and {s.episode for s in rollouts.samples} == set(range(5))
    first, second = rollouts.samples[0], rollouts.samples[1]
    assert second.tokens[: first.prompt_len] == first.tokens[: first.prompt_len]
    # Token-aligned as the proxy recorded it: the sampler's log-probs on the reply, 0.0 on the prompt.
    assert len(first.logprobs) == len(first.tokens) and first.version == 7
    assert set(first.logprobs[: first.prompt_len]) == {0.0} and all(
        lp != 0.0 for lp in first.logprobs[first.prompt_len :]
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must be package.module:function"),
        ("no_such_module_xyz:run", "cannot import agent module 'no_such_module_xyz'"),
        ("agents_for_tests:missing", "has no 'missing'"),
        ("agents_for_tests:failing_reward", "is not an async def"),
        ("agents_for_tests:one_argument", "must take two arguments"),
    ],
)
def test_an_agent_that_cannot_load_is_one_line_with_the_fix(spec: str, message: str) -> None:
    from treetrain.rl.agent import AgentError, load_agent

    with pytest.raises(AgentError) as err:
        load_agent(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


def _lockstep_rank(rank: int, port: int, out: Any) -> None:
    """One rank of the lockstep test: rank 0 leads three calls from a proxy-like thread."""
    import threading

    import torch.distributed as dist

    from treetrain.rl.rollout import Generation, SamplingParams
    from treetrain.trainer.lockstep import Lockstep

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    calls: list[tuple[list[list[int]], int, int]] = []

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        calls.append((prompts, params.max_new_tokens, seed))
        return [Generation(tokens=[rank], logprobs=[0.0]) for _ in prompts]

    lockstep = Lockstep(generate, 2)
    got: list[list[int]] = []
    if rank == 0:

        def lead() -> None:
            for k in range(3):
                got.append(lockstep.lead([[k, k]], SamplingParams(max_new_tokens=k + 1), 10 + k)[0].tokens)

        thread = threading.Thread(target=lead)
        thread.start()
        thread.join()
        lockstep.stop()
    else:
        lockstep.follow()
    out.put((rank, calls, got))
    dist.destroy_process_group()


def test_the_lockstep_mirrors_rank_0s_generate_calls_on_the_other_ranks() -> None:
    """Local rollout of a sharded model: every generate call rank 0's proxy makes (from its own
    thread) runs on every rank, and the other ranks return once rank 0 stops them."""
    import multiprocessing

    from suite_helpers import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_lockstep_rank, args=(rank, port, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = {rank: (calls, got) for rank, calls, got in (out.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=60)
    want = [([[k, k]], k + 1, 10 + k) for k in range(3)]
    assert results[0][0] == want and results[1][0] == want
    assert results[0][1] == [[0], [0], [0]]  # rank 0 keeps its own result
    assert all(p.exitcode == 0 for p in procs)


def test_dynamic_sampling_replaces_an_agent_group_without_signal(tmp_path: Path, renderer: Any, _agents: Any) -> None:
    """The synchronous agent step drops a group whose runs all scored the same and plays a
    replacement row: the group scheduler's one policy, inline, for agents as for tasks."""
    from proxy_helpers import Scripted, serving

    from treetrain.engines.builtin import load_tokenizer
    from treetrain.rl.algorithm import Algorithm
    from treetrain.rl.scheduler import GroupScheduler
    from treetrain.trainer.agents import AgentSource
    from treetrain.trainer.data import RunData

    cfg = config(
        tmp_path,
        agent="agents_for_tests:informative_unless_r0",
        dataset={"path": str(jsonl(tmp_path / "train.jsonl")), "shuffle": False},
        dynamicSampling=True,
    )
    lines: list[str] = []
    t = cfg.trainer
    data = RunData(cfg, lambda: load_tokenizer("builtin:smollm2-135m"), lines.append)
    assert data.agent is not None and data.cursor is not None
    try:
        with serving(Scripted(renderer, ["4"]), renderer) as server:
            source = AgentSource(
                data.agent, server, t, row=data.row, reward_runner=data.reward_runner, log=lines.append
            )
            keep = Algorithm(t, actor=None).keep  # type: ignore[arg-type]  # only the keep rule is read
            scheduler = GroupScheduler(
                source, task="agent", episode_timeout_s=60.0, groups_per_step=2, max_staleness=0, steps=1, keep=keep
            )
            rollouts = scheduler.take(0)
    finally:
        data.close()
    assert scheduler.dropped["filtered"] == 1
    assert sorted(set(rollouts.groups)) == [1, 2] and len(rollouts.rewards) == 4
    replacement = f"r{data.cursor.row_index(0, 2)}"
    assert _agents.SEEN[:4] == ["r0", "r0", "r1", "r1"] and _agents.SEEN[4:] == [replacement] * 2


def test_a_proxy_too_small_for_the_runs_in_flight_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    cfg = config(tmp_path, groupsPerStep=4, groupSize=4, proxy={"port": 0, "maxSessions": 8})
    with pytest.raises(TaskError) as err:
        Trainer(cfg, log=lambda line: None)
    assert "trainer.proxy.maxSessions (8)" in str(err.value) and "to 16 or more" in str(err.value)


def raw_config(tmp: Path, **trainer: Any) -> dict[str, Any]:
    """``config()`` as the YAML a user writes (camelCase keys, unset ones left out)."""
    return config(tmp, **trainer).model_dump(mode="json", by_alias=True, exclude_unset=True)


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        (
            {"agent": "agents_for_tests:failing_reward"},
            "trainer.agent 'agents_for_tests:failing_reward' is not an async",
        ),
        ({"dataset": {"path": "MISSING/rows.jsonl"}}, "no such file or directory"),
        ({"agent": None, "reward": "agents_for_missing_tests:score"}, "agents_for_missing_tests"),
    ],
    ids=["not-async", "no-dataset", "no-reward-module"],
)
def test_train_exits_2_with_one_line_for_an_agent_dataset_or_reward_that_cannot_load(
    tmp_path: Path, trainer: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from treetrain.cli import main

    raw = raw_config(tmp_path, **trainer)
    if "dataset" in trainer:
        raw["trainer"]["dataset"]["path"] = str(tmp_path / trainer["dataset"]["path"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_an_agent_samples_with_the_adapter_being_trained(tmp_path: Path, _agents: Any) -> None:
    """actor.lora with local rollout: the agent's calls to the trainer's endpoint sample from the
    model with its adapter. The trainer starts from a random adapter (B not zero), so its samples'
    log-probs equal the adapted model's only if the endpoint applied it (mismatch at float
    rounding); from the base they would differ by the whole adapter."""
    from helpers.lora import ALPHA, RANK, save_adapter

    from treetrain.engines import builtin

    adapter = save_adapter(Path(builtin.local_dir("builtin:smollm2-135m")), tmp_path / "adapter")
    trainer = Trainer(config(tmp_path, lora={"rank": RANK, "alpha": ALPHA}, steps=1), log=lambda _: None)
    try:
        trainer.actor.load_adapter(adapter)
        records = trainer.run().records
    finally:
        trainer.close()
    assert [r.step for r in records] == [1]
    assert records[0].stats["behav_mismatch_max"] < 1e-3, records[0].stats
    assert len(trained_rows(_agents.SEEN)) == 2 * 2
