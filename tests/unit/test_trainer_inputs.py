"""Deterministic trainer failures (issue 21, item 8): every damaged input a user can hand the
trainer (model weights, checkpoint files, the checkpoint directory, a task module) is one line
naming the file or the task and the fix, exit 2 (a pod's restart would fail the same way), and
no traceback. Tiny models, one process; a few run as a real subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import merge, save_hf_model
from suite_helpers import small, subprocess_env

from treetrain.cli import main

pytestmark = pytest.mark.usefixtures("trainer_env")


def _config(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _one_line_exit_2(
    capsys: pytest.CaptureFixture[str], config: Path, *must: str, trained: bool = False
) -> tuple[str, str]:
    """Run ``treetrain train CONFIG`` in this process; exit 2, stderr one error line holding
    every string of ``must``, no traceback; (with ``trained`` False) no step was trained."""
    assert main(["train", str(config), "--no-compare"]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    errors = [line for line in lines if line.startswith("treetrain train: error: ")]
    assert len(errors) == 1, err
    for text in must:
        assert text in errors[0], errors[0]
    assert "fix:" in errors[0], errors[0]
    if not trained:
        assert "step 1/" not in out, out
    return errors[0], out


def _subprocess_exit_2(config: Path, *must: str) -> None:
    """The same, as a pod runs it: a fresh ``python -m treetrain.cli train`` process."""
    env = subprocess_env(outside_a_pod=True)
    done = subprocess.run(
        [sys.executable, "-m", "treetrain.cli", "train", str(config), "--no-compare"],
        capture_output=True,
        text=True,
        timeout=600,  # a deadline for a hang on a busy machine, not a speed test
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("treetrain train: error: ")]
    assert len(errors) == 1 and all(text in errors[0] for text in must), done.stderr[-3000:]


# -- model weights --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face Llama directory (config + model.safetensors) with the built-in's vocabulary."""
    fields = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    return save_hf_model(
        tmp_path_factory.mktemp("model"), "llama", **fields, num_hidden_layers=2, num_key_value_heads=2
    )


