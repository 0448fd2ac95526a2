"""Every field an admission or plan message names exists: each ``spec.…`` path resolves to a
field of the RLJob models (walked here by their camelCase names, independently of the
operator), every camelCase name is a field somewhere in the RLJob or its trainer config (or a
listed chart value or Kubernetes word), and every "did you mean X?" names an RLJob field.

Messages come from two places: a table of bad RLJobs run through ``plan`` (and ``rljob plan``),
and every string literal in operator/*.py (f-string holes read as "any name")."""

from __future__ import annotations

import ast
import copy
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ROOT
from pydantic import BaseModel

from rljob_operator.cli import main
from rljob_operator.models import RLJobSpec
from rljob_operator.plan import Limits, PlanError, plan
from treetrain.config.schema import TrainConfig
from treetrain.config.trainer_settings import TrainerSettings

EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
QWEN3_8B = json.loads((ROOT / "examples" / "model-configs" / "qwen3-8b.json").read_text())
ANY = "*"  # an f-string hole in a path: any name (or index) there

# camelCase words in messages that are not RLJob or trainer config fields, and why they may appear.
NOT_FIELDS = {
    "maxGpusPerRLJob": "chart value limits.maxGpusPerRLJob",
    "maxPodsPerRLJob": "chart value limits.maxPodsPerRLJob",
    "allowedTaskModules": "chart value admission.allowedTaskModules",
    "allowedImagePrefixes": "chart value admission.allowedImagePrefixes",
    "emptyDir": "the Kubernetes volume kind checkpoints fall back to",
    "tolerationSeconds": "a field of a toleration, as in a pod spec",
    "camelCase": "how RLJob fields are spelt",
}


# -- the RLJob's fields, walked by alias ------------------------------------------------------


def _inner(annotation: Any) -> list[Any]:
    """The types a field holds: Optional and Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _inner(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) if a is not type(None) for t in _inner(a)]
    return [annotation]


def _children(annotation: Any, model: type[BaseModel] | None = None) -> dict[str, Any]:
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {}
    out = {}
    for name, info in annotation.model_fields.items():
        # spec.trainerConfig is a free-form mapping in the model, the trainer's trainer: section in fact.
        out[info.alias or name] = TrainerSettings if name == "trainer_config" else info.annotation
    return out


def resolves(annotation: Any, parts: list[str]) -> bool:
    if not parts:
        return True
    head, rest = parts[0], parts[1:]
    for kind in _inner(annotation):
        origin = typing.get_origin(kind)
        if origin is list and head.startswith("[") and resolves(typing.get_args(kind)[0], rest):
            return True
        if (origin is dict or kind is dict) and not head.startswith("["):
            return True  # a free-form mapping: any key (model.config, taskArgs, nodeSelector)
        children = _children(kind)
        if head == ANY and any(resolves(sub, rest) for sub in children.values()):
            return True
        if head in children and resolves(children[head], rest):
            return True
    return False


def is_rljob_field(path: str) -> bool:
    parts = re.findall(r"\[[^\]]*\]|[^.\[\]]+", path)
    return bool(parts) and parts[0] == "spec" and resolves(RLJobSpec, parts[1:])


def aliases(model: type[BaseModel]) -> set[str]:
    found: set[str] = set()
    for name, info in model.model_fields.items():
        found.add(info.alias or name)
        for kind in _inner(info.annotation):
            kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= aliases(kind)
    return found


def config_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{info.alias or name}" if prefix else (info.alias or name)
        out.append(path)
        for kind in _inner(info.annotation):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out += config_paths(kind, path)
    return out


FIELD_NAMES = aliases(RLJobSpec) | aliases(TrainConfig)
# A trainer config path with a dot (trainer.algorithm, critic.colocated) not inside a longer one.
BARE_CONFIG_PATH = re.compile(
    r"(?<![\w./-])("
    + "|".join(re.escape(p) for p in sorted((p for p in config_paths(TrainConfig) if "." in p), key=len, reverse=True))
    + r")(?![\w])"
)
SPEC_PATH = re.compile(r"(?<![\w./])spec(?:\.(?:[A-Za-z_*][\w*]*)|\[[^\]\s]*\])+")
CAMEL = re.compile(r"(?<![\w./-])[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+\b")


def bare_config_paths(text: str) -> list[str]:
    """Trainer config paths named as such, except where a message says it names the trainer config's."""
    return BARE_CONFIG_PATH.findall(re.sub(r"the trainer config's \S+", "", text))


