"""The RLJob's precision, recompute and pod resources: ``spec.model.dtype`` and
``spec.model.gradientCheckpointing`` reach the trainer ConfigMap (``auto`` written out) and the
memory plan; ``spec.actor.resources`` / ``spec.rollout.resources`` reach the containers."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from helpers import ROOT

from rljob_operator.plan import Plan, PlanError, plan
from treetrain.config import read_yaml, validate

EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
QWEN3_8B = json.loads((ROOT / "examples" / "model-configs" / "qwen3-8b.json").read_text())


def manifest(model: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml", "uid": "u1", "generation": 1}
    if model is not None:
        body["spec"]["model"] = {"path": "Qwen/Qwen3-8B", **model}
    body["spec"].update(spec)
    return body


def objects(p: Plan, kind: str) -> list[dict[str, Any]]:
    return [o for o in p.objects if o["kind"] == kind]


def config_map_model(p: Plan) -> dict[str, Any]:
    (config_map,) = objects(p, "ConfigMap")
    model: dict[str, Any] = yaml.safe_load(config_map["data"]["config.yaml"])["model"]
    return model


def errors(m: dict[str, Any], **kw: Any) -> dict[str, str]:
    with pytest.raises(PlanError) as info:
        plan(m, **kw)
    return {e.path: e.message for e in info.value.errors}


def test_bf16_and_recompute_reach_the_trainer_configmap() -> None:
    p = plan(manifest({"dtype": "bfloat16", "gradientCheckpointing": True}))
    assert config_map_model(p) == {"path": "Qwen/Qwen3-8B", "dtype": "bfloat16", "gradientCheckpointing": True}
    # What the trainer pod reads back is what the plan checked.
    (config_map,) = objects(p, "ConfigMap")
    read = validate(read_yaml(config_map["data"]["config.yaml"], "config.yaml"))
    assert (read.model.dtype, read.model.gradient_checkpointing) == ("bfloat16", True)
    assert read == p.config


@pytest.mark.parametrize(
    ("model", "dtype", "recompute"),
    [
        ({}, "bfloat16", False),  # auto: trainer pods always request GPUs
        ({"dtype": "auto"}, "bfloat16", False),
        ({"dtype": "float32"}, "float32", False),
        ({"dtype": "float16", "gradientCheckpointing": True}, "float16", True),
    ],
)
def test_dtype_auto_is_written_out(model: dict[str, Any], dtype: str, recompute: bool) -> None:
    written = config_map_model(plan(manifest(model)))
    assert (written["dtype"], written["gradientCheckpointing"]) == (dtype, recompute)


def test_bad_dtype_and_a_model_section_in_trainer_config_are_refused() -> None:
    found = errors(manifest({"dtype": "fp8", "gradientCheckpointing": "yes"}))
    assert "'auto', 'float32', 'bfloat16' or 'float16'" in found["spec.model.dtype"]
    assert "spec.model.gradientCheckpointing" in found
    # spec.trainerConfig is the trainer: section only: precision set there is refused, naming spec.model.
    found = errors(manifest(trainerConfig={"model": {"dtype": "bfloat16"}, "dtype": "bfloat16"}))
    assert found["spec.trainerConfig.model"].startswith("unknown key; did you mean spec.")
    assert found["spec.trainerConfig.dtype"] == "unknown key; did you mean spec.model.dtype?"
    found = errors(manifest(trainerConfig={"gradientCheckpointing": True}))
    assert found == {
        "spec.trainerConfig.gradientCheckpointing": "unknown key; did you mean spec.model.gradientCheckpointing?"
    }


def test_the_memory_plan_uses_dtype_and_recompute() -> None:
    def actor_gib(**model: Any) -> float:
        p = plan(manifest({"config": QWEN3_8B, **model}, gpuMemoryGiB=None))
        (row,) = [r for r in p.memory.rows if r.component == "actor"]
        return row.per_gpu / 1024**3

    fp32 = actor_gib(dtype="float32")
    bf16 = actor_gib()  # auto
    both = actor_gib(gradientCheckpointing=True)
    assert fp32 > bf16 > both
    assert both < 80 < bf16  # examples/rljob.yaml fits an 80 GiB GPU only with recompute
    print(f"qwen3-8b fsdp:d8 32k tokens per GPU: fp32 {fp32:.1f}, bf16 {bf16:.1f}, bf16+recompute {both:.1f} GiB")


def test_resources_are_rendered_onto_the_containers() -> None:
    engines = [{"name": "small", "backend": "sglang:d1t2", "resources": {"limits": {"memory": "32Gi"}}}]
    m = manifest(
        rollout={"backend": "sglang:d2t4", "resources": {"requests": {"cpu": 16, "memory": "128Gi"}}},
        additionalRollouts=engines,
    )
    m["spec"]["actor"]["resources"] = {"requests": {"cpu": "12", "memory": "200Gi"}, "limits": {"cpu": "32"}}
    p = plan(m)
    (job,) = objects(p, "Job")
    (trainer,) = job["spec"]["template"]["spec"]["containers"]
    assert trainer["resources"] == {
        "limits": {"cpu": "32", "nvidia.com/gpu": "8"},
        "requests": {"cpu": "12", "memory": "200Gi", "nvidia.com/gpu": "8"},
    }
    servers = {s["metadata"]["name"]: s["spec"]["template"]["spec"]["containers"][0] for s in objects(p, "StatefulSet")}
    assert servers["job-rollout"]["resources"] == {
        "limits": {"nvidia.com/gpu": "4"},
        "requests": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "4"},  # an integer is a quantity
    }
    # Only a limit: Kubernetes requests the limit, so the default request is left out.
    assert servers["job-rollout-small"]["resources"] == {
        "limits": {"memory": "32Gi", "nvidia.com/gpu": "2"},
        "requests": {"cpu": "2", "nvidia.com/gpu": "2"},
    }
    # Unset: the defaults, as before.
    (default_job,) = objects(plan(manifest()), "Job")
    assert default_job["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": "8"},
        "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "8"},
    }


def test_bad_resources_are_refused_with_the_field() -> None:
    m = manifest(rollout={"backend": "sglang:d2t4", "resources": {"requests": {"cpu": "lots", "nvidia.com/gpu": 4}}})
    m["spec"]["actor"]["resources"] = {"requests": {"memory": "1.5Ti"}, "limits": {"memory": "512Gi", "cpu": -1}}
    found = errors(m)
    assert found["spec.rollout.resources.requests.cpu"] == (
        "must be a Kubernetes quantity such as 8, 500m or 64Gi, got 'lots'"
    )
    assert found['spec.rollout.resources.requests."nvidia.com/gpu"'].startswith(
        "requests and limits take cpu and memory only; the operator sets the GPUs"
    )
    assert found["spec.actor.resources.limits.cpu"] == "must be a Kubernetes quantity such as 8, 500m or 64Gi, got -1"
    # A request above its limit (the API refuses it), compared as quantities.
    m["spec"]["actor"]["resources"]["limits"]["cpu"] = "500m"
    m["spec"]["rollout"]["resources"] = {"requests": {"cpu": "0.25"}, "limits": {"cpu": "250m"}}
    assert errors(m) == {
        "spec.actor.resources.requests.memory": "1.5Ti is more than the limit 512Gi; the API refuses a request above "
        "its limit: lower it, or raise spec.actor.resources.limits.memory"
    }


def test_the_crd_types_quantities_as_int_or_string() -> None:
    from rljob_operator.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    cpu = spec["actor"]["properties"]["resources"]["properties"]["requests"]["properties"]["cpu"]
    assert cpu["x-kubernetes-int-or-string"] is True and "type" not in cpu and cpu["pattern"].startswith("^")
    model = spec["model"]["properties"]
    assert model["dtype"]["enum"] == ["auto", "float32", "bfloat16", "float16"] and model["dtype"]["default"] == "auto"
    assert model["gradientCheckpointing"] == {
        "type": "boolean",
        "default": False,
        "description": model["gradientCheckpointing"]["description"],
    }
