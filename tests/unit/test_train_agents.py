"""`treetrain train` with agents and datasets: an agent's runs through rank 0's proxy train tree
packed on every engine, a dataset scored by a built-in reward trains without agent code, the
position in the data survives a resume, evaluation reports its reward, and a failing agent or
reward is counted while the run goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treetrain import config as C
from treetrain.rl.dataset import DataCursor
from treetrain.trainer.loop import Trainer, run_training
from treetrain.trainer.sources import DATA_STATE

HERE = Path(__file__).resolve().parent
QUESTIONS = [(a, b) for a in range(1, 5) for b in range(1, 3)]  # 8 rows


@pytest.fixture(autouse=True)
def _agents(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(HERE))
    for name in ("WORLD_SIZE", "TREETRAIN_RESTART", "TREETRAIN_ROLE", "TREETRAIN_CONFIG", *C.ENV_OVERRIDES):
        monkeypatch.delenv(name, raising=False)
    import agents_for_tests

    agents_for_tests.SEEN.clear()
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
    tmp: Path, backend: str = "fsdp:d1", checkpoint: dict[str, Any] | None = None, **trainer: Any
) -> C.TrainConfig:
    """SmolLM2-135M, 2 groups x 2 runs of a two-call agent, replies of up to 8 tokens."""
    raw: dict[str, Any] = {
        **({"checkpoint": checkpoint} if checkpoint else {}),
        "model": {"path": "builtin:smollm2-135m", "seed": 0},
        "actor": {"backend": backend, "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 1024}},
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
        summary = run_training(config(tmp_path, checkpoint=ckpt, eval=evaluation), out=out)
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
        resumed = run_training(config(tmp_path, checkpoint=ckpt, eval=evaluation, steps=3), resume=True, out=out)
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
