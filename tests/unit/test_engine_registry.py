"""The engine registry (treetrain/alloc/registry.py) is the one place engines are described:
a description added here changes what the parser, the memory plan, config validation, the
factory and the operator's CEL rule (the CRD's, generated) accept, and the code that reads the
registry compares no engine names (an AST scan)."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from treetrain.alloc import AllocationError, parse, registry
from treetrain.alloc.memory import estimate
from treetrain.alloc.spec import EngineLetters, EngineSpec
from treetrain.config import check_training_backend, engines
from treetrain.config.errors import EngineConfigError
from treetrain.config.schema import ServerKind

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 32,
}
# A made-up trainer: runs d and t, takes c but not yet, shards like Megatron, twice its slack.
FAKE = dataclasses.replace(
    registry.spec_of("megatron"),
    name="fake",
    letters=EngineLetters(accepted="dtc", not_yet={"c": "the fake engine has no context parallel yet"}),
    engine="treetrain.engines.fsdp.engine:FSDPEngine",
    activation_slack=2 * registry.spec_of("megatron").activation_slack,
)
SERVER = EngineSpec(name="fakeserve", kind="inference", letters=EngineLetters(accepted="dt"))


@pytest.fixture
def fake() -> Iterator[None]:
    """FAKE and SERVER registered, for one test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.ENGINES, FAKE.name, FAKE)
        mp.setitem(registry.ENGINES, SERVER.name, SERVER)
        check_training_backend.cache_clear()
        yield
    check_training_backend.cache_clear()


def test_without_the_description_nothing_accepts_it() -> None:
    with pytest.raises(AllocationError, match="unknown backend 'fake'"):
        parse("fake:d2")
    assert "fake" not in engines()


def test_the_parser_reads_letters_and_names_from_the_registry(fake: None) -> None:
    assert parse("fake:d2t2").world_size == 4
    assert parse("fakeserve:d2t2").kind == "inference"
    with pytest.raises(AllocationError, match=r"fake does not support pipeline parallel \(p2\): fake shards data, "):
        parse("fake:d2p2")
    with pytest.raises(AllocationError, match="fakeserve takes only d \\(instances\\) and t, not pipeline"):
        parse("fakeserve:p2")
    with pytest.raises(AllocationError, match="fake cannot take a hybrid"):
        parse("fake:(attn:d2|ffn:e2)")
    with pytest.raises(AllocationError, match="use one of sglang, vllm, fsdp, megatron, archon, fake, fakeserve"):
        parse("nosuch:d2")


def test_the_memory_plan_reads_slicing_and_slack_from_the_description(fake: None) -> None:
    fake_plan = estimate(TINY, parse("fake:d2t2"), tokens=64, dtype="bfloat16")
    megatron = estimate(TINY, parse("megatron:d2t2"), tokens=64, dtype="bfloat16")
    assert fake_plan.largest.static == megatron.largest.static  # the same slicing, dtype rule, optimizer
    assert fake_plan.precision == megatron.precision
    assert fake_plan.largest.activations == pytest.approx(2 * megatron.largest.activations, rel=0.01)
    sharded = dataclasses.replace(FAKE, shards_over=("dp",), sixteen_bit="fsdp2_cast", sharded_optimizer=False)
    registry.ENGINES["fake"] = sharded
    assert estimate(TINY, parse("fake:d2"), tokens=64, dtype="float32").largest.param_count < (
        estimate(TINY, parse("megatron:d2"), tokens=64, dtype="float32").largest.param_count
    )


def test_config_validation_reads_what_each_engine_runs(fake: None) -> None:
    assert check_training_backend("fake:d2t2").world_size == 4
    assert engines()["fake"].refused == {"cp": "the fake engine has no context parallel yet"}
    with pytest.raises(EngineConfigError, match="the fake engine has no context parallel yet"):
        check_training_backend("fake:c2")
    with pytest.raises(
        EngineConfigError, match=re.escape("a trainer needs fsdp:..., megatron:..., archon:... or fake:...")
    ):
        check_training_backend("fakeserve:d2")


def test_the_factory_builds_the_class_the_description_names(fake: None) -> None:
    from treetrain.engines.factory import engine_class_of
    from treetrain.engines.fsdp.engine import FSDPEngine

    assert engine_class_of(parse("fake:d1")) is FSDPEngine


def test_every_trainer_names_its_engine_class() -> None:
    from treetrain.engines.factory import engine_class_of

    for name in registry.names("training"):
        assert engine_class_of(parse(f"{name}:d1")).__name__.lower() == f"{name}engine"


def test_the_crd_cel_rule_is_generated_from_the_registry(fake: None) -> None:
    from rljob_operator.models import backend_rules

    rules = dict(backend_rules())
    actor = next(rule for rule in rules if "self.actor.backend" in rule)
    assert "'fake:'" in actor and "'fakeserve:'" not in actor
    assert rules[actor] == "actor.backend must be fsdp:..., megatron:..., archon:... or fake:..."
    rollout = next(rule for rule in rules if rule.startswith("self.rollout.backend"))
    assert "self.rollout.backend.startsWith('fakeserve:')" in rollout and "'fake:'" not in rollout


def test_the_committed_crd_carries_the_registrys_rules() -> None:
    import yaml

    from rljob_operator.models import backend_rules

    crd = yaml.safe_load((ROOT / "crds/rljob.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = [(v["rule"], v["message"]) for v in spec["x-kubernetes-validations"]]
    assert found == backend_rules()


def test_tables_derived_from_the_registry() -> None:
    assert get_args(ServerKind) == ("auto", *registry.names("inference"))
    assert registry.names() == ("sglang", "vllm", "fsdp", "megatron", "archon")
    assert registry.hybrid_names() == ("megatron", "archon")
    assert registry.running("p") == ("megatron", "archon")


# -- no engine names compared -------------------------------------------------------------

# Modules that read the registry. The descriptions themselves (alloc/specs/) and the engines'
# own packages are where names live; so are the rollout servers' command lines
# (rljob_operator/servers.py, render_statefulset.py), the servers' own code.
READERS = [
    *sorted((ROOT / "treetrain/alloc").glob("*.py")),
    *sorted((ROOT / "treetrain/config").glob("*.py")),
    ROOT / "treetrain/engines/factory.py",
    ROOT / "treetrain/cli/alloc.py",
    ROOT / "treetrain/cli/memory.py",
    ROOT / "operator/rljob_operator/models.py",
    ROOT / "operator/rljob_operator/components.py",
    ROOT / "operator/rljob_operator/crd.py",
    ROOT / "operator/rljob_operator/gpu_memory.py",
]


def _compared_names(path: Path) -> list[str]:
    names = set(registry.names())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            items = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares {item.value!r}")
    return found


def test_code_that_reads_the_registry_compares_no_engine_names() -> None:
    found = [line for path in READERS for line in _compared_names(path)]
    # Rollout kinds (trainer.rollout.kind) are the rollout clients' names, not backends; the
    # config's check compares them to the registry's inference names, never to literals.
    assert found == []
