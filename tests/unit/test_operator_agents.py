"""RLJobs that train an agent on a dataset: the trainer Service's ``openai`` port, the ``spec.data``
mount, and what admission refuses before anything is created (agent and reward modules against
the task-module allow-list, dataset URLs, an endpoint port that cannot be a Service port)."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.cli import main
from rljob_operator.observe import Observed
from rljob_operator.plan import Limits, PlanError, plan
from rljob_operator.reconcile import decide

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
ACME = Limits(task_modules=("acme.agents",))
AGENT = {
    "agent": "acme.agents.calc:run",
    "dataset": {"path": "/data/train.jsonl"},
    "reward": "builtin:math",
}


def manifest(trainer: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml", "uid": "uid-1", "generation": 1}
    body["spec"].update({"trainerConfig": copy.deepcopy(AGENT if trainer is None else trainer), **spec})
    return body


def problems(body: dict[str, Any], limits: Limits = Limits()) -> dict[str, str]:  # noqa: B008
    with pytest.raises(PlanError) as info:
        plan(body, limits=limits)
    return {e.path: e.message for e in info.value.errors}


def trainer_objects(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    objects = {(o["kind"], o["metadata"]["name"]): o for o in plan(body).objects}
    return objects[("Service", "job-trainer")], objects[("Job", "job-trainer")]


def test_an_agent_opens_the_openai_port_on_the_trainer_service_and_pod() -> None:
    service, job = trainer_objects(manifest())
    assert {"name": "openai", "port": 8000, "targetPort": 8000} in service["spec"]["ports"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "openai", "containerPort": 8000} in container["ports"]
    assert plan(manifest()).openai_endpoint() == "http://job-trainer-0.job-trainer.ml.svc:8000/v1"
    service, job = trainer_objects(manifest({**AGENT, "proxy": {"port": 8080}}))
    assert {"name": "openai", "port": 8080, "targetPort": 8080} in service["spec"]["ports"]


def test_without_an_agent_no_port_opens() -> None:
    body = manifest({"dataset": {"path": "/data/train.jsonl"}, "reward": "builtin:exact"})
    service, job = trainer_objects(body)
    assert "openai" not in {p["name"] for p in service["spec"]["ports"]}
    assert "openai" not in {p["name"] for p in job["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert plan(body).openai_endpoint() is None


@pytest.mark.parametrize(
    ("data", "volume"),
    [
        ({"configMap": "rows"}, {"name": "data", "configMap": {"name": "rows"}}),
        ({"claimName": "rows"}, {"name": "data", "persistentVolumeClaim": {"claimName": "rows", "readOnly": True}}),
    ],
)
def test_spec_data_is_mounted_read_only_at_data_in_the_trainer_pods(
    data: dict[str, str], volume: dict[str, Any]
) -> None:
    body = manifest(data=data)
    _, job = trainer_objects(body)
    pod = job["spec"]["template"]["spec"]
    assert volume in pod["volumes"]
    assert {"name": "data", "mountPath": "/data", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    rollout = next(o for o in plan(body).objects if o["kind"] == "StatefulSet")
    assert "data" not in {v["name"] for v in rollout["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize(
    ("data", "path", "words"),
    [
        ({"configMap": "rows", "claimName": "rows"}, "spec.data", "exactly one of claimName"),
        ({}, "spec.data", "exactly one of claimName"),
        ({"configMap": "Rows_1"}, "spec.data.configMap", "(the name of a ConfigMap)"),
        ({"claimName": "a..b"}, "spec.data.claimName", "(the name of a PersistentVolumeClaim)"),
    ],
)
def test_a_wrong_data_source_is_refused(data: dict[str, str], path: str, words: str) -> None:
    found = problems(manifest(data=data))
    assert words in found[path], found


@pytest.mark.parametrize("key", ["agent", "reward"])
def test_agent_and_reward_modules_follow_the_task_module_allow_list(key: str) -> None:
    trainer = {**AGENT, key: "os:system"}
    found = problems(manifest(trainer), ACME)
    assert list(found) == [f"spec.trainerConfig.{key}"]
    message = found[f"spec.trainerConfig.{key}"]
    assert "'os:system' is not allowed by this operator" in message and "modules under acme.agents" in message
    assert "admission.allowedTaskModules" in message
    assert plan(manifest(trainer)).objects  # nothing listed: any module
    assert plan(manifest({**AGENT, key: "acme.agents.deep.mod:fn"}), limits=ACME).objects  # a package's submodules


def test_builtin_rewards_need_no_allow_list_entry() -> None:
    for reward in ("builtin:math", "builtin:exact"):
        assert plan(manifest({**AGENT, "reward": reward}), limits=ACME).objects


@pytest.mark.parametrize("url", ["s3://bucket/train.jsonl", "hf://datasets/openai/gsm8k", "http://x/rows.json"])
@pytest.mark.parametrize("where", ["dataset", "eval"])
def test_a_dataset_url_is_refused_with_the_fix(url: str, where: str) -> None:
    trainer = copy.deepcopy(AGENT)
    if where == "dataset":
        trainer["dataset"]["path"] = url
        path = "spec.trainerConfig.dataset.path"
    else:
        trainer["eval"] = {"dataset": {"path": url}}
        path = "spec.trainerConfig.eval.dataset.path"
    found = problems(manifest(trainer))
    assert path in found, found
    assert f"{url!r} is a URL" in found[path] and "mount it into the pod and give the path" in found[path]


@pytest.mark.parametrize("path", ["/data/train.jsonl", "rows/train.parquet", "train.csv"])
def test_local_dataset_paths_pass(path: str) -> None:
    assert plan(manifest({**AGENT, "dataset": {"path": path}})).objects


@pytest.mark.parametrize(
    ("port", "words"),
    [(0, "cannot be a Service port"), (9400, "the trainer's metrics port"), (29500, "spec.masterPort")],
)
def test_an_endpoint_port_that_cannot_serve_is_refused(port: int, words: str) -> None:
    found = problems(manifest({**AGENT, "proxy": {"port": port}}))
    assert words in found["spec.trainerConfig.proxy.port"], found


def test_the_operator_says_valid_false_and_creates_nothing() -> None:
    body = manifest({**AGENT, "agent": "os:system"})
    d = decide(body, Observed(), datetime(2026, 1, 1, tzinfo=UTC), ACME)
    valid = next(c for c in d.status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.trainerConfig.agent" in valid["message"]
    assert d.apply == [] and d.create_only == []


def test_rljob_plan_prints_the_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rljob.yaml"
    path.write_text(yaml.safe_dump(manifest(data={"configMap": "rows"})))
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["openai_endpoint"] == "http://job-trainer-0.job-trainer.ml.svc:8000/v1"
    assert main(["plan", str(path)]) == 0
    assert "agent endpoint: http://job-trainer-0.job-trainer.ml.svc:8000/v1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("trainer", "path", "words"),
    [
        ({**AGENT, "reward": "builtin:nope"}, "spec.trainerConfig.reward", "unknown built-in reward 'builtin:nope'"),
        ({**AGENT, "reward": "acme rewards"}, "spec.trainerConfig.reward", "package.module:function"),
        ({**AGENT, "agent": "acme.agents"}, "spec.trainerConfig.agent", "package.module:function"),
        ({"agent": "acme.agents:run"}, "spec.trainerConfig.agent", "needs spec.trainerConfig.dataset"),
        ({"dataset": {"path": "/data/x.jsonl"}}, "spec.trainerConfig.reward", "needs a reward"),
        ({**AGENT, "reward": "builtin:regex"}, "spec.trainerConfig.rewardArgs.pattern", "needs rewardArgs.pattern"),
    ],
)
def test_the_trainer_configs_own_rules_refuse_at_admission_too(trainer: dict[str, Any], path: str, words: str) -> None:
    """The reward name, import-string forms and which key needs which are the trainer config's
    rules; admission says them with the RLJob field's path, before anything is created."""
    found = problems(manifest(trainer))
    assert words in found.get(path, ""), found


def test_an_agent_named_builtin_is_no_way_around_the_allow_list() -> None:
    """There are no built-in agents: ``builtin:run`` imports a module named builtin from the image."""
    found = problems(manifest({**AGENT, "agent": "builtin:run"}), ACME)
    assert "'builtin:run' is not allowed by this operator" in found["spec.trainerConfig.agent"]
    assert plan(manifest({**AGENT, "agent": "builtin:run"})).objects  # nothing listed: any
