"""The memory plan at admission: ``rljob plan`` and the operator refuse a layout whose memory
per GPU exceeds ``spec.gpuMemoryGiB`` (or the smallest ``nvidia.com/gpu.memory`` node label),
naming a layout that fits; a layout that fits passes; no memory information, no check."""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from rljob_operator.cli import main
from rljob_operator.gpu_memory import GPU_MEMORY_LABEL, smallest_node_gpu_mib
from rljob_operator.observe import Observed
from rljob_operator.plan import PlanError, plan
from rljob_operator.reconcile import decide

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = json.loads((ROOT / "examples/model-configs/qwen3-8b.json").read_text())


def manifest(actor: str = "megatron:d8", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "treetrain.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u1", "generation": 1},
        "spec": {
            "model": {"path": "Qwen/Qwen3-8B", "config": QWEN3_8B},
            "rollout": {"backend": "sglang:d2t4"},
            "actor": {"backend": actor, "treeTraining": {"maxTokensPerMicrobatch": 8192}},
            **spec,
        },
    }


def refusal(m: dict[str, Any], **kw: Any) -> str:
    with pytest.raises(PlanError) as err:
        plan(m, **kw)
    (problem,) = [e for e in err.value.errors if e.path == "spec.actor.backend"]
    return problem.message


def test_a_layout_that_does_not_fit_is_refused_naming_one_that_does() -> None:
    message = refusal(manifest(gpuMemoryGiB=80))
    assert "megatron:d8 needs about" in message and "80.0 GiB (spec.gpuMemoryGiB)" in message
    found = re.search(r"(megatron:\S+) fits", message)
    assert found is not None, message
    fixed = plan(manifest(found.group(1), gpuMemoryGiB=80))  # the named layout passes
    assert fixed.memory is not None and fixed.memory.problems == []
    row = fixed.memory.rows[0]
    assert row.component == "actor" and row.per_gpu <= 80 * 1024**3


def test_a_layout_that_fits_passes_and_prints_every_component() -> None:
    result = plan(manifest("megatron:d2t4", gpuMemoryGiB=141))
    assert result.memory is not None
    rows = {r.component: r for r in result.memory.rows}
    assert set(rows) == {"actor", "rollout"}
    assert "KV cache" in rows["rollout"].note and rows["rollout"].parts == {"weights": rows["rollout"].per_gpu}
    summary = result.memory.summary()
    assert summary["checked"] and summary["gpu_memory_from"] == "spec.gpuMemoryGiB"


def test_colocated_critic_and_ref_add_their_static_memory() -> None:
    alone = plan(manifest("megatron:d2t4", gpuMemoryGiB=141)).memory
    ppo = {"critic": {"backend": ""}, "ref": {"backend": ""}, "trainerConfig": {"algorithm": "ppo"}}
    both = plan(manifest("megatron:d2t4", gpuMemoryGiB=141, **ppo)).memory
    assert alone is not None and both is not None
    actor, trainer = alone.rows[0], both.rows[0]
    assert trainer.component == "trainer" and trainer.per_gpu > actor.per_gpu
    # Activations come and go in turn: counted once, the largest.
    assert trainer.parts["activations (estimate)"] == actor.parts["activations (estimate)"]
    assert trainer.parts["parameters"] > 2 * actor.parts["parameters"]


