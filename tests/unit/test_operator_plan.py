"""The pure planner: manifest -> components and child objects, every error with its path."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_operator.layout import rollout_servers
from rljob_operator.models import RESERVED_ENGINE_NAMES
from rljob_operator.network import NetworkSettings, parse_peer, with_fresh_key
from rljob_operator.plan import Limits, PlanError, plan
from rljob_operator.servers import multi_node_command, server_argv, server_auth
from treetrain.alloc import parse
from treetrain.config import load, validate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())


def manifest(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml", "uid": "uid-1"}
    body["spec"].update(spec)
    return body


def by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_smallest_valid_rljob_from_design() -> None:
    p = plan(EXAMPLE)
    assert p.summary() == {
        "components": {
            "rollout": {"backend": "sglang:d2t4", "gpus": 8, "pods": 2, "gpus_per_pod": 4, "nodes": 1,
                        "world_size": 8, "kind": "inference"},
            "actor": {"backend": "fsdp:d8", "gpus": 8, "pods": 1, "gpus_per_pod": 8, "nodes": 1,
                      "world_size": 8, "kind": "training"},
        },
        "total_gpus": 16,
    }  # fmt: skip
    assert sorted(by_kind(p.objects)) == [
        ("ConfigMap", "demo-config"),
        ("Job", "demo-trainer"),
        ("NetworkPolicy", "demo-network"),
        ("Secret", "demo-api-key"),
        ("Service", "demo-rollout"),
        ("Service", "demo-trainer"),
        ("StatefulSet", "demo-rollout"),
    ]


def test_children_labels_and_owner() -> None:
    p = plan(manifest())
    for obj in p.objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "rljob-operator"
        assert meta["labels"]["treetrain.dev/rljob"] == "job"
        assert meta["labels"]["treetrain.dev/component"] in ("rollout", "actor", "network")
        (owner,) = meta["ownerReferences"]
        assert owner == {"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "name": "job", "uid": "uid-1",
                         "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def test_trainer_job_rendezvous() -> None:
    p = plan(manifest(actor={"backend": "fsdp:d4t4"}), restart=2)
    objects = by_kind(p.objects)
    job = objects[("Job", "job-trainer-r2")]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "job-trainer" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "8"
    assert env["PET_MASTER_ADDR"] == "job-trainer-r2-0.job-trainer.ml.svc"
    assert env["PET_NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert env["TREETRAIN_CONFIG"] == "/etc/treetrain/config.yaml"
    assert env["TREETRAIN_RESTART"] == "2"
    # Said once, in the config: no env var repeats a config setting.
    assert not {"TREETRAIN_CHECKPOINT_DIR", "TREETRAIN_ROLLOUT_ENDPOINTS", "TREETRAIN_ATTENTION"} & set(env)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert container["command"][:3] == ["torchrun", "-m", "treetrain.cli"]
    service = objects[("Service", "job-trainer")]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True


def test_config_map_is_the_checked_trainer_config() -> None:
    p = plan(manifest(trainerConfig={"steps": 10, "optimizer": {"lr": 1e-6}}, checkpoint={"intervalSteps": 7}))
    text = by_kind(p.objects)[("ConfigMap", "job-config")]["data"]["config.yaml"]
    config = yaml.safe_load(text)
    assert config["trainer"] == {"steps": 10, "optimizer": {"lr": 1e-6}}
    assert config["checkpoint"] == {"dir": "/checkpoints", "intervalSteps": 7}
    assert config["actor"]["backend"] == "fsdp:d8"
    assert config["actor"]["treeTraining"] == {
        "enabled": True, "maxTokensPerMicrobatch": 32768, "attention": "auto", "blockSize": 128, "padToMaximum": False,
    }  # fmt: skip
    assert config["rollout"]["servers"] == [{"url": u, "kind": k, "gpus": 4} for u, k in rollout_servers(p.layout)]
    assert config["rollout"]["weightSync"] == {
        "method": "distributed", "masterAddress": "job-trainer-0.job-trainer.ml.svc", "masterPort": 29600,
        "bucketMb": 512, "timeoutSeconds": 600.0,
    }  # fmt: skip
    assert validate(config) == p.config  # the trainer reads back exactly what was planned


def test_rollout_statefulset() -> None:
    p = plan(manifest(rollout={"backend": "sglang:d2t4", "serverArgs": ["--mem-fraction-static", "0.8"]}))
    sts = by_kind(p.objects)[("StatefulSet", "job-rollout")]
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "job-rollout"
    pod = sts["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False  # a Service named like the server would break its env vars
    (container,) = pod["containers"]
    assert container["command"] == [
        "python3", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B", "--host", "0.0.0.0",
        "--port", "30000", "--tp-size", "4", "--pp-size", "1", "--dp-size", "1", "--enable-metrics",
        "--mem-fraction-static", "0.8", "--api-key", "$(TREETRAIN_ROLLOUT_API_KEY)",
    ]  # fmt: skip
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    env = {e["name"]: e for e in container["env"]}
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"]["value"] == "false"


def test_vllm_command() -> None:
    argv = server_argv(parse("vllm:d2p2t2"), model="/models/m", port=8000, extra_args=["--max-model-len", "4096"])
    assert argv == [
        "vllm", "serve", "/models/m", "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--max-model-len", "4096",
    ]  # fmt: skip


def test_multi_node_instances() -> None:
    p = plan(manifest(rollout={"backend": "sglang:d2t16"}))
    sts = by_kind(p.objects)[("StatefulSet", "job-rollout")]
    assert sts["spec"]["replicas"] == 4  # 2 instances x 2 pods of 8 GPUs
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    script = container["command"][2]
    assert 'RANK=$((POD_INDEX % 2)); LEADER="job-rollout-$((POD_INDEX - RANK)).job-rollout.ml.svc"' in script
    assert 'exec "$@" --nnodes 2 --node-rank "$RANK" --dist-init-addr "$LEADER:20000"' in script
    assert container["command"][4:7] == ["python3", "-m", "sglang.launch_server"]  # the argv: arguments, not script
    # The trainer talks only to instance leaders (ordinals 0 and 2).
    assert rollout_servers(p.layout) == [
        ("http://job-rollout-0.job-rollout.ml.svc:30000", "sglang"),
        ("http://job-rollout-2.job-rollout.ml.svc:30000", "sglang"),
    ]


def test_vllm_multi_node_workers_are_headless() -> None:
    argv = server_argv(parse("vllm:t16"), model="m", port=8000, extra_args=[])
    script = multi_node_command(argv, backend="vllm", pods_per_instance=2, leader_dns="x-{ordinal}.x.ns.svc")[2]
    assert 'if [ "$RANK" -ne 0 ]; then exec "$@" --nnodes 2 --node-rank "$RANK"' in script and "--headless" in script


NASTY = ["$(touch {canary})", "`touch {canary}`", 'a"b', "it's", "$HOME", "a b\tc", "\n;touch {canary}", "--x=$((1+1))"]


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
@pytest.mark.parametrize("pod_index", ["0", "3"])
def test_user_strings_reach_the_server_byte_for_byte_and_run_nothing(
    tmp_path: Path, backend: str, pod_index: str
) -> None:
    """The multi-pod wrapper runs through the real /bin/sh with a stand-in server that prints its
    argv: the model path and every serverArgs entry arrive unchanged, and nothing executes."""
    canary = tmp_path / "executed"
    nasty = [n.format(canary=canary) for n in NASTY]
    p = plan(manifest(rollout={"backend": f"{backend}:d2t16", "serverArgs": nasty[1:]}, model={"path": nasty[0]}))
    sts = by_kind(p.objects)[("StatefulSet", "job-rollout")]
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    program = 2 + 2  # /bin/sh -c SCRIPT $0, then the server argv
    server = 3 if backend == "sglang" else 2  # python3 -m sglang.launch_server | vllm serve
    stand_in = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]
    run = [*command[:program], *stand_in, *command[program + server :]]
    out = subprocess.run(run, capture_output=True, text=True, env={"POD_INDEX": pod_index, "PATH": "/usr/bin:/bin"},
                         check=True, timeout=60)  # fmt: skip
    argv = json.loads(out.stdout)
    assert nasty[0] in argv and all(arg in argv for arg in nasty[1:]), argv
    assert not canary.exists()


def test_gang_and_kueue_pod_group() -> None:
    p = plan(manifest(scheduling={"queueName": "team-a", "priorityClassName": "high", "nodeSelector": {"pool": "h200"},
                                  "tolerations": [{"key": "gpu", "operator": "Exists"}]}))  # fmt: skip
    templates = [o["spec"]["template"] for o in p.objects if o["kind"] in ("Job", "StatefulSet")]
    assert len(templates) == 2
    for template in templates:
        labels = template["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "job"
        assert labels["treetrain.dev/gang"] == "job"
        assert template["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        spec = template["spec"]
        assert spec["priorityClassName"] == "high" and spec["nodeSelector"] == {"pool": "h200"}
        assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]


def test_critic_and_ref() -> None:
    p = plan(manifest(critic={}, ref={"backend": "fsdp:d2t4"}, trainerConfig={"algorithm": "ppo"}))
    summary = p.summary()["components"]
    assert summary["critic"] == {"backend": "fsdp:d8", "gpus": 0, "pods": 0, "gpus_per_pod": 8, "nodes": 0,
                                 "world_size": 8, "kind": "training", "colocated_with": "actor"}  # fmt: skip
    assert summary["ref"]["backend"] == "fsdp:d2t4" and summary["ref"]["gpus"] == 0
    assert p.total_gpus == 16
    assert [o["metadata"]["name"] for o in p.objects if o["kind"] == "Job"] == ["job-trainer"]
    config = yaml.safe_load(by_kind(p.objects)[("ConfigMap", "job-config")]["data"]["config.yaml"])
    assert config["critic"] == {"backend": "fsdp:d8", "colocated": True}


def test_each_rollout_server_has_its_engines_kind() -> None:
    mixed = plan(manifest(additionalRollouts=[{"name": "v", "backend": "vllm:d1", "port": 8000}]))
    config = yaml.safe_load(by_kind(mixed.objects)[("ConfigMap", "job-config")]["data"]["config.yaml"])
    assert config["rollout"]["servers"] == [
        {"url": "http://job-rollout-0.job-rollout.ml.svc:30000", "kind": "sglang", "gpus": 4},
        {"url": "http://job-rollout-1.job-rollout.ml.svc:30000", "kind": "sglang", "gpus": 4},
        {"url": "http://job-rollout-v-0.job-rollout-v.ml.svc:8000", "kind": "vllm", "gpus": 1},
    ]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_distributed_weight_sync_is_wired_on_both_sides() -> None:
    """The default: trainer rank 0 hosts the group's rendezvous on a port of the trainer's headless
    Service; the config names it and every server's GPUs (its ranks), and the rollout pods say
    their side; vLLM pods get dev mode and our worker extension."""
    p = plan(manifest(additionalRollouts=[{"name": "v", "backend": "vllm:d2t2", "port": 8000}]), restart=1)
    objects = by_kind(p.objects)
    config = yaml.safe_load(objects[("ConfigMap", "job-config")]["data"]["config.yaml"])
    rendezvous = "job-trainer-r1-0.job-trainer.ml.svc"  # pod 0 of this restart's Job
    assert config["rollout"]["weightSync"]["masterAddress"] == rendezvous
    assert [s["gpus"] for s in config["rollout"]["servers"]] == [4, 4, 2, 2]
    assert p.weight_sync() == {
        "method": "distributed", "rendezvous": f"{rendezvous}:29600", "world_size": 13,
        "ranks": {"trainer": "0", "rollout": "1-8", "rollout-v": "9-12"},
    }  # fmt: skip
    service = objects[("Service", "job-trainer")]
    assert {"name": "weight-sync", "port": 29600, "targetPort": 29600} in service["spec"]["ports"]
    (trainer,) = objects[("Job", "job-trainer-r1")]["spec"]["template"]["spec"]["containers"]
    assert {"name": "weight-sync", "containerPort": 29600} in trainer["ports"]
    for sts, ranks in (("job-rollout", "1-8"), ("job-rollout-v", "9-12")):
        template = objects[("StatefulSet", sts)]["spec"]["template"]
        assert template["metadata"]["annotations"] == {
            "treetrain.dev/weight-sync": "distributed",
            "treetrain.dev/weight-sync-rendezvous": f"{rendezvous}:29600",
            "treetrain.dev/weight-sync-world-size": "13",
            "treetrain.dev/weight-sync-ranks": ranks,
        }
        assert "checkpoints" not in {v["name"] for v in template["spec"]["volumes"]}
    (vllm,) = objects[("StatefulSet", "job-rollout-v")]["spec"]["template"]["spec"]["containers"]
    assert _env(vllm)["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /resume, /collective_rpc answer 404 without it
    assert vllm["command"][-2:] == ["--worker-extension-cls", "treetrain.rl.vllm_worker.WeightSyncExtension"]
    (sglang,) = objects[("StatefulSet", "job-rollout")]["spec"]["template"]["spec"]["containers"]
    assert "VLLM_SERVER_DEV_MODE" not in _env(sglang) and "--worker-extension-cls" not in sglang["command"]
    assert validate(config) == p.config


def test_disk_weight_sync_mounts_the_checkpoint_claim_in_rollout_pods() -> None:
    p = plan(
        manifest(
            rollout={"backend": "vllm:d2t4"},
            weightSync={"method": "disk"},
            checkpoint={"volume": {"claimName": "shared-rwx"}},
        )
    )
    objects = by_kind(p.objects)
    config = yaml.safe_load(objects[("ConfigMap", "job-config")]["data"]["config.yaml"])
    assert config["rollout"]["weightSync"] == {"method": "disk"}
    pod = objects[("StatefulSet", "job-rollout")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "shared-rwx"}
    (server,) = pod["containers"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints", "readOnly": True} in server["volumeMounts"]
    assert _env(server)["VLLM_SERVER_DEV_MODE"] == "1"
    assert server["command"][-2:] == ["--worker-extension-cls", "treetrain.rl.vllm_worker.WeightSyncExtension"]
    (trainer,) = objects[("Job", "job-trainer")]["spec"]["template"]["spec"]["containers"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in trainer["volumeMounts"]  # the same path
    assert "weight-sync" not in {port["name"] for port in trainer["ports"]}
    assert p.weight_sync() == {"method": "disk", "dir": "/checkpoints/weights", "claim": "shared-rwx"}


@pytest.mark.parametrize(
    ("spec", "path", "words"),
    [
        ({"weightSync": {"method": "disk"}}, "spec.weightSync.method", "set spec.checkpoint.volume.claimName to a "
         "ReadWriteMany claim, or use method: distributed"),
        ({"weightSync": {"method": "disk"}, "checkpoint": {"volume": {"claimName": "c", "readOnly": True}}},
         "spec.checkpoint.volume.readOnly", "writes the weights there"),
        ({"weightSync": {"port": 29500}}, "spec.weightSync.port", "taken by spec.masterPort"),
        ({"weightSync": {"method": "nfs"}}, "spec.weightSync.method", "'distributed' or 'disk'"),
    ],
)  # fmt: skip
def test_weight_sync_mistakes_are_refused_with_the_fix(spec: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(PlanError) as info:
        plan(manifest(**spec))
    assert any(e.path == path and words in e.message for e in info.value.errors), info.value.errors


def test_checkpoints_without_a_volume_are_ephemeral() -> None:
    assert plan(manifest()).checkpoints() == {
        "dir": "/checkpoints", "persistent": False,
        "why": "no spec.checkpoint.volume: checkpoints live in the trainer pod's emptyDir and die with it, so a "
        "restarted trainer gang starts from step 0; set spec.checkpoint.volume.claimName to keep them",
    }  # fmt: skip
    kept = plan(manifest(checkpoint={"volume": {"claimName": "ckpt"}})).checkpoints()
    assert kept == {"dir": "/checkpoints", "persistent": True, "claim": "ckpt"}


def test_additional_rollouts() -> None:
    p = plan(manifest(additionalRollouts=[{"name": "small", "backend": "vllm:d2"}]))
    assert ("StatefulSet", "job-rollout-small") in by_kind(p.objects)
    assert len(rollout_servers(p.layout)) == 4


def test_model_volume() -> None:
    p = plan(manifest(model={"path": "qwen3-8b", "volume": {"claimName": "weights", "readOnly": True}}))
    sts = by_kind(p.objects)[("StatefulSet", "job-rollout")]
    assert "/models/qwen3-8b" in sts["spec"]["template"]["spec"]["containers"][0]["command"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


INVALID = [
    ({"rollout": {"backend": "fsdp:d2"}}, "spec.rollout.backend", "is a training backend; rollout needs sglang"),
    ({"actor": {"backend": "sglang:d2"}}, "spec.actor.backend", "is a inference backend"),
    ({"actor": {"backend": "fsdp:d12"}}, "spec.actor.backend", "does not fill whole nodes of 8 GPUs"),
    ({"actor": {"backend": "fsdp.d4"}}, "spec.actor.backend", "use ':' between backend and dims"),
    ({"critic": {"backend": "fsdp:d4"}}, "spec.critic.backend", "world size must equal the actor's (4 != 8)"),
    ({"ref": {"colocated": False}}, "spec.ref.colocated", "in its own pods is not supported yet"),
    ({"gpusPerNode": 0}, "spec.gpusPerNode", "greater than or equal to 1"),
    ({"bogus": 1}, "spec.bogus", "is not a field of RLJob"),
    ({"actor": {}}, "spec.actor.backend", "is required"),
    # The trainer's own rules, in its words, before anything is created:
    (
        {"trainerConfig": {"steps": 10, "lr": 1e-6}},
        "spec.trainerConfig.lr",
        "did you mean spec.trainerConfig.optimizer.lr?",
    ),
    ({"trainerConfig": {"optimizr": {}}}, "spec.trainerConfig.optimizr", "did you mean spec.trainerConfig.optimizer?"),
    ({"trainerConfig": {"steps": "10"}}, "spec.trainerConfig.steps", "valid integer"),
    ({"trainerConfig": {"task": "builtin:chess"}}, "spec.trainerConfig.task", "unknown built-in task 'builtin:chess'"),
    ({"trainerConfig": {"algorithm": "ppo"}}, "spec.trainerConfig.algorithm", "ppo needs a critic"),
    (
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"maxTokensPerMicrobatch": 1000}}},
        "spec.actor.treeTraining.maxTokensPerMicrobatch",
        "1000 must be a multiple of 128 (lcm of blockSize=128 and t=1); use 896 or 1024",
    ),
    (
        {"actor": {"backend": "fsdp:t8", "treeTraining": {"maxTokensPerMicrobatch": 12, "blockSize": 4}}},
        "spec.actor.treeTraining.maxTokensPerMicrobatch",
        "12 must be a multiple of 8 (lcm of blockSize=4 and t=8); use 8 or 16",
    ),
    # Archon splits each tree's rows over c as well: once refused only in the pod.
    (
        {"actor": {"backend": "archon:c3", "treeTraining": {"maxTokensPerMicrobatch": 1024, "blockSize": 128}}},
        "spec.actor.treeTraining.maxTokensPerMicrobatch",
        "1024 must be a multiple of 384 (lcm of blockSize=128 and t*c=3); use 768 or 1152",
    ),
    ({"actor": {"backend": "fsdp:c2d4"}}, "spec.actor.backend", "context parallelism is not supported by the FSDP"),
    (
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"attention": "flash"}}},
        "spec.actor.treeTraining.attention",
        "'auto', 'flex', 'triton', 'sparse' or 'dense'",
    ),
    (
        {"additionalRollouts": [{"name": "a", "backend": "sglang:d1"}, {"name": "a", "backend": "sglang:d1"}]},
        "spec.additionalRollouts[1].name",
        "used twice",
    ),
]


@pytest.mark.parametrize(("spec", "path", "phrase"), INVALID)
def test_invalid(spec: dict[str, Any], path: str, phrase: str) -> None:
    with pytest.raises(PlanError) as info:
        plan(manifest(**spec))
    messages = {e.path: e.message for e in info.value.errors}
    assert path in messages, info.value.errors
    assert phrase in messages[path]


def test_every_problem_is_listed() -> None:
    body = manifest(rollout={"backend": "fsdp:d2"}, actor={"backend": "fsdp:d12"}, bogus=1)
    body["metadata"]["name"] = "Bad_Name"
    body["kind"] = "Job"
    with pytest.raises(PlanError) as info:
        plan(body)
    assert [e.path for e in info.value.errors] == [
        "kind", "metadata.name", "spec.bogus", "spec.rollout.backend", "spec.actor.backend",
    ]  # fmt: skip


def test_every_trainer_mistake_is_listed_with_its_path() -> None:
    body = manifest(
        actor={"backend": "fsdp:c2d4", "treeTraining": {"maxTokensPerMicrobatch": 1000, "attention": "flash"}},
        trainerConfig={"steps": 10, "lr": 1e-6},
    )
    with pytest.raises(PlanError) as info:
        plan(body)
    assert sorted(e.path for e in info.value.errors) == [
        "spec.actor.backend", "spec.actor.treeTraining.attention", "spec.trainerConfig.lr",
    ]  # fmt: skip


def test_the_trainer_pod_reads_what_was_planned(tmp_path: Path) -> None:
    """What the trainer container does with the rendered objects: the ConfigMap's file, read by
    the trainer's own loader with the container's environment (its TREETRAIN_* variables apply
    on top), gives exactly the config plan() checked, and the restart it was rendered for."""
    p = plan(manifest(critic={}, trainerConfig={"algorithm": "ppo"}), restart=2)
    objects = by_kind(p.objects)
    (container,) = objects[("Job", "job-trainer-r2")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    path = tmp_path / Path(env["TREETRAIN_CONFIG"]).name
    path.write_text(objects[("ConfigMap", "job-config")]["data"]["config.yaml"])
    config, launch = load(path, env=env)
    assert config == p.config and launch.restart == 2
    assert config.trainer.algorithm == "ppo" and config.critic is not None and config.critic.colocated


def test_name_length_limit() -> None:
    body = manifest()
    body["metadata"]["name"] = "x" * 31
    with pytest.raises(PlanError, match="at most 30 characters"):
        plan(body)


def _child_names(p: Any) -> set[str]:
    """Every name an RLJob's children take in its namespace: objects, StatefulSet pods
    (hostnames) and indexed trainer pods (hostnames)."""
    names = set()
    for obj in p.objects:
        names.add(obj["metadata"]["name"])
        if obj["kind"] == "StatefulSet":
            names |= {f"{obj['metadata']['name']}-{i}" for i in range(obj["spec"]["replicas"])}
        if obj["kind"] == "Job":
            names |= {f"{obj['metadata']['name']}-{i}" for i in range(obj["spec"]["completions"])}
    return names


def test_reserved_engine_names_are_refused() -> None:
    with pytest.raises(PlanError, match="engine name 'trainer' is reserved"):
        plan(manifest(additionalRollouts=[{"name": "trainer", "backend": "vllm:d1"}]))
    with pytest.raises(PlanError, match=r"spec\.additionalRollouts\.0\.name"):
        plan(manifest(additionalRollouts=[{"name": "small-v2", "backend": "vllm:d1"}]))  # no '-' in engine names


@settings(max_examples=300, deadline=None)
@given(
    base=st.from_regex(r"[a-z][a-z0-9]{0,5}", fullmatch=True),
    extra=st.lists(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True), max_size=2),
    tail=st.sampled_from(["rollout", "trainer", "config", "critic", "rollout-x", "trainer-r1", "x"]),
    engines=st.lists(
        st.sampled_from(RESERVED_ENGINE_NAMES) | st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True),
        max_size=2,
        unique=True,
    ),
)
def test_two_rljobs_never_share_a_child_name(base: str, extra: list[str], tail: str, engines: list[str]) -> None:
    # RLJob "a" with an engine "trainer" and RLJob "a-rollout" both owned Service
    # "a-rollout-trainer" (its selector flipped between them): names must never collide.
    first_name = "-".join([base, *extra])
    second_name = f"{first_name}-{tail}"
    plans = []
    for name, engine_names in ((first_name, engines), (second_name, engines[::-1])):
        rollouts = [{"name": e, "backend": "vllm:d2"} for e in engine_names]
        body = manifest(additionalRollouts=rollouts, critic={}, trainerConfig={"algorithm": "ppo"})
        body["metadata"]["name"] = name
        try:
            plans.append(plan(body))
        except PlanError:
            return  # a name the planner refuses creates nothing
    assert not _child_names(plans[0]) & _child_names(plans[1])


def test_every_pod_is_hardened() -> None:
    """Restricted Pod Security: non-root, no privilege escalation, no capabilities, RuntimeDefault
    seccomp; no ServiceAccount token; cpu/memory requests (not BestEffort); a bounded /dev/shm;
    a grace period long enough to finish the step and checkpoint."""
    p = plan(manifest(rollout={"backend": "sglang:d2t16"}, critic={}, trainerConfig={"algorithm": "ppo"}))
    templates = {o["kind"]: o["spec"]["template"]["spec"] for o in p.objects if o["kind"] in ("Job", "StatefulSet")}
    assert set(templates) == {"Job", "StatefulSet"}
    for kind, pod in templates.items():
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        requests = container["resources"]["requests"]
        assert requests["cpu"] and requests["memory"], kind
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert templates["Job"]["terminationGracePeriodSeconds"] >= 600


def test_a_request_beyond_the_ceilings_is_refused_before_anything_is_rendered() -> None:
    # sglang:t1000000000 created a StatefulSet of 125,000,000 replicas; sglang:d999999999 OOM-killed
    # the operator building one URL per instance. Sizes are bounded by the parser, totals here.
    import time

    from rljob_operator.plan import Limits

    started = time.monotonic()
    with pytest.raises(PlanError, match=r"asks for 65544 GPUs in 65537 pods; this operator allows at most 4096"):
        plan(manifest(rollout={"backend": "sglang:d65536"}))
    assert time.monotonic() - started < 5  # refused before 65,536 server URLs are built
    with pytest.raises(PlanError, match="at most 8 GPUs"):
        plan(manifest(), limits=Limits(max_gpus=8, max_pods=100))


# ---------------------------------------------------------------------------
# Network: the NetworkPolicy per RLJob and the rollout servers' API key (operator/rljob_operator/network.py)

PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
TWO_ENGINES = {"additionalRollouts": [{"name": "small", "backend": "vllm:d1t1", "port": 8000}]}


def _policy(limits: Limits = Limits(), **spec: Any) -> dict[str, Any]:  # noqa: B008
    return by_kind(plan(manifest(**spec), limits=limits).objects)[("NetworkPolicy", "job-network")]


def test_network_policy_admits_only_the_rljobs_own_pods_by_default() -> None:
    p = plan(manifest(**TWO_ENGINES))
    policy = by_kind(p.objects)[("NetworkPolicy", "job-network")]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["labels"]["treetrain.dev/rljob"] == "job"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # deleted with the RLJob
    own = {"app.kubernetes.io/managed-by": "rljob-operator", "treetrain.dev/rljob": "job"}
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": own} and spec["policyTypes"] == ["Ingress"]
    # Every port from the RLJob's own pods (NCCL picks ephemeral ports), and nothing else.
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
    # Every pod the RLJob runs is selected by the policy (so protected by it).
    for obj in p.objects:
        if obj["kind"] in ("Job", "StatefulSet"):
            pod_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert own.items() <= pod_labels.items(), obj["metadata"]["name"]


def test_network_policy_admits_prometheus_to_the_metrics_port_only() -> None:
    policy = _policy(Limits(network=NetworkSettings(metrics_from=PROMETHEUS)), **TWO_ENGINES)
    _, metrics = policy["spec"]["ingress"]
    assert metrics == {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": 9400}]}
    # Opening the servers' port too (their /metrics shares it with their whole API) is explicit.
    policy = _policy(Limits(network=NetworkSettings(metrics_from=PROMETHEUS, scrape_servers=True)), **TWO_ENGINES)
    assert [p["port"] for p in policy["spec"]["ingress"][1]["ports"]] == [8000, 9400, 30000]


def test_network_policy_can_be_turned_off_and_the_key_stays() -> None:
    objects = by_kind(plan(manifest(), limits=Limits(network=NetworkSettings(enabled=False))).objects)
    assert not [k for k in objects if k[0] == "NetworkPolicy"]
    assert ("Secret", "job-api-key") in objects


def test_api_key_secret_is_rendered_without_a_key_and_created_once_with_a_fresh_one() -> None:
    p = plan(manifest())
    secret = by_kind(p.objects)[("Secret", "job-api-key")]
    assert "data" not in secret and "stringData" not in secret  # the planner draws nothing: it is pure
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert plan(manifest()).objects == p.objects
    first, second = with_fresh_key(secret)["stringData"]["api-key"], with_fresh_key(secret)["stringData"]["api-key"]
    assert first != second and len(first) >= 43  # 256 random bits each time
    # Anything but the key's Secret comes back as it was, and is not changed in place (compared
    # with a copy taken before: the same dict on both sides would pass whatever the call did).
    config_map = by_kind(p.objects)[("ConfigMap", "job-config")]
    before = copy.deepcopy(config_map)
    assert with_fresh_key(config_map) == before
    assert config_map == before


def _env_of(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container["env"]}


def test_servers_require_the_key_and_the_trainer_holds_it() -> None:
    objects = by_kind(plan(manifest(**TWO_ENGINES)).objects)
    ref = {"valueFrom": {"secretKeyRef": {"name": "job-api-key", "key": "api-key"}}}
    sglang, vllm, trainer = (
        objects[("StatefulSet", "job-rollout")],
        objects[("StatefulSet", "job-rollout-small")],
        objects[("Job", "job-trainer")],
    )
    assert _env_of(trainer)["TREETRAIN_ROLLOUT_API_KEY"] == {"name": "TREETRAIN_ROLLOUT_API_KEY", **ref}
    # SGLang: --api-key with the variable the kubelet expands (the key is not in the template).
    (container,) = sglang["spec"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["--api-key", "$(TREETRAIN_ROLLOUT_API_KEY)"]
    assert _env_of(sglang)["TREETRAIN_ROLLOUT_API_KEY"] == {"name": "TREETRAIN_ROLLOUT_API_KEY", **ref}
    # vLLM reads VLLM_API_KEY.
    assert _env_of(vllm)["VLLM_API_KEY"] == {"name": "VLLM_API_KEY", **ref}
    (container,) = vllm["spec"]["template"]["spec"]["containers"]
    assert "--api-key" not in container["command"]
    # The probes stay unauthenticated: both servers leave /health open.
    assert container["startupProbe"]["httpGet"]["path"] == "/health"


def test_server_auth_per_backend() -> None:
    assert server_auth("sglang", "K") == (["--api-key", "$(K)"], [])
    assert server_auth("vllm", "K") == ([], ["VLLM_API_KEY"])
    with pytest.raises(ValueError, match="not a rollout server backend"):
        server_auth("fsdp", "K")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("monitoring", "is not JSON"),
        ("[]", "must be an object with namespaceSelector and/or podSelector"),
        ('{"ipBlock": {"cidr": "0.0.0.0/0"}}', "must be an object with namespaceSelector and/or podSelector"),
        ('{"podSelector": {"matchLabels": {"a": "b c"}}}', "podSelector: matchLabels 'a'"),
        ('{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}', "an operator of In, NotIn"),
        ('{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}', "In and NotIn need values"),
    ],
)
def test_metrics_from_refuses_bad_peers_in_one_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_peer(text)
    assert "\n" not in str(err.value)
    done = subprocess.run(
        [sys.executable, "-m", "rljob_operator.cli", "operator", "--metrics-from", text],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr and message.split("'")[0] in done.stderr


def test_metrics_from_accepts_a_peer() -> None:
    assert parse_peer(json.dumps(PROMETHEUS)) == PROMETHEUS
    assert parse_peer('{"namespaceSelector": {}}') == {"namespaceSelector": {}}


def test_one_complete_plan_per_reconcile(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass builds its Plan once, complete and frozen: no draft or half-filled Plans on the way
    (every construction in rljob_operator.plan is counted, through the reconciler)."""
    import dataclasses
    from datetime import UTC, datetime

    import rljob_operator.plan as planning
    from rljob_operator.observe import Observed
    from rljob_operator.reconcile import decide

    built: list[planning.Plan] = []
    real = planning.Plan

    def counting(*args: Any, **kwargs: Any) -> planning.Plan:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(planning, "Plan", counting)
    decision = decide(manifest(), Observed(), datetime(2026, 1, 1, tzinfo=UTC))
    assert decision.apply and len(built) == 1
    p = built[0]
    assert p.config is not None and p.memory is not None and p.objects
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.objects = []  # type: ignore[misc]
    built.clear()
    plan(manifest(critic={}, trainerConfig={"algorithm": "ppo"}), restart=2)
    assert len(built) == 1


def test_each_rollout_engine_gets_its_servers_image() -> None:
    """The default rollout image is per server ({kind}): the trainer image holds no SGLang or vLLM."""
    body = manifest(additionalRollouts=[{"name": "v", "backend": "vllm:d1"}])
    images = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
        for o in plan(body).objects
        if o["kind"] == "StatefulSet"
    }
    assert sorted(images.values()) == ["ghcr.io/treetrain/rollout:0.1.0-sglang", "ghcr.io/treetrain/rollout:0.1.0-vllm"]
    body["spec"]["images"] = {"rollout": "registry.example.com/acme/server:7"}  # one fixed image
    fixed = [o for o in plan(body).objects if o["kind"] == "StatefulSet"]
    assert {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in fixed} == {
        "registry.example.com/acme/server:7"
    }