DAMAGE = {
    "truncated": (lambda good: good[: len(good) // 2], "(truncated)"),
    "garbage-header": (lambda good: b"\xff" * 8 + b"not a header" * 10, "its header claims"),
    "empty": (lambda good: b"", "it is empty"),
    "short-data": (lambda good: good[:-16], "(truncated)"),
    "header-not-json": (lambda good: len(b"{nope").to_bytes(8, "little") + b"{nope", "its header is not JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("backend", ["fsdp:d1", "archon:d1", "megatron:d1"])
def test_a_damaged_model_safetensors_is_one_line(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], damage: str, backend: str
) -> None:
    make, says = DAMAGE[damage]
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(make(weights.read_bytes()))
    cfg = merge(small(), {"model": {"path": str(model)}, "actor": {"backend": backend}})
    _one_line_exit_2(capsys, _config(tmp_path, cfg), f"{weights} is damaged", says, "copy the model directory again")


def test_a_whole_safetensors_file_passes_the_check(model_dir: Path) -> None:
    from treetrain.engines.weights import safetensors_problem

    assert safetensors_problem(model_dir / "model.safetensors") is None


def test_a_damaged_model_is_one_line_in_a_fresh_process(tmp_path: Path, model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "model.safetensors").write_bytes(b"")
    config = _config(tmp_path, merge(small(), {"model": {"path": str(model)}}))
    _subprocess_exit_2(config, f"{model / 'model.safetensors'} is damaged")


# -- checkpoint files and the checkpoint directory ------------------------------------------


def _checkpointed(tmp_path: Path, steps: int = 1) -> Path:
    """A checkpoint directory holding steps 1..steps (fsdp:d1, one process)."""
    ckpt = tmp_path / "ckpt"
    raw = merge(small(ckpt), {"checkpoint": {"intervalSteps": 1}, "trainer": {"steps": steps}})
    assert main(["train", str(_config(tmp_path, raw)), "--no-compare"]) == 0
    return ckpt


def _edit_meta(file: Path, edit: Any) -> None:
    meta = torch.load(file, weights_only=False)
    torch.save(edit(meta), file)


def _bad_python_rng(meta: dict[str, Any]) -> dict[str, Any]:
    meta["rng"]["python"] = "x"
    return meta


def _bad_torch_rng(meta: dict[str, Any]) -> dict[str, Any]:
    meta["rng"]["torch"] = torch.zeros(3, dtype=torch.uint8)
    return meta


def _no_steps(meta: dict[str, Any]) -> dict[str, Any]:
    del meta["steps"]
    return meta


META = {
    "a-list": (lambda meta: [1, 2], "it holds a list, not a dict"),
    "no-steps": (_no_steps, "'steps' must be an integer"),
    "bad-python-rng": (_bad_python_rng, "bad Python RNG state"),
    "bad-torch-rng": (_bad_torch_rng, "bad torch RNG state"),
}


@pytest.mark.parametrize("case", sorted(META))
def test_checkpoint_metadata_of_another_shape_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    edit, says = META[case]
    ckpt = _checkpointed(tmp_path)
    capsys.readouterr()
    meta = ckpt / "step-00000001" / "actor-rank0.pt"
    _edit_meta(meta, edit)
    config = _config(tmp_path, merge(small(ckpt), {"trainer": {"steps": 2}}))
    _one_line_exit_2(capsys, config, str(meta), says, f"move {meta.parent} out of checkpoint.dir")
    assert (ckpt / "latest").read_text().strip() == "step-00000001"  # nothing written over it


def test_a_binary_latest_file_is_one_line_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _checkpointed(tmp_path)
    capsys.readouterr()
    (ckpt / "latest").write_bytes(bytes(range(256)))
    config = _config(tmp_path, merge(small(ckpt), {"trainer": {"steps": 2}}))
    _one_line_exit_2(capsys, config, f"{ckpt / 'latest'} is not a checkpoint name", "delete it")
    _subprocess_exit_2(config, f"{ckpt / 'latest'} is not a checkpoint name")


def test_a_checkpoint_dir_below_a_file_fails_before_any_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    config = _config(tmp_path, small(a_file / "ckpt"))  # intervalSteps 2: today found after two steps
    _one_line_exit_2(capsys, config, f"checkpoint.dir {a_file / 'ckpt'} is below {a_file}, which is a file")


# -- task modules ---------------------------------------------------------------------------

# An episode that answers with ``prompt`` and ``reply`` (each a Python expression; ``self.turns``
# counts the replies), in a task of vocab_size 512; what each case breaks is spliced in. Every
# episode ends after its first reply on today's code too, so a check that is missing fails the
# test instead of running for ever.
TASK = """\
class Episode:
    turns = 0

    def prompt(self):
        return {prompt}

    def respond(self, response):
        self.turns += 1
        return {reply}


class Task:
    vocab_size = 512
    max_new_tokens = 4
    stop_token_ids = ()

    def episode(self, seed):
        return Episode()


def make():
    {make}
"""


def _task(prompt: str = "[1, 9, 10]", reply: str = "(None, 1.0)", make: str = "return Task()") -> str:
    return TASK.format(prompt=prompt, reply=reply, make=make)


TASKS = {
    "raises-on-import": ("raise RuntimeError('boom at import')\n", "RuntimeError: boom at import"),
    "syntax-error": ("def make(:\n", "SyntaxError at"),
    "factory-raises": (_task(make="raise RuntimeError('no dataset')"), "failed to build"),
    "prompt-of-strings": (_task(prompt="['a', 'b']"), "returned str 'a' at position 0, not a token id"),
    "token-out-of-vocabulary": (_task(prompt="[1, 99999]"), "token id 99999 at position 1, outside"),
    "respond-returns-none": (_task(reply="None"), "episode.respond() returned NoneType None"),
    "string-reward": (_task(reply="(None, '1.0')"), "returned the reward str '1.0'"),
    "empty-prompt": (_task(prompt="[]"), "returned an empty prompt"),
    "nan-reward": (_task(reply="(None, float('nan'))"), "returned the reward float nan"),
    "next-turn-of-floats": (
        _task(reply="([1.5], 1.0) if self.turns == 1 else (None, 1.0)"),
        "returned float 1.5 at position 0",
    ),
    "episode-returns-none": (_task().replace("return Episode()", "return None"), "has no prompt() method"),
}


@pytest.mark.parametrize("case", sorted(TASKS))
def test_a_broken_task_module_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    source, says = TASKS[case]
    module = "broken_task_" + case.replace("-", "_")
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = small()
    cfg["trainer"].update(task=f"{module}:make", taskArgs={}, steps=1)
    _one_line_exit_2(capsys, _config(tmp_path, cfg), module, says)


def test_a_broken_task_is_one_line_in_a_fresh_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reward_task.py").write_text(_task(reply="(None, '1.0')"))
    cfg = small()
    cfg["trainer"].update(task="reward_task:make", taskArgs={}, steps=1)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    _subprocess_exit_2(_config(tmp_path, cfg), "reward_task:make", "returned the reward str '1.0'")


def test_a_good_user_task_keeps_its_own_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from treetrain.rl.task import load_task

    (tmp_path / "good_task.py").write_text(_task() + "\nTask.turns = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task("good_task:make", {})
    assert (task.vocab_size, task.max_new_tokens, task.stop_token_ids) == (512, 4, ())
    assert task.turns == 7  # type: ignore[attr-defined]  # the task's own attribute, through the check
    episode = task.episode(0)
    assert episode.prompt() == [1, 9, 10] and episode.respond([3]) == (None, 1.0)


@pytest.mark.slow
def test_a_foreign_checkpoint_file_on_one_rank_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """torchrun, 2 CPU ranks: rank 1's metadata file is a list. Every rank stops with the same
    line (no rank left waiting in a collective for the one that stopped)."""
    from helpers import torchrun

    raw = merge(small(tmp_path / "ckpt"), {"actor": {"backend": "fsdp:d2"}, "trainer": {"steps": 1}})
    config = tmp_path / "c.yaml"
    first = torchrun(raw, config)
    assert first.returncode == 0, first.stderr[-3000:]
    meta = tmp_path / "ckpt" / "step-00000001" / "actor-rank1.pt"
    torch.save([1, 2], meta)
    # torchrun stops the other ranks (SIGTERM) on the first poll that finds one exited: poll
    # slowly, so a rank that is still unwinding from the same error is not cut short.
    second = torchrun(raw, config, "--steps", "2", restart=1, monitor_s=5)
    assert second.returncode != 0
    errors = [line for line in second.stderr.splitlines() if line.startswith("treetrain train: error: ")]
    # One line per rank: rank 0 (whose own file is fine) reached the same error, not a collective wait.
    assert len(errors) == 2 and all(f"{meta} is not a checkpoint file" in line for line in errors), second.stderr[
        -3000:
    ]
    # torchrun's summary: each rank exited 2, or (a loaded machine) was stopped after printing its line.
    codes = re.findall(r"^\s*exitcode\s+: (-?\d+)", second.stderr, re.MULTILINE)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, second.stderr[-3000:]
    assert "treetrain/" not in second.stderr.replace(str(tmp_path), ""), second.stderr[-3000:]  # no frame of ours
    assert "step 2/2" not in second.stdout
