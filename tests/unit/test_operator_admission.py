"""The operator's allow-lists: task modules and image prefixes (``--allow-task-module``,
``--allow-image-prefix``; chart values ``admission.*``)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.api_rules import image_allowed
from rljob_operator.cli import build_parser, main
from rljob_operator.observe import Observed
from rljob_operator.plan import Limits, PlanError, plan
from rljob_operator.policy import task_module_allowed
from rljob_operator.reconcile import decide

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
    assert "images under ghcr.io/treetrain/ or registry.acme/ (whole path segments)" in error.message
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


# ---------------------------------------------------------------------------
# What the API, its controllers and the servers would refuse or run (issue 21, items 2, 6, 7, 11)

LOCKED = Limits(task_modules=("acme.tasks",), image_prefixes=("ghcr.io/treetrain/",))


def problems(body: dict[str, Any], limits: Limits | None = None) -> list[tuple[str, str]]:
    with pytest.raises(PlanError) as info:
        plan(body, limits=limits or Limits())
    return [(e.path, e.message) for e in info.value.errors]


def named(name: str, **spec: Any) -> dict[str, Any]:
    body = manifest(**spec)
    body["metadata"]["name"] = name
    return body


@pytest.mark.parametrize(("engine", "over"), [("e" * 14, 1), ("e" * 20, 7)])
def test_an_engine_name_that_makes_a_label_over_63_is_refused_with_the_cut(engine: str, over: int) -> None:
    # A 30-character RLJob plus a 14- or 20-character engine passed: the StatefulSet controller
    # then cannot create pods (controller-revision-hash = <statefulset>-<10-char hash> > 63).
    found = problems(named("x" * 30, additionalRollouts=[{"name": engine, "backend": "vllm:d1"}]))
    assert {path for path, _ in found} == {"spec.additionalRollouts[0].name"}
    assert any("controller-revision-hash" in m and f"shorten the engine name {engine!r}" in m and f"by {over}" in m
               for _, m in found), found  # fmt: skip


def _label_values(objects: list[dict[str, Any]]) -> list[str]:
    """Every label value the children carry, and the ones their controllers give the pods."""
    values: list[str] = []
    for obj in objects:
        name = obj["metadata"]["name"]
        values += [name, *obj["metadata"].get("labels", {}).values()]
        template = obj.get("spec", {}).get("template", {})
        values += list(template.get("metadata", {}).get("labels", {}).values())
        if obj["kind"] == "StatefulSet":
            values += [f"{name}-{'9' * 10}", f"{name}-{obj['spec']['replicas'] - 1}"]
        if obj["kind"] == "Job":
            values += [f"{name}-{obj['spec']['completions'] - 1}"]
    return values


def test_the_longest_names_admitted_fit_every_label() -> None:
    body = named("x" * 30, additionalRollouts=[{"name": "e" * 13, "backend": "vllm:d2"}], maxRestarts=99)
    p = plan(body)
    assert max(len(v) for v in _label_values(p.objects)) <= 63


def test_a_name_starting_with_a_digit_is_refused_for_its_services() -> None:
    found = problems(named("1job"))
    assert found and all(path == "metadata.name" and "must start with a letter" in m for path, m in found)


SCHEDULING = [
    ({"queueName": "team-🚀"}, "spec.scheduling.queueName", "is not a valid label value"),
    ({"queueName": "q" * 64}, "spec.scheduling.queueName", "a label value is at most 63"),
    ({"priorityClassName": "high prio"}, "spec.scheduling.priorityClassName", "is not a DNS subdomain"),
    ({"nodeSelector": {"bad key!": "x"}}, "spec.scheduling.nodeSelector", "is not a qualified name"),
    ({"nodeSelector": {"pool": "a b"}}, "spec.scheduling.nodeSelector.pool", "is not a valid label value"),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "extra": 1}]}, "spec.scheduling.tolerations[0].extra",
     "is not a field of a toleration"),
    ({"tolerations": [{"key": "gpu", "operator": "In"}]}, "spec.scheduling.tolerations[0].operator",
     "must be Exists or Equal"),
    ({"tolerations": [{"operator": "Equal", "value": "x"}]}, "spec.scheduling.tolerations[0].operator",
     "only with operator: Exists"),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}, "spec.scheduling.tolerations[0].value",
     "must be empty with operator: Exists"),
    ({"tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 5}]},
     "spec.scheduling.tolerations[0].tolerationSeconds", "only with effect: NoExecute"),
    ({"tolerations": [{"key": "gpu", "effect": "Never"}]}, "spec.scheduling.tolerations[0].effect",
     "must be empty or one of NoSchedule"),
]  # fmt: skip


@pytest.mark.parametrize(("scheduling", "path", "phrase"), SCHEDULING)
def test_scheduling_the_api_would_refuse_is_refused_with_its_path(
    scheduling: dict[str, Any], path: str, phrase: str
) -> None:
    found = problems(manifest(scheduling=scheduling))
    assert any(p == path and phrase in m for p, m in found), found


def test_scheduling_the_api_takes_passes() -> None:
    scheduling = {
        "queueName": "team-a.gpu_1",
        "priorityClassName": "high.priority",
        "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge", "pool": ""},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute", "tolerationSeconds": 60},
            {"operator": "Exists"},
        ],
    }
    assert plan(manifest(scheduling=scheduling)).objects


@pytest.mark.parametrize("name", ["memory", "cpu", "nvidia.com", "kubernetes.io/gpu", "example.com/a b"])
def test_a_gpu_resource_that_is_not_an_extended_resource_is_refused(name: str) -> None:
    # memory rendered a one-byte memory request ("memory: 8").
    (found,) = problems(manifest(gpuResourceName=name))
    assert found[0] == "spec.gpuResourceName" and "extended resource name" in found[1]
    assert plan(manifest(gpuResourceName="amd.com/gpu")).objects


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"gpusPerNode": "8"}, "spec.gpusPerNode"),  # the API refuses a string where the CRD says integer
        ({"rollout": {"backend": "sglang:d2t4", "port": "30000"}}, "spec.rollout.port"),
        ({"maxRestarts": 2.0}, "spec.maxRestarts"),
        ({"suspend": "false"}, "spec.suspend"),
    ],
)
def test_values_of_the_wrong_type_are_refused_as_the_api_would(spec: dict[str, Any], path: str) -> None:
    assert [p for p, _ in problems(manifest(**spec))] == [path]


@pytest.mark.parametrize(
    ("task_args", "path", "phrase"),
    [
        ({"turns": "2"}, "spec.trainerConfig.taskArgs.turns", "takes an integer for turns, got '2'"),
        ({"turns": True}, "spec.trainerConfig.taskArgs.turns", "takes an integer"),
        ({"evenShare": "0.5"}, "spec.trainerConfig.taskArgs.evenShare", "takes a number"),
        ({"stopTokenIds": [1, "2"]}, "spec.trainerConfig.taskArgs.stopTokenIds", "takes a list of integers"),
    ],
)
def test_built_in_task_arguments_of_the_wrong_type_are_refused(
    task_args: dict[str, Any], path: str, phrase: str
) -> None:
    found = problems(manifest(trainerConfig={"task": "builtin:parity", "taskArgs": task_args}))
    assert any(p == path and phrase in m for p, m in found), found


def test_built_in_task_arguments_of_the_right_type_pass() -> None:
    args = {"turns": 2, "evenShare": 1, "stopTokenIds": [1, 2]}  # an int is a fine float
    assert plan(manifest(trainerConfig={"task": "builtin:parity", "taskArgs": args})).objects


def test_a_trainer_config_over_one_mebibyte_is_refused() -> None:
    big = {"task": "acme.tasks:make", "taskArgs": {"words": ["w" * 1000] * 1100}}
    (found,) = problems(manifest(trainerConfig=big))
    assert found[0] == "spec.trainerConfig" and "a ConfigMap holds at most 1048576" in found[1]


@pytest.mark.parametrize(
    ("model", "phrase"),
    [
        ({"path": "--trust-remote-code"}, "starts with '-', which the servers read as a flag"),
        ({"path": "-x", "volume": {"claimName": "weights"}}, "starts with '-'"),
        ({"path": "../etc", "volume": {"claimName": "weights"}}, "'..' segments"),
        ({"path": "a/../../etc", "volume": {"claimName": "weights"}}, "'..' segments"),
        ({"path": "/etc/shadow", "volume": {"claimName": "weights"}}, "is absolute"),
        ({"path": "acme/../x"}, "'..' segments"),
        ({"path": "m", "volume": {"claimName": "Bad_Claim"}}, "is not a DNS subdomain"),
    ],
)
def test_model_paths_that_are_flags_or_leave_the_volume_are_refused(model: dict[str, Any], phrase: str) -> None:
    found = problems(manifest(model=model))  # with or without allow-lists
    assert len(found) == 1 and found[0][0].startswith("spec.model.") and phrase in found[0][1], found


def test_model_paths_inside_the_volume_pass() -> None:
    assert plan(manifest(model={"path": "qwen/qwen3-8b", "volume": {"claimName": "weights"}})).objects
    assert plan(manifest(model={"path": "Qwen/Qwen3-8B"})).objects


CODE_LOADING = [
    ["--trust-remote-code"],
    ["--trust_remote_code"],  # vLLM reads '_' as '-'
    ["--trust-remote"],  # an argparse prefix of it
    ["--max-model-len", "4096", "--middleware=evil.app"],
    ["--middleware", "evil.app"],
    ["--worker-extension-cls", "evil.Ext"],
    ["--kv-transfer-config.kv_connector_module_path", "evil"],  # vLLM's dotted JSON form
    ["--config", "/models/flags.yaml"],  # flags from a file
    ["--chat-template", "/models/t.jinja"],
    ["--logits-processors", "evil:P"],
    ["--tool-parser-plugin", "/models/p.py"],
    ["--enable-custom-logit-processor"],  # SGLang: requests then carry code
]


@pytest.mark.parametrize("backend", ["vllm:d2t4", "sglang:d2t4"])
@pytest.mark.parametrize("args", CODE_LOADING, ids=lambda a: a[-1] if len(a) > 1 and "=" not in a[-1] else a[0])
def test_under_allow_lists_server_flags_that_load_code_are_refused(backend: str, args: list[str]) -> None:
    body = manifest(rollout={"backend": backend, "serverArgs": args})
    found = problems(body, LOCKED)
    assert found and all(p.startswith("spec.rollout.serverArgs[") and "admission.allowedServerFlags" in m
                         for p, m in found), found  # fmt: skip
    assert plan(body).objects  # no allow-list: any flag


def test_under_allow_lists_safe_flags_and_the_admins_flags_pass() -> None:
    safe = {"vllm:d2t4": ["--max-model-len", "4096", "--gpu-memory-utilization=0.8", "--enforce-eager"],
            "sglang:d2t4": ["--mem-fraction-static", "0.8", "--context-length", "8192", "--disable-radix-cache"]}  # fmt: skip
    for backend, args in safe.items():
        assert plan(manifest(rollout={"backend": backend, "serverArgs": args}), limits=LOCKED).objects
    trusted = Limits(task_modules=("acme.tasks",), server_flags=("--trust-remote-code",))
    extra = [{"name": "v", "backend": "vllm:d1", "serverArgs": ["--trust-remote-code"]}]
    assert plan(manifest(additionalRollouts=extra), limits=trusted).objects
    (found,) = problems(manifest(additionalRollouts=[{**extra[0], "serverArgs": ["--middleware", "x"]}]), trusted)
    assert found[0] == "spec.additionalRollouts[0].serverArgs[0]"


IMAGES = [
    ("ghcr.io/treetrain/trainer:1", ("ghcr.io/treetrain",), True),
    ("ghcr.io/treetrain:1", ("ghcr.io/treetrain",), True),
    ("ghcr.io/treetrain@sha256:ab", ("ghcr.io/treetrain",), True),
    ("ghcr.io/treetrainevil/x:1", ("ghcr.io/treetrain",), False),  # a prefix of a segment is not the segment
    ("ghcr.io.evil.com/treetrain/x", ("ghcr.io",), False),
    ("ghcr.io/treetrain/trainer:1", ("ghcr.io/treetrain/",), True),
    ("ghcr.io/treetrain/trainer:1.2", ("ghcr.io/treetrain/trainer:1",), False),  # tag 1 is not tag 1.2
    ("ghcr.io/treetrain/trainer:1.2", ("ghcr.io/treetrain/trainer:",), True),  # ends with ':': any tag
    ("docker.io/x", ("",), False),
]


@pytest.mark.parametrize(("image", "prefixes", "ok"), IMAGES)
def test_image_prefixes_match_whole_segments(image: str, prefixes: tuple[str, ...], ok: bool) -> None:
    assert image_allowed(image, prefixes) is ok


def test_an_image_under_a_lookalike_prefix_is_refused() -> None:
    limits = Limits(image_prefixes=("ghcr.io/treetrain",))
    (found,) = problems(manifest(images={"rollout": "ghcr.io/treetrainevil/x:1"}), limits)
    assert found[0] == "spec.images.rollout"
    assert plan(manifest(), limits=limits).objects


def test_server_flag_option() -> None:
    args = build_parser().parse_args(["operator", "--allow-server-flag=--trust_remote_code"])
    assert args.allow_server_flag == ["--trust-remote-code"]
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["operator", "--allow-server-flag", "--middleware=x"])
    assert info.value.code == 2


def test_rljob_plan_lists_every_problem_with_path_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = named(
        "x" * 30,
        gpusPerNode=8,
        gpuResourceName="memory",
        model={"path": "--trust-remote-code"},
        additionalRollouts=[{"name": "e" * 20, "backend": "vllm:d1"}],
        scheduling={"queueName": "team-🚀", "tolerations": [{"key": "a", "oops": 1}]},
        trainerConfig={"taskArgs": {"turns": "2"}},
    )
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump(body, allow_unicode=True))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for field in ("spec.gpuResourceName", "spec.model.path", "spec.scheduling.queueName",
                  "spec.scheduling.tolerations[0].oops", "spec.trainerConfig.taskArgs.turns"):  # fmt: skip
        assert f"  - {field}: " in err, err
    # The child names are checked on the rendered children, once the spec itself is fine.
    body = named("x" * 30, additionalRollouts=[{"name": "e" * 20, "backend": "vllm:d1"}])
    path.write_text(yaml.safe_dump(body))
    assert main(["plan", str(path)]) == 2
    assert "  - spec.additionalRollouts[0].name: StatefulSet" in capsys.readouterr().err


def test_asynchronous_rollout_without_rollout_servers_is_refused_at_admission() -> None:
    """trainer.rollout.maxStaleness >= 1 needs servers: an RLJob with no rollout engine (local
    rollout in the trainer) is refused with the key's path and the fix, before any pod exists."""
    body = manifest(trainerConfig={"rollout": {"maxStaleness": 2}})
    del body["spec"]["rollout"]
    found = dict(problems(body))
    assert "needs rollout servers" in found["spec.trainerConfig.rollout.maxStaleness"]
    assert "fix: set it to 0, or add rollout.servers" in found["spec.trainerConfig.rollout.maxStaleness"]
    assert plan(manifest(trainerConfig={"rollout": {"maxStaleness": 2}})).objects  # with servers: admitted