def test_node_label_is_the_limit_when_gpu_memory_is_unset() -> None:
    nodes = [
        {"metadata": {"labels": {GPU_MEMORY_LABEL: "143771", "pool": "h200"}}},
        {"metadata": {"labels": {GPU_MEMORY_LABEL: "81559", "pool": "h100"}}},
        {"metadata": {"labels": {"pool": "cpu"}}},
    ]
    assert smallest_node_gpu_mib(nodes, {}) == 81559
    assert smallest_node_gpu_mib(nodes, {"pool": "h200"}) == 143771
    assert smallest_node_gpu_mib(nodes, {"pool": "cpu"}) is None
    message = refusal(manifest(), node_gpu_mib=81559)
    assert "nvidia.com/gpu.memory label, 81559 MiB" in message
    # spec.gpuMemoryGiB wins over the label.
    assert plan(manifest("megatron:d2t4", gpuMemoryGiB=141), node_gpu_mib=1024).memory is not None
    # The operator: Valid=False with the reason, no pods.
    m = manifest()
    decision = decide(m, Observed(node_gpu_mib=81559), datetime(2026, 1, 1, tzinfo=UTC))
    valid = next(c for c in decision.status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and "fits" in valid["message"] and "megatron:d8" in valid["message"]


def test_no_memory_information_no_check() -> None:
    no_config = manifest(gpuMemoryGiB=80)
    del no_config["spec"]["model"]["config"]
    result = plan(no_config)
    assert result.memory is not None and "no model config" in result.memory.lines()[0]
    unknown = plan(manifest())  # a config but no GPU size: printed, not refused
    assert unknown.memory is not None and unknown.memory.limit_bytes is None
    assert "not checked" in unknown.memory.lines()[0]
    bad = copy.deepcopy(manifest(gpuMemoryGiB=80))
    del bad["spec"]["model"]["config"]["hidden_size"]
    with pytest.raises(PlanError, match=r"spec.model.config: .*hidden_size"):
        plan(bad)


def test_rljob_plan_model_config_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    m = manifest(gpuMemoryGiB=80)
    del m["spec"]["model"]["config"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(m))
    cfg = str(ROOT / "examples/model-configs/qwen3-8b.json")
    assert main(["plan", str(job), "--model-config", cfg]) == 2
    assert "megatron:d8 needs about" in capsys.readouterr().err
    m["spec"]["actor"]["backend"] = "megatron:d2t4"
    job.write_text(yaml.safe_dump(m))
    assert main(["plan", str(job), "--model-config", cfg]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU: fits the 80.0 GiB GPUs (spec.gpuMemoryGiB):" in out and "KV cache" in out
    assert main(["plan", str(job), "--model-config", cfg, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["memory"]
    assert summary["components"]["actor"]["per_gpu_bytes"] <= 80 * 1024**3
    assert main(["plan", str(job), "--model-config", str(tmp_path / "missing.json")]) == 2
    assert "--model-config" in capsys.readouterr().err


class _Nodes:
    """A fake ApiClient answering a node list (status 200) or refusing it (403: no RBAC)."""

    def __init__(self, status: int, nodes: list[dict[str, Any]]) -> None:
        self.status, self.nodes, self.paths = status, nodes, []  # type: list[Any]

    def param_serialize(self, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
        self.paths.append((path, kwargs.get("query_params")))
        return (method, path)

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        outer = self

        class Response:
            status = outer.status
            reason = "OK" if outer.status == 200 else "Forbidden"
            data = json.dumps({"items": outer.nodes}).encode()

            def read(self) -> None:
                pass

        return Response()


def test_kube_reads_the_smallest_labelled_node() -> None:
    from rljob_operator.kube import Kube

    nodes = [
        {"metadata": {"labels": {GPU_MEMORY_LABEL: "81559", "pool": "gpu"}}},
        {"metadata": {"labels": {GPU_MEMORY_LABEL: "143771", "pool": "gpu"}}},
    ]
    client = _Nodes(200, nodes)
    assert Kube(client).node_gpu_mib({"pool": "gpu"}) == 81559  # type: ignore[arg-type]
    assert client.paths == [("/api/v1/nodes", [("labelSelector", "pool=gpu")])]
    assert Kube(_Nodes(403, nodes)).node_gpu_mib({}) is None  # type: ignore[arg-type]


def test_lora_counts_a_frozen_base_and_makes_a_layout_fit() -> None:
    """spec.actor.lora in the plan: the actor's base without gradients or optimizer state, so
    fsdp:d2 on Qwen3-8B, refused on 80 GiB GPUs when every weight trains, fits with an adapter."""
    assert "fsdp:d2 needs about" in refusal(manifest("fsdp:d2", gpuMemoryGiB=80))
    m = manifest("fsdp:d2", gpuMemoryGiB=80)
    m["spec"]["actor"]["lora"] = {"rank": 16, "sync": "merged"}
    memory = plan(m).memory
    assert memory is not None and memory.problems == []
    actor = memory.rows[0].parts
    assert actor["parameters"] < 8.5 * 1024**3  # half of 8.2 B bf16 weights, and the fp32 adapter
    assert actor["gradients"] < 0.1 * 1024**3 and actor["optimizer"] < 0.2 * 1024**3
    # A colocated critic and ref train no adapter: their full static memory is added.
    ppo = {"critic": {"backend": ""}, "ref": {"backend": ""}, "trainerConfig": {"algorithm": "ppo"}}
    m = manifest("fsdp:d8", gpuMemoryGiB=141, **ppo)
    m["spec"]["actor"]["lora"] = {"rank": 16, "sync": "merged"}
    trainer = plan(m).memory
    assert trainer is not None and trainer.rows[0].component == "trainer"
    assert trainer.rows[0].parts["optimizer"] > 7 * 1024**3  # the critic's AdamW state over 8 ranks


def test_lora_on_experts_the_engine_cannot_adapt_is_refused_in_one_line() -> None:
    """fsdp puts no adapters on a MoE layer's experts (transformers fuses them): admission
    refuses all-linear on Qwen3-30B-A3B there, naming the field and the fix, as the engine would."""
    m = manifest("fsdp:d8", gpuMemoryGiB=141)
    m["spec"]["model"]["config"] = json.loads((ROOT / "examples/model-configs/qwen3-30b-a3b.json").read_text())
    m["spec"]["actor"]["lora"] = {"rank": 16, "sync": "merged"}
    with pytest.raises(PlanError) as err:
        plan(m)
    (problem,) = [e for e in err.value.errors if e.path == "spec.actor.lora.targetModules"]
    assert "experts" in problem.message and "q_proj, k_proj, v_proj, o_proj" in problem.message
    m["spec"]["actor"]["lora"]["targetModules"] = ["q_proj", "v_proj"]
    assert plan(m).memory is not None
