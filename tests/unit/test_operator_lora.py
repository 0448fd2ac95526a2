"""``spec.actor.lora`` in the operator: copied into the trainer config, the rollout servers started
with LoRA for adapter sync (their flags planned from the adapter's rank and the staleness window),
the checkpoint volume mounted where they read the adapters, and admission's one-line refusals."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.plan import PlanError, plan
from rljob_operator.servers import lora_flags
from treetrain.alloc import registry
from treetrain.config import ConfigError, validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
VOLUME = {"claimName": "ckpt"}


def manifest(lora: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml", "uid": "uid-1"}
    if lora is not None:
        body["spec"]["actor"]["lora"] = lora
    body["spec"].update(spec)
    return body


def server(objects: list[dict[str, Any]], name: str = "job-rollout") -> dict[str, Any]:
    sts = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_lora_reaches_the_trainer_and_starts_vllm_with_lora() -> None:
    p = plan(
        manifest(
            {"rank": 16, "alpha": 32.0},
            rollout={"backend": "vllm:d2t4"},
            checkpoint={"volume": VOLUME},
            trainerConfig={"rollout": {"maxStaleness": 1}},
        )
    )
    config = yaml.safe_load(next(o for o in p.objects if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    assert config["actor"]["lora"] == {
        "rank": 16, "alpha": 32.0, "dropout": 0.0, "targetModules": "all-linear", "sync": "adapter",
    }  # fmt: skip
    assert validate(config) == p.config and p.config.actor.lora is not None
    container = server(p.objects)
    argv = container["command"]
    i = argv.index("--enable-lora")
    assert argv[i : i + 5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3"]  # maxStaleness 1 + 2
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # The servers read the adapters where the trainer saves them, even with distributed weight sync.
    assert any(m["mountPath"] == "/checkpoints" for m in container["volumeMounts"])


def test_sglang_flags_and_ranks_vllm_rounds_up() -> None:
    p = plan(
        manifest(
            {"rank": 8, "targetModules": ["q_proj", "v_proj"]},
            rollout={"backend": "sglang:d1t2"},
            checkpoint={"volume": VOLUME},
        )
    )
    argv = server(p.objects)["command"]
    i = argv.index("--enable-lora")
    # The synchronous default (servers: maxStaleness from the trainer config's default) keeps its window.
    keep = int(argv[argv.index("--max-loaded-loras") + 1])
    assert argv[i : i + 6] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
    assert argv[argv.index("--max-loras-per-batch") + 1] == str(keep + 1) and keep >= 2
    assert lora_flags("vllm", rank=4, targets=("q_proj",), keep=2)[0] == [
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="up to 512"):
        lora_flags("vllm", rank=1024, targets=("q_proj",), keep=2)


def test_merged_and_no_lora_start_plain_servers() -> None:
    for lora in (None, {"rank": 16, "sync": "merged"}):
        p = plan(manifest(lora, rollout={"backend": "vllm:d1t1"}))
        container = server(p.objects)
        assert "--enable-lora" not in container["command"]
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize(
    ("lora", "spec", "path", "words"),
    [
        ({"rank": 16}, {}, "spec.actor.lora.sync", "ReadWriteMany"),
        ({"rank": 16}, {"checkpoint": {"volume": {**VOLUME, "readOnly": True}}}, "spec.actor.lora.sync", "readOnly"),
        (
            {"rank": 1024},
            {"rollout": {"backend": "vllm:d1t1"}, "checkpoint": {"volume": VOLUME}},
            "spec.actor.lora.rank",
            "up to 512",
        ),
        ({"rank": 16, "targetModules": ["q_prj"]}, {"checkpoint": {"volume": VOLUME}}, "spec.actor.lora", "q_proj"),
        ({"rank": 0}, {"checkpoint": {"volume": VOLUME}}, "spec.actor.lora.rank", ""),
    ],
)
def test_admission_refuses_in_one_line(lora: dict[str, Any], spec: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(PlanError) as err:
        plan(manifest(lora, **spec))
    lines = [line for line in str(err.value).splitlines() if path in line]
    assert lines and words in lines[0], str(err.value)


def test_an_engine_without_lora_is_refused_by_the_config_and_at_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose description lacks LoRA is refused before any pod starts, in one line that
    names the engines that have it. Every registered training engine has LoRA now, so the check
    runs against a registry whose megatron entry says it has none (the refusal must still hold
    for an engine added without it)."""
    monkeypatch.setitem(registry.ENGINES, "megatron", dataclasses.replace(registry.spec_of("megatron"), lora=False))
    body = manifest({"rank": 16}, checkpoint={"volume": VOLUME})
    body["spec"]["actor"]["backend"] = "megatron:d8"
    with pytest.raises(PlanError) as err:
        plan(body)
    (line,) = [line for line in str(err.value).splitlines() if "spec.actor.lora" in line]
    assert "not built for the megatron engine" in line and "fsdp:... or archon:..." in line, line
    with pytest.raises(ConfigError) as refused:
        validate({"model": {"path": "m"}, "actor": {"backend": "megatron:d1", "lora": {"rank": 8}}})
    assert "actor.lora: LoRA is not built for the megatron engine yet" in str(refused.value), str(refused.value)


def test_every_training_engine_takes_lora_megatron_included() -> None:
    """Megatron has LoRA: actor.lora on a megatron backend validates and is admitted."""
    assert all(registry.spec_of(name).lora for name in registry.names("training"))
    validate({"model": {"path": "m"}, "actor": {"backend": "megatron:d1", "lora": {"rank": 8}}})
    body = manifest({"rank": 16}, checkpoint={"volume": VOLUME})
    body["spec"]["actor"]["backend"] = "megatron:d8"
    p = plan(body)
    assert p.config.actor.backend == "megatron:d8" and p.config.actor.lora is not None
    assert p.config.actor.lora.rank == 16
