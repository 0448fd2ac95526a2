"""`treetrain alloc`: the docs/contracts.md contract, exit codes and frozen flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from treetrain.cli import build_parser, main

BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "treetrain"), *args], capture_output=True, text=True, timeout=60)


def test_acceptance_hybrid_json() -> None:
    out = run("alloc", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert (row["dp"], row["tp"], row["pp"], row["cp"], row["ep"], row["etp"]) == (4, 2, 2, 2, 2, 4)
    assert row["world_size"] == 32 and row["backend"] == "megatron" and row["kind"] == "training"
    assert row["attn"]["world_size"] == row["ffn"]["world_size"] == 32


def test_acceptance_sglang_json() -> None:
    out = run("alloc", "sglang:d2t4", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert (row["instances"], row["gpus_per_instance"], row["world_size"], row["kind"]) == (2, 4, 8, "inference")


@pytest.mark.parametrize(
    ("spec", "phrase"),
    [
        ("d4t2", "write fsdp:d4t2 or megatron:d4t2"),
        ("fsdp:d4p2", "fsdp does not support pipeline parallel"),
        ("fsdp.d4", "use ':' between backend and dims"),
        ("sglang:d4c2", "sglang takes only d (instances), t and p"),
        ("megatron:d2e3", "does not fit the GPU grid"),
    ],
)
def test_acceptance_bad_specs_exit_2_with_one_line(spec: str, phrase: str) -> None:
    out = run("alloc", spec)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert phrase in lines[0] and "column" in lines[0] and "fix:" in lines[0]
    assert "Traceback" not in out.stderr


# Frozen contract: the --json keys per kind, in order.
TRAINING_KEYS = ["spec", "backend", "kind", "dp", "tp", "pp", "cp", "ep", "etp", "world_size", "canonical"]
INFERENCE_KEYS = [*TRAINING_KEYS[:-1], "instances", "gpus_per_instance", "canonical"]
HYBRID_KEYS = [*TRAINING_KEYS[:-1], "attn", "ffn", "canonical"]


def test_json_keys_frozen(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "--json", "fsdp:d4", "sglang:d2", "megatron:(attn:d2|ffn:e2)"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [list(r) for r in rows] == [TRAINING_KEYS, INFERENCE_KEYS, HYBRID_KEYS]


def test_json_mixed_good_and_bad_keeps_order(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "--json", "fsdp:d4", "fsdp.d4", "vllm:t2"]) == 2
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["spec"] for r in rows] == ["fsdp:d4", "fsdp.d4", "vllm:t2"]
    assert set(rows[1]) == {"spec", "error", "column"} and rows[1]["column"] == 5
    assert "use ':' between backend and dims" in rows[1]["error"]


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "sglang:d2t4", "fsdp:d16", "--gpus-per-node", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "sglang:d2t4: inference dp=2 tp=4 pp=1 cp=1 ep=1 etp=1 world_size=8 (2 instances x 4 GPUs); "
        "2 pods x 4 GPUs on 1 node",
        "fsdp:d16: training dp=16 tp=1 pp=1 cp=1 ep=1 etp=1 world_size=16; 2 pods x 8 GPUs on 2 nodes",
    ]


def test_gpus_per_node_json_and_placement_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "--json", "--gpus-per-node", "8", "fsdp:d16", "fsdp:d12"]) == 2
    good, bad = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (good["pods"], good["gpus_per_pod"], good["nodes"]) == (2, 8, 2)
    assert "does not fill whole nodes of 8 GPUs" in bad["error"]


def test_migrate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "--migrate", "sglang:d4+fsdp:d4"]) == 0
    assert capsys.readouterr().out == "rollout:\n  backend: sglang:d4\nactor:\n  backend: fsdp:d4\n"


def test_migrate_bad_string(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", "--migrate", "sglang:d4+d4"]) == 2
    assert "backend missing" in capsys.readouterr().err


def test_no_spec_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc"]) == 2
    assert "give at least one SPEC" in capsys.readouterr().err


def _flags(parser: object) -> dict[str, list[str]]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sorted(s for a in sub._actions for s in a.option_strings)
    return out


def test_alloc_flags_frozen() -> None:
    assert _flags(build_parser())["alloc"] == sorted(["--gpus-per-node", "--json", "--migrate", "-h", "--help"])


def test_rljob_help_lists_its_commands() -> None:
    out = subprocess.run([str(BIN / "rljob"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert all(command in out.stdout for command in ("plan", "crd", "operator"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fsdp:d" + "9" * 4301, "is larger than any cluster; fix: sizes are at most 65536"),  # past int()'s digit limit
        ("sglang:d1000000", "size d1000000 is larger than any cluster"),
        ("fsdp:d1024t1024p2", "world size 2097152 (d*t*p*c) is larger than any cluster"),
    ],
)
def test_sizes_no_cluster_has_are_one_line_errors(spec: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["alloc", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.splitlines()) == 1 and len(err) < 300  # a long input is shortened, not echoed whole
