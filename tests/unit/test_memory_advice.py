"""What fits instead (treetrain.alloc.advice.changes_that_fit) and ``treetrain memory``'s answer:
exit 1 and the changes that fit when ``--gpu-gib`` is given and the plan does not fit, exit 0
when it fits, a warning above every common GPU size without ``--gpu-gib``. Qwen3-8B's published
config; every suggestion is checked against the same estimate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from treetrain.alloc import parse
from treetrain.alloc.memory import GIB, changes_that_fit, estimate, exceeds_common_gpus
from treetrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
QWEN = str(ROOT / "examples/model-configs/qwen3-8b.json")


def qwen() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(Path(QWEN).read_text())
    return config


def test_each_change_fits_by_the_same_estimate() -> None:
    config, limit = qwen(), 80 * GIB
    plan = estimate(config, parse("megatron:d2t4"), tokens=16384, dtype="float32")
    assert plan.largest.total > limit
    changes = {c.change: c for c in changes_that_fit(config, plan, limit)}
    assert list(changes) == ["recompute", "dtype", "tokens", "layout"]
    for c in changes.values():
        p = c.plan
        again = estimate(config, p.allocation, tokens=p.tokens, dtype=p.dtype, recompute=p.recompute)
        assert c.total == again.largest.total <= limit
    assert changes["recompute"].plan.recompute and changes["recompute"].plan.dtype == "float32"
    assert changes["dtype"].value == "bfloat16" and not changes["dtype"].plan.recompute
    # The largest multiple of lcm(block 128, t 4) that fits: the next one does not.
    tokens = int(changes["tokens"].value)
    assert tokens % 128 == 0 and tokens < 16384
    bigger = estimate(config, plan.allocation, tokens=tokens + 128, dtype="float32")
    assert bigger.largest.total > limit
    layout = changes["layout"].plan.allocation
    assert layout.backend == "megatron" and layout.world_size == 8 and str(layout) == changes["layout"].value


def test_only_changes_that_apply_and_fit() -> None:
    config = qwen()
    fits = estimate(config, parse("megatron:d2t4"), tokens=16384)  # bf16: 52 GiB
    assert changes_that_fit(config, fits, 80 * GIB) == []
    # Already bf16 with recompute: neither is suggested again; tiny GPUs: nothing fits.
    plan = estimate(config, parse("megatron:d8"), tokens=16384, recompute=True)
    assert changes_that_fit(config, plan, 1 * GIB, max_gpus=16) == []
    kinds = [c.change for c in changes_that_fit(config, plan, 40 * GIB)]
    assert "recompute" not in kinds and "dtype" not in kinds and kinds


def test_common_gpu_sizes() -> None:
    assert not exceeds_common_gpus(192 * GIB) and exceeds_common_gpus(192 * GIB + 1)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["memory", "--model", QWEN, *args])
    return code, capsys.readouterr().out


def test_cli_does_not_fit_exits_1_and_names_what_would(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "--backend", "megatron:d8", "--max-tokens", "16384", "--gpu-gib", "80")
    assert code == 1
    assert "does NOT fit a 80 GiB GPU; each of these would:" in out
    assert "--recompute (model.gradientCheckpointing: true)" in out
    assert "(actor.treeTraining.maxTokensPerMicrobatch:" in out and "--backend megatron:" in out
    assert "dtype auto is planned as bfloat16" in out  # the default, said so
    code, out = run(capsys, "--backend", "megatron:d8", "--max-tokens", "16384", "--gpu-gib", "80", "--json")
    fit = json.loads(out)["fit"]
    assert code == 1 and not fit["fits"] and [c["change"] for c in fit["changes"]] == ["recompute", "tokens", "layout"]
    assert all(c["total"] <= fit["gpu_bytes"] for c in fit["changes"]) and fit["fits_instead"] == "megatron:d2t4"


def test_cli_fits_exits_0_and_warns_without_a_gpu_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "--backend", "megatron:d2t4", "--max-tokens", "16384", "--gpu-gib", "80")
    assert code == 0 and "fits a 80 GiB GPU" in out and "fp32 master weights in the optimizer" in out
    code, out = run(capsys, "--backend", "fsdp:d1", "--max-tokens", "16384")  # 245 GiB
    assert code == 0 and "warning: " in out and "more than every common GPU size (80, 96, 141, 192 GiB)" in out
    assert "parameters kept in float32 (fp32 master weights), computed in bfloat16" in out
    code, out = run(capsys, "--backend", "megatron:d2t4", "--max-tokens", "16384")
    assert code == 0 and "warning" not in out


def test_cli_bad_gpu_size_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--model", QWEN, "--backend", "fsdp:d8", "--max-tokens", "64", "--gpu-gib", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu-gib" in err and "fix" in err
