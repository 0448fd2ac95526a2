"""`rljob crd` and `rljob plan`: the docs/contracts.md contracts, the committed CRD, operator metrics."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rljob_operator.cli import main
from rljob_operator.crd import crd, crd_yaml, reference_table
from rljob_operator.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_committed_crd_is_fresh() -> None:
    committed = (ROOT / "crds" / "rljob.yaml").read_text()
    assert committed == crd_yaml(), "crds/rljob.yaml is stale: run `rljob crd > crds/rljob.yaml`"


def test_crd_shape() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == "rljobs.treetrain.dev"
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("RLJob", "rljobs", ["rlj"])
    (version,) = doc["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "GPUs", "Rollout", "Actor", "Restarts", "Age",
    ]  # fmt: skip
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert set(spec["required"]) == {"model", "rollout", "actor"}
    assert props["gpusPerNode"] == {"type": "integer", "default": 8, "minimum": 1, "maximum": 64,
                                    "description": props["gpusPerNode"]["description"]}  # fmt: skip
    assert props["gpuResourceName"]["default"] == "nvidia.com/gpu"
    assert props["actor"]["properties"]["treeTraining"]["default"] == {}
    assert props["actor"]["properties"]["treeTraining"]["properties"]["attention"]["enum"] == [
        "auto", "flex", "triton", "sparse", "dense",
    ]  # fmt: skip
    assert props["trainerConfig"]["x-kubernetes-preserve-unknown-fields"] is True
    assert props["additionalRollouts"]["x-kubernetes-list-map-keys"] == ["name"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert any("self.rollout.backend.startsWith('sglang:')" in r for r in rules)

    def walk(node: object) -> None:  # structural: no refs, no titles, no unions
        if isinstance(node, dict):
            assert not {"$ref", "title", "anyOf", "$defs"} & set(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(version["schema"])


def test_plan_json_matches_design(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples" / "rljob.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["components", "total_gpus", "weight_sync", "checkpoints", "trainer"]
    assert out["total_gpus"] == 16
    assert out["weight_sync"]["world_size"] == 9 and out["checkpoints"]["persistent"] is False
    for row in out["components"].values():
        assert {"backend", "gpus", "pods", "gpus_per_pod", "nodes"} <= set(row)
    assert out["trainer"] == {
        "episodes": "task builtin:parity", "dataset": None, "reward": None, "algorithm": "grpo", "steps": 100,
        "groups_per_step": 8, "group_size": 4, "dtype": "bfloat16", "gradient_checkpointing": True,
        "max_tokens_per_microbatch": 32768,
    }  # fmt: skip


def test_plan_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples" / "rljob.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "RLJob default/demo: 16 GPUs"
    assert lines[2].split() == ["rollout", "sglang:d2t4", "8", "2", "4", "1"]
    # How the weights reach the servers, and that checkpoints die with the pod (no volume).
    assert lines[4] == (
        "weight sync: distributed, rendezvous demo-trainer-0.demo-trainer.default.svc:29600, world size 9 "
        "(trainer 0, rollout 1-8)"
    )
    assert lines[5].startswith("checkpoints: ephemeral: ") and "starts from step 0" in lines[5]
    # What the trainer pods run, from the ConfigMap's config.
    assert lines[6] == (
        "trainer: task builtin:parity, grpo, 100 steps of 8 groups x 4 samples; bfloat16, gradient checkpointing, "
        "micro-batches of 32768 tokens"
    )
    assert lines[7] == "memory: not checked (no model config: give spec.model.config (or rljob plan --model-config))"


def test_plan_text_of_an_agent_rljob(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples" / "rljob-agent.yaml")]) == 0
    trainer = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trainer: ")]
    assert trainer == [
        "trainer: agent calculator_agent:run on /data/train.jsonl, reward builtin:math, grpo, 200 steps of 16 groups "
        "x 8 samples; bfloat16, no gradient checkpointing, micro-batches of 16384 tokens"
    ]


def test_plan_config_prints_the_configmap_config(capsys: pytest.CaptureFixture[str]) -> None:
    from rljob_operator.plan import plan

    path = ROOT / "examples" / "rljob.yaml"
    assert main(["plan", str(path), "--config"]) == 0
    out = capsys.readouterr().out
    head = "trainer config (ConfigMap demo-config, config.yaml):\n"
    assert head in out
    (config_map,) = [o for o in plan(yaml.safe_load(path.read_text())).objects if o["kind"] == "ConfigMap"]
    assert out.split(head, 1)[1] == config_map["data"]["config.yaml"]  # byte for byte, at the end
    shown = yaml.safe_load(out.split(head, 1)[1])
    assert shown["model"] == {"path": "Qwen/Qwen3-8B", "dtype": "bfloat16", "gradientCheckpointing": True}
    assert main(["plan", str(path), "--config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == shown


def test_plan_of_a_trainer_config_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "examples" / "trainer-grpo.yaml")
    assert main(["plan", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rljob plan: error: {path} is a trainer config (treetrain train {path}), not an RLJob ")
    assert len(err.splitlines()) == 1
    # A spec without its envelope is not mistaken for one: the RLJob's own errors name the envelope.
    bare = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())["spec"]
    assert not any(k in bare for k in ("apiVersion", "kind"))
    stdin = subprocess.run([str(BIN / "rljob"), "plan", "-"], input=yaml.safe_dump(bare), capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert stdin.returncode == 2 and "apiVersion: must be treetrain.dev/v1alpha1" in stdin.stderr


def test_the_example_fits_80_gib_by_the_memory_plan(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "examples" / "rljob.yaml"
    assert yaml.safe_load(path.read_text())["spec"]["gpuMemoryGiB"] == 80
    model = str(ROOT / "examples" / "model-configs" / "qwen3-8b.json")
    assert main(["plan", str(path), "--model-config", model]) == 0
    captured = capsys.readouterr()
    assert "memory per GPU: fits the 80.0 GiB GPUs (spec.gpuMemoryGiB):" in captured.out
    assert captured.err == ""
    assert main(["plan", str(path), "--model-config", model, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["checked"] and memory["components"]["actor"]["per_gpu_bytes"] <= 80 * 1024**3
    print(f"examples/rljob.yaml, actor per GPU: {memory['components']['actor']['per_gpu_bytes'] / 1024**3:.1f} GiB")


def test_without_a_gpu_size_an_estimate_above_every_common_gpu_is_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    del manifest["spec"]["gpuMemoryGiB"]
    manifest["spec"]["model"] = {"path": "Qwen/Qwen3-8B", "dtype": "float32"}  # fp32, no recompute
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump(manifest))
    model = str(ROOT / "examples" / "model-configs" / "qwen3-8b.json")
    assert main(["plan", str(path), "--model-config", model]) == 0
    captured = capsys.readouterr()
    assert "GPU memory unknown (set spec.gpuMemoryGiB): not checked" in captured.out
    (warning,) = captured.err.splitlines()
    assert warning.startswith("rljob plan: warning: fsdp:d8 needs about ")
    assert "more than any common GPU (80, 96, 141, 192 GiB)" in warning
    assert "spec.model.gradientCheckpointing: true" in warning
    # The same RLJob with a GPU size is refused, with the same hints.
    manifest["spec"]["gpuMemoryGiB"] = 80
    path.write_text(yaml.safe_dump(manifest))
    assert main(["plan", str(path), "--model-config", model]) == 2
    err = capsys.readouterr().err
    assert "but the GPUs have 80.0 GiB (spec.gpuMemoryGiB); with spec.model.gradientCheckpointing: true and " in err
    # Within a common GPU: no warning.
    manifest["spec"]["model"]["gradientCheckpointing"] = True
    del manifest["spec"]["gpuMemoryGiB"]
    path.write_text(yaml.safe_dump(manifest))
    assert main(["plan", str(path), "--model-config", model]) == 0
    assert capsys.readouterr().err == ""


def test_the_readme_plan_blocks_are_what_rljob_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    starts = [i for i, line in enumerate(readme) if line.startswith("$ .venv/bin/rljob plan ")]
    assert starts
    for start in starts:
        argv = [a.replace("examples/", f"{ROOT}/examples/") for a in readme[start].split("#")[0].split()[2:]]
        shown = list(itertools.takewhile(lambda line: not line.startswith(("$", "```")), readme[start + 1 :]))
        assert main(argv) == 0
        printed = capsys.readouterr().out.splitlines()
        assert shown and all(line in printed for line in shown), (readme[start], shown, printed)


def test_plan_invalid_lists_every_problem(tmp_path: Path) -> None:
    bad = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    bad["spec"]["rollout"]["backend"] = "sglang:d4c2"
    bad["spec"]["actor"]["backend"] = "d4t2"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = subprocess.run([str(BIN / "rljob"), "plan", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "(2 problems)" in out.stderr
    assert "spec.rollout.backend: 'sglang:d4c2', column 10" in out.stderr
    assert "spec.actor.backend: 'd4t2', column 1: backend missing" in out.stderr


def test_plan_unreadable_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_rljob_crd_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"


def test_operator_metrics_parse_strictly() -> None:
    m = Metrics()
    m.observe("ml", "demo", "Running", {"rollout": 8, "actor": 8})
    m.observe("ml", "demo", "Running", {"actor": 8})  # a component went away: its series too
    m.reconcile.observe(0.02)
    m.errors.inc()
    m.restarts.labels(namespace="ml").inc()
    text = generate_latest(m.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"rljob_jobs", "rljob_gpus_requested", "rljob_reconcile_duration_seconds", "rljob_reconcile_errors",
            "rljob_trainer_restarts", "rljob_build_info"} <= set(families)  # fmt: skip
    gpus = {s.labels["component"]: s.value for s in families["rljob_gpus_requested"].samples}
    assert gpus == {"actor": 8.0}
    running = [s.value for s in families["rljob_jobs"].samples if s.labels["phase"] == "Running"]
    assert running == [1.0]
    m.observe("ml", "demo", None, {})
    assert "rljob_gpus_requested{" not in generate_latest(m.registry).decode()


def test_reference_doc_lists_every_field() -> None:
    doc = (ROOT / "docs" / "rljob-reference.md").read_text()
    begin = doc.index("-->\n", doc.index("<!-- BEGIN generated")) + 4
    end = doc.index("<!-- END generated -->")
    assert doc[begin:end] == reference_table(), (
        "docs/rljob-reference.md is stale: paste rljob_operator.crd.reference_table() between the markers"
    )


BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "spec: {trainerConfig: {taskArgs: {x: *i}}}\n"
)  # 10^9 values once walked


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BOMB, "expands to more than 200,000 values"),
        ("spec: " + "[" * 100_000 + "]" * 100_000 + "\n", "YAML nested too deeply"),
        ("spec: {gpusPerNode: " + "7" * 5000 + "}\n", "Exceeds the limit (4300 digits)"),
        ("a: " + "x" * (3 << 20) + "\n", "a config or manifest is at most"),
        ("a: 1\n---\nb: 2\n", "expected one YAML document, found 2"),
    ],
    ids=["alias-bomb", "deep", "huge-int", "huge-file", "two-docs"],
)
def test_hostile_manifests_are_one_line_and_fast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    # An alias bomb or huge integers grew rljob plan to 3-4 GB before it answered; 100k-deep
    # YAML was a RecursionError traceback.
    path = tmp_path / "rljob.yaml"
    path.write_text(text)
    started = time.monotonic()
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err[:300]
    print(f"refused in {time.monotonic() - started:.2f} s")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=30))  # fmt: skip
def test_any_yaml_document_plans_or_exits_2_with_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: Any
) -> None:
    manifest = {"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "fuzz"}, "spec": spec}
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert code in (0, 2) and "Traceback" not in err
    if code == 2:
        problems = [line for line in err.splitlines() if line.startswith("  - ")]
        assert problems and all(": " in p for p in problems), err