def check(text: str) -> list[str]:
    """What in ``text`` names something that is not a field."""
    bad = [f"{p} is not an RLJob field" for p in SPEC_PATH.findall(text) if not is_rljob_field(p)]
    bad += [
        f"{w} is not a field of the RLJob or its trainer config"
        for w in CAMEL.findall(text)
        if w not in FIELD_NAMES and w not in NOT_FIELDS
    ]
    bad += [f"did you mean {x}? names no RLJob field" for x in re.findall(r"did you mean (\S+)\?", text)
            if not is_rljob_field(x)]  # fmt: skip
    return bad


def test_the_walker_knows_real_fields_from_made_up_ones() -> None:
    real = ["spec.model.dtype", "spec.model.gradientCheckpointing", "spec.actor.treeTraining.maxTokensPerMicrobatch",
            "spec.additionalRollouts[0].resources.limits.memory", "spec.trainerConfig.optimizer.lr",
            "spec.model.config.hidden_size", "spec.scheduling.tolerations[1].key", "spec.*.backend"]  # fmt: skip
    made_up = ["spec.model.seed", "spec.actor.treeTraining.maxTokensPerMb", "spec.trainerConfig.lr",
               "spec.rollout.servers", "spec.checkpoint.dir", "spec.actor[0]", "spec.*.nothing"]  # fmt: skip
    assert [p for p in real if not is_rljob_field(p)] == []
    assert [p for p in made_up if is_rljob_field(p)] == []
    assert bare_config_paths("set trainer.algorithm: ppo; spec.critic.colocated") == ["trainer.algorithm"]
    assert check("lower maxTokensPerMb") == ["maxTokensPerMb is not a field of the RLJob or its trainer config"]
    assert check("unknown key; did you mean spec.model.seed?") == [
        "spec.model.seed is not an RLJob field",
        "did you mean spec.model.seed? names no RLJob field",
    ]


# -- every message a table of bad RLJobs gets -------------------------------------------------


def manifest(model: dict[str, Any] | None = None, *, name: str = "job", **spec: Any) -> dict[str, Any]:
    """examples/rljob.yaml (it fits its 80 GiB GPUs) with the model's config, ``model`` and ``spec`` replaced."""
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name, "namespace": "ml", "uid": "u1", "generation": 1}
    body["spec"]["model"] = {**body["spec"]["model"], "config": QWEN3_8B, **(model or {})}
    body["spec"].update(spec)
    return body


def actor(**fields: Any) -> dict[str, Any]:
    return {"backend": "fsdp:d8", **fields}


