"""The step's RL health figures and where rank 0 writes them: the step line's parts, the figures
from a known reward table, the JSONL step log (resume included), TensorBoard and W&B (offline),
each written and then read back with the package's own reader; a missing package stops the run
with one line and exit 2."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import merge
from suite_helpers import small

from treetrain.cli import main
from treetrain.config.trainer_settings import MetricsSettings
from treetrain.engines.errors import EngineConfigError
from treetrain.metrics import StepRecord
from treetrain.rl.samples import Rollouts, Sample
from treetrain.trainer.lines import format_record, health_parts
from treetrain.trainer.step_log import (
    STEP_LOG_FILE,
    TRACKING_INSTALL,
    JsonlStepLog,
    SinkUnavailableError,
    StepSinks,
    check_sinks,
    drop_after,
    record_figures,
    rollout_signals,
)


def record(step: int = 3, **stats: float) -> StepRecord:
    return StepRecord(
        step=step, reward=0.25, loss=0.0123, tree_token_ratio=0.4, original_tokens=1000, seconds=2.0,
        rollout_seconds=1.5, train_seconds=0.5, grad_norm=0.84, stats=dict(stats), response_lengths=(30, 29, 64),
        groups=8, zero_signal_groups=3,
    )  # fmt: skip


HEALTH = {"entropy": 1.234, "kl": 0.00104, "clip_fraction": 0.02, "ratio": 1.0, "ratio_max": 1.31}


# -- the step line --------------------------------------------------------------------------


def test_the_step_line_shows_the_rl_health_after_the_loss() -> None:
    line = format_record(record(**HEALTH), 10)
    assert line.startswith(
        "step  3/10 | reward 0.250 | loss +0.0123 | ent 1.23 kl 0.00104 clip 0.02 ratio 1.00/1.31 gnorm 0.84 | "
        "len 41/64 | no-signal 3/8 groups | tree_token_ratio 0.400 | "
    ), line


def test_figures_a_step_did_not_measure_are_left_out_but_the_signal_part_always_shows() -> None:
    rec = record(entropy=2.0, clip_fraction=0.0, ratio=1.0, ratio_max=1.0)  # no reference model: no kl
    rec.zero_signal_groups = rec.groups  # a reward stuck at 0: no group has a signal
    rec.response_lengths = ()
    assert health_parts(rec) == "ent 2 clip 0 ratio 1.00/1.00 gnorm 0.84 | no-signal 8/8 groups"
    rec.dropped_filtered = 5  # dynamic sampling dropped some, played others instead
    assert health_parts(rec).endswith("| no-signal 8/8 groups, 5 dropped")


# -- the figures ----------------------------------------------------------------------------


def test_zero_signal_groups_and_reply_lengths_from_a_known_reward_table() -> None:
    # Groups 0..3 of 3 episodes each; every episode one turn except episode 4 (two turns).
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0, 0.0]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    samples = [Sample(episode=e, tokens=[1] * (10 + e), prompt_len=10, logprobs=[0.0] * (10 + e)) for e in range(12)]
    samples.append(Sample(episode=4, tokens=[1] * 40, prompt_len=30, logprobs=[0.0] * 40))
    signals = rollout_signals(Rollouts(samples=samples, rewards=rewards, groups=groups))
    # Groups 1 (all 0) and 2 (all 0.5) have equal rewards: no group-relative signal.
    assert signals["groups"] == 4 and signals["zero_signal_groups"] == 2
    assert signals["response_lengths"] == (*range(12), 10)  # one per trained sample: its last reply


def test_record_figures_name_every_figure() -> None:
    rec = record(**HEALTH, behav_mismatch=1e-6, behav_mismatch_max=2e-5, eval_reward=0.5)
    figures = record_figures(rec)
    assert figures["importance_ratio_mean"] == 1.0 and figures["importance_ratio_max"] == 1.31
    assert figures["logprob_mismatch_mean"] == 1e-6 and figures["logprob_mismatch_max"] == 2e-5
    assert figures["response_length_mean"] == 41 and figures["response_length_max"] == 64
    assert (figures["groups"], figures["zero_signal_groups"], figures["samples"]) == (8, 3, 3)
    assert (figures["entropy"], figures["kl"], figures["grad_norm"], figures["eval_reward"]) == (
        1.234,
        0.00104,
        0.84,
        0.5,
    )
    assert (figures["reward"], figures["loss"], figures["tokens"], figures["seconds"]) == (0.25, 0.0123, 1000, 2.0)
    assert "kl" not in record_figures(record(entropy=1.0))  # not measured: absent, not 0


# -- the JSONL step log ---------------------------------------------------------------------


def test_the_step_log_appends_one_object_per_step_and_a_resume_drops_the_steps_it_trains_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / STEP_LOG_FILE
    said: list[str] = []
    sink = JsonlStepLog(path, start=0, log=said.append)
    for step in (1, 2, 3):
        sink.write(step, {"reward": step / 4, "loss": math.nan})
    sink.close()
    with path.open("a") as f:
        f.write('{"step": 4, "rew')  # torn by a crash in the middle of a write
    lines = [json.loads(line) for line in path.read_text().splitlines()[:3]]
    assert [(r["step"], r["reward"], r["loss"]) for r in lines] == [(1, 0.25, None), (2, 0.5, None), (3, 0.75, None)]
    assert all(isinstance(r["time"], float) for r in lines)

    # Resumed from the checkpoint of step 2: steps 3 and the torn 4 go, the run appends from 3.
    sink = JsonlStepLog(path, start=2, log=said.append)
    sink.write(3, {"reward": 1.0})
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert said == [f"{path}: dropped 2 line(s) after step 2, which this run trains again"]
    assert drop_after(path, 3) == 0 and drop_after(tmp_path / "none.jsonl", 0) == 0


def test_the_step_log_needs_checkpoint_dir_and_can_be_turned_off(tmp_path: Path) -> None:
    assert StepSinks.open(MetricsSettings(), None).sinks == []
    assert StepSinks.open(MetricsSettings(step_log=False), str(tmp_path)).sinks == []
    sinks = StepSinks.open(MetricsSettings(), str(tmp_path / "new"))
    sinks.write(1, {"reward": 0.5})
    sinks.close()
    assert json.loads((tmp_path / "new" / STEP_LOG_FILE).read_text())["reward"] == 0.5


# -- TensorBoard and W&B, read back with their own readers ----------------------------------


def test_tensorboard_scalars_read_back_and_a_resume_purges_the_steps_trained_again(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    settings = MetricsSettings(tensorboard_dir=str(logdir), step_log=False)
    sinks = StepSinks.open(settings, None)
    for step in (1, 2, 3):
        sinks.write(step, {"reward": step / 4, "treetrain/entropy": 1.0 + step})
    sinks.close()
    sinks = StepSinks.open(settings, None, start=2)  # resumed from step 2: step 3 is trained again
    sinks.write(3, {"reward": 0.125, "treetrain/entropy": 9.0})
    sinks.close()
    events = EventAccumulator(str(logdir))
    events.Reload()
    assert {"reward", "treetrain/entropy"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.125)]
    assert [e.value for e in events.Scalars("treetrain/entropy")] == [2.0, 3.0, 9.0]


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B ``.wandb`` run file: a 7-byte header (``:W&B``, a magic
    number, a version), then LevelDB-style log blocks of 32 KiB whose records carry a 7-byte
    header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out: list[Any] = []
    pos, part = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


@pytest.mark.slow
def test_wandb_offline_writes_every_step_with_no_network(tmp_path: Path) -> None:
    """Offline mode: a run directory under checkpoint.dir (wandb.dir unset), its history holding
    each step's figures at that step. The client runs for real (its service process included);
    nothing is sent anywhere."""
    settings = MetricsSettings.model_validate({"stepLog": False, "wandb": {"project": "h5-test"}})
    sinks = StepSinks.open(settings, str(tmp_path))
    sinks.write(1, {"reward": 0.25, "entropy": 1.5})
    sinks.write(2, {"reward": 0.5, "entropy": 1.25})
    sinks.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = []
    for rec in wandb_records(run_file):
        if rec.WhichOneof("record_type") == "history":
            # A key is either plain or nested (a path of parts; W&B's own _step is one).
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.append((items["_step"], items["reward"], items["entropy"]))
    assert history == [(1, 0.25, 1.5), (2, 0.5, 1.25)]


# -- a sink whose package is missing --------------------------------------------------------


@pytest.mark.parametrize("package", ["wandb", "tensorboard"])
def test_a_missing_package_is_one_line_naming_the_extra(package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # sys.modules[name] = None is how Python marks a module that cannot be imported: the real
    # import machinery then fails as if the package were not installed.
    monkeypatch.setitem(sys.modules, package, None)
    if package == "tensorboard":
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    key = {"wandb": {"wandb": {}}, "tensorboard": {"tensorboardDir": "/nonexistent/tb"}}[package]
    settings = MetricsSettings.model_validate(key)
    for attempt in (lambda: check_sinks(settings), lambda: StepSinks.open(settings, None)):
        with pytest.raises(SinkUnavailableError, match=f"the {package} package is not installed") as err:
            attempt()
        assert TRACKING_INSTALL in str(err.value) and "\n" not in str(err.value)
    assert issubclass(SinkUnavailableError, EngineConfigError)  # what `treetrain train` exits 2 on


def test_train_exits_2_before_any_step_when_a_sink_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(merge(small(tmp_path / "ckpt"), {"trainer": {"metrics": {"wandb": {}}}})))
    assert main(["train", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"fix: {TRACKING_INSTALL}" in captured.err and "Traceback" not in captured.err
    assert "step 1/" not in captured.out and not (tmp_path / "ckpt" / STEP_LOG_FILE).exists()
