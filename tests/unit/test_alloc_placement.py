"""Laying allocations out on nodes."""

from __future__ import annotations

import pytest

from treetrain.alloc import PlacementError, PodPlan, parse, plan_pods

# (spec, gpus per node) -> (pods, gpus per pod, nodes, pods per instance)
CASES = {
    ("fsdp:d8", 8): (1, 8, 1, 1),
    ("fsdp:d4", 8): (1, 4, 1, 1),
    ("fsdp:d16", 8): (2, 8, 2, 2),
    ("megatron:d2p2t4", 8): (2, 8, 2, 2),
    ("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", 8): (4, 8, 4, 4),
    ("fsdp:d1", 1): (1, 1, 1, 1),
    ("sglang:d2t4", 8): (2, 4, 1, 1),
    ("sglang:d3t4", 8): (3, 4, 2, 1),
    ("sglang:d8", 8): (8, 1, 1, 1),
    ("vllm:d4t8", 8): (4, 8, 4, 1),
    ("sglang:d2t16", 8): (4, 8, 4, 2),
    ("sglang:d1p2t8", 4): (4, 4, 4, 4),
    ("sglang:d3t3", 8): (3, 3, 2, 1),
}


@pytest.mark.parametrize(("spec", "gpus_per_node"), CASES)
def test_plan(spec: str, gpus_per_node: int) -> None:
    pods, per_pod, nodes, per_instance = CASES[(spec, gpus_per_node)]
    plan = plan_pods(parse(spec), gpus_per_node)
    assert plan == PodPlan(pods=pods, gpus_per_pod=per_pod, nodes=nodes, pods_per_instance=per_instance)
    assert plan.gpus == parse(spec).world_size


@pytest.mark.parametrize(
    ("spec", "gpus_per_node", "phrase"),
    [
        ("fsdp:d12", 8, "world size 12 does not fill whole nodes of 8 GPUs"),
        ("megatron:d3p2t2", 8, "e.g. 8 or 16"),
        ("sglang:d2t12", 8, "GPUs per instance (t*p) 12"),
    ],
)
def test_plan_errors(spec: str, gpus_per_node: int, phrase: str) -> None:
    with pytest.raises(PlacementError) as info:
        plan_pods(parse(spec), gpus_per_node)
    assert phrase in str(info.value)
    assert "fix: make it at most" in str(info.value)


@pytest.mark.parametrize("bad", [0, -8, True, 2.0])
def test_bad_gpus_per_node(bad: object) -> None:
    with pytest.raises(PlacementError, match="GPUs per node must be a whole number"):
        plan_pods(parse("fsdp:d8"), bad)  # type: ignore[arg-type]