FP32 = {"dtype": "float32", "gradientCheckpointing": False}
BF16 = {"gradientCheckpointing": False}
BAD: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # The trainer's did-you-mean hints, as RLJob fields (or who writes the trainer config's field).
    "precision in trainerConfig": (manifest(trainerConfig={"dtype": "bfloat16", "gradientCheckpointing": True}), {}),
    "model in trainerConfig": (manifest(trainerConfig={"model": {"path": "x"}}), {}),
    "operator-written keys in trainerConfig": (
        manifest(trainerConfig={"servers": [], "dir": "/x", "masterAddress": "a", "masterPort": 1, "bucketMb": 8}),
        {},
    ),
    "keys without an RLJob field": (manifest(trainerConfig={"pipelineSchedule": "gpipe", "lr": 1e-6}), {}),
    "misplaced actor keys": (manifest(actor=actor(maxTokensPerMicrobatch=4096, treetraining={})), {}),
    "micro-batch cap off the block": (manifest(actor=actor(treeTraining={"maxTokensPerMicrobatch": 1000})), {}),
    # Memory: each kind of refusal and its hints.
    "fp32 without recompute on 80 GiB": (manifest(FP32), {}),
    "bf16 without recompute on 80 GiB": (manifest(BF16), {}),
    "a million tokens": (manifest(BF16, actor=actor(treeTraining={"maxTokensPerMicrobatch": 1 << 20})), {}),
    "nothing fits 1 GiB": (manifest(gpuMemoryGiB=1), {}),
    "servers too big": (
        manifest(
            gpuMemoryGiB=10,
            rollout={"backend": "sglang:d2t1"},
            additionalRollouts=[{"name": "small", "backend": "sglang:d1t1"}],
        ),
        {},
    ),
    "node label": (manifest(BF16, gpuMemoryGiB=None), {"node_gpu_mib": 40960}),
    "colocated critic on 80 GiB": (
        manifest(FP32, critic={"backend": ""}, ref={"backend": ""}, trainerConfig={"algorithm": "ppo"}),
        {},
    ),
    # The operator's and the API's rules.
    "resources": (
        manifest(
            actor=actor(resources={"requests": {"cpu": "9", "nvidia.com/gpu": 1}, "limits": {"cpu": "8"}}),
            rollout={"backend": "sglang:d2t4", "resources": {"requests": {"memory": "lots"}}},
        ),
        {},
    ),
    "weight sync": (manifest(weightSync={"method": "disk", "port": 29500}), {}),
    "weight sync port": (manifest(weightSync={"port": 29500}), {}),
    "checkpoint volume read-only": (
        manifest(weightSync={"method": "disk"}, checkpoint={"volume": {"claimName": "c", "readOnly": True}}),
        {},
    ),
    "data": (manifest(data={"claimName": "a", "configMap": "b"}), {}),
    "data URL": (manifest(trainerConfig={"dataset": {"path": "s3://bucket/rows.jsonl"}, "reward": "builtin:math"}), {}),
    "critic in its own pods": (manifest(critic={"backend": "fsdp:d8", "colocated": False}), {}),
    "critic world size": (manifest(critic={"backend": "fsdp:d4"}), {}),
    "scheduling": (
        manifest(scheduling={"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}], "queueName": "a b"}),
        {},
    ),
    "gpu resource": (manifest(gpuResourceName="cpu"), {}),
    "model path": (manifest({"path": "-x", "volume": {"claimName": "m"}}), {}),
    "task module": (
        manifest(trainerConfig={"task": "os:system", "agent": "x:y"}),
        {"limits": Limits(task_modules=("acme",))},
    ),
    "images": (manifest(), {"limits": Limits(image_prefixes=("ghcr.io/acme",))}),
    "server flags": (
        manifest(rollout={"backend": "sglang:d2t4", "serverArgs": ["--config", "x"]}),
        {"limits": Limits(server_flags=("--x",))},
    ),
    "too many GPUs": (manifest(actor=actor(backend="fsdp:d512")), {"limits": Limits(max_gpus=64)}),
    "long names": (
        manifest(name="a" * 30, additionalRollouts=[{"name": "abcdefghijklmnopqrst", "backend": "sglang:d1t1"}]),
        {},
    ),
    "reserved engine name": (manifest(additionalRollouts=[{"name": "trainer", "backend": "sglang:d1t1"}]), {}),
    "schema": (manifest(gpusPerNode="8", suspend="no", actor={"backend": "d4t2"}, rollout={"backend": "fsdp:d2"}), {}),
    "misspelt spec key": (manifest(gpuMemory=80), {}),
    "bad model config": (manifest({"config": {"hidden_size": 1}}), {}),
}


def messages(m: dict[str, Any], kw: dict[str, Any]) -> list[str]:
    try:
        result = plan(m, **kw)
    except PlanError as err:
        return [str(e) for e in err.errors]
    return list(result.memory.warnings)


@pytest.mark.parametrize("case", BAD)
def test_every_hint_of_a_bad_rljob_names_a_real_field(case: str) -> None:
    m, kw = BAD[case]
    found = messages(m, kw)
    assert found, f"{case}: no message"
    for text in found:
        path, _, message = text.partition(": ")
        assert check(message) == [], text
        # A trainer config field is named as its RLJob field (trainer.algorithm: spec.trainerConfig.algorithm).
        assert bare_config_paths(message) == [], text
        # An unknown key is named where it was written; the mapping it sits in is a field.
        refused_key = ("unknown key", "is not a field", "take cpu and memory only")
        where = re.sub(r'\.("[^"]*"|[^.]*)$', "", path) if any(k in message for k in refused_key) else path
        assert not where.startswith("spec") or is_rljob_field(where), text


def test_the_refusal_hints_are_fields_to_set() -> None:
    (fp32,) = messages(*BAD["fp32 without recompute on 80 GiB"])
    assert "with spec.model.gradientCheckpointing: true and spec.model.dtype: bfloat16 it needs about" in fp32
    (huge,) = messages(*BAD["a million tokens"])
    assert "with spec.actor.treeTraining.maxTokensPerMicrobatch: " in huge
    (nothing,) = [m for m in messages(*BAD["nothing fits 1 GiB"]) if m.startswith("spec.actor.backend")]
    assert "no single change fits: no fsdp layout up to 1024 GPUs, no smaller spec.actor.treeTraining" in nothing
    servers = [m for m in messages(*BAD["servers too big"]) if "weights alone" in m]
    assert [m.split(":")[0] for m in servers] == ["spec.rollout.backend", "spec.additionalRollouts[0].backend"]
    (warning,) = messages(manifest(FP32, gpuMemoryGiB=None), {})  # no GPU size: a warning, same hints
    assert "more than any common GPU" in warning and check(warning) == []


def test_rljob_plan_own_errors_name_real_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(ROOT / "examples" / "trainer-grpo.yaml")]) == 2
    assert main(["plan", str(ROOT / "examples" / "rljob.yaml"), "--model-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 2 and check(err) == [], err


# -- every trainer config field the trainer may suggest ---------------------------------------


def test_every_did_you_mean_the_trainer_can_say_becomes_an_rljob_field_or_says_who_sets_it() -> None:
    from rljob_operator.admission import suggestion

    paths = config_paths(TrainConfig)
    assert "model.dtype" in paths and "rollout.weightSync.masterPort" in paths
    for path in paths:
        said = suggestion(path)
        assert check(said) == [], (path, said)
        assert said.startswith("did you mean spec.") or f"the trainer config's {path} " in said, (path, said)
    assert suggestion("model.dtype") == "did you mean spec.model.dtype?"
    assert suggestion("rollout.weightSync.masterPort") == "did you mean spec.weightSync.port?"
    assert suggestion("checkpoint.dir").endswith("is the operator's to write, from spec.checkpoint.volume "
                                                 "(mounted at /checkpoints)")  # fmt: skip


# -- every field path written in the operator's source ----------------------------------------


def string_literals(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else ANY for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def test_every_spec_path_in_the_operator_source_is_a_field() -> None:
    bad, seen = [], 0
    for file in sorted((ROOT / "operator" / "rljob_operator").glob("*.py")):
        for text in string_literals(file.read_text()):
            for path in SPEC_PATH.findall(text):
                seen += 1
                if not is_rljob_field(path):
                    bad.append(f"{file.name}: {path}")
    assert seen > 50 and bad == [], bad
