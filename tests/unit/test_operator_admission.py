"""The operator's allow-lists: task modules and image prefixes (``--allow-task-module``,
``--allow-image-prefix``; chart values ``admission.*``)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.cli import build_parser
from rljob_operator.plan import Limits, PlanError, plan, task_module_allowed
from rljob_operator.reconcile import Observed, decide

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
ACME = Limits(task_modules=("acme.tasks",))


def manifest(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml", "uid": "uid-1", "generation": 1}
    body["spec"].update(spec)
    return body


RULE = [
    ("acme.tasks:make", ("acme.tasks",), True),
    ("acme.tasks.math:make", ("acme.tasks",), True),  # a package allows its submodules
    ("acme.taskset:make", ("acme.tasks",), False),  # a prefix of the name is not a package
    ("acme:make", ("acme.tasks",), False),
    ("os:system", ("acme.tasks",), False),
    ("builtin:parity", ("acme.tasks",), True),  # built-in tasks run no user code
    ("os:system", (), True),  # nothing listed: any
    ("rl:make", ("acme.tasks", "rl"), True),
]


@pytest.mark.parametrize(("task", "allowed", "ok"), RULE)
def test_task_module_rule(task: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert task_module_allowed(task, allowed) is ok


def test_a_task_module_outside_the_list_is_refused_with_the_fix() -> None:
    with pytest.raises(PlanError) as info:
        plan(manifest(trainerConfig={"task": "os:system"}), limits=ACME)
    (error,) = info.value.errors
    assert error.path == "spec.trainerConfig.task"
    assert "'os:system' is not allowed by this operator" in error.message
    assert "task modules under acme.tasks" in error.message and "admission.allowedTaskModules" in error.message
    assert plan(manifest(trainerConfig={"task": "acme.tasks.math:make"}), limits=ACME).objects
    assert plan(manifest(), limits=ACME).objects  # the default task is built in
    assert plan(manifest(trainerConfig={"task": "os:system"})).objects  # no list: any


def test_images_outside_the_prefixes_are_refused() -> None:
    limits = Limits(image_prefixes=("ghcr.io/treetrain/", "registry.acme/"))
    images = {"trainer": "docker.io/evil/trainer:1", "rollout": "registry.acme/sglang:0.5"}
    with pytest.raises(PlanError) as info:
        plan(manifest(images=images), limits=limits)
    (error,) = info.value.errors
    assert error.path == "spec.images.trainer"
    assert "starting with ghcr.io/treetrain/ or registry.acme/" in error.message
    assert plan(manifest(), limits=limits).objects  # the default images are ghcr.io/treetrain/


def test_the_operator_says_valid_false_and_creates_nothing() -> None:
    d = decide(manifest(trainerConfig={"task": "os:system"}), Observed(), datetime(2026, 1, 1, tzinfo=UTC), ACME)
    valid = next(c for c in d.status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.trainerConfig.task" in valid["message"]
    assert d.apply == [] and d.create_only == [] and d.status["phase"] == "Failed"


def test_operator_flags() -> None:
    args = build_parser().parse_args(
        ["operator", "--allow-task-module", "acme.tasks", "--allow-task-module", "rl",
         "--allow-image-prefix", "registry.acme/"]
    )  # fmt: skip
    assert (args.allow_task_module, args.allow_image_prefix) == (["acme.tasks", "rl"], ["registry.acme/"])
    assert build_parser().parse_args(["operator"]).allow_task_module == []
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["operator", "--allow-task-module", "os:system"])
    assert info.value.code == 2
