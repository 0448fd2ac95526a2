"""The launcher's pure parts, without starting a cluster."""

from __future__ import annotations

from pathlib import Path

import launcher
import pytest
import yaml


def config(tmp_path: Path, **overrides: object) -> launcher.Config:
    fields: dict[str, object] = {
        "dir": tmp_path / "c",
        "nodes": 4,
        "gpus_per_node": 8,
        "cpu_nodes": 0,
        "cpu_per_node": "96",
        "memory_per_node": "1Ti",
        "gpu_product": "H100",
        "job_pods_succeed_after": None,
        "timeout": 60.0,
        "build": False,
        "owner_pid": None,
    }
    fields.update(overrides)
    return launcher.Config(**fields)  # type: ignore[arg-type]


def stage_names(text: str) -> list[str]:
    return [doc["metadata"]["name"] for doc in yaml.safe_load_all(text)]


def test_stages_cover_the_documented_lifecycle(tmp_path: Path) -> None:
    names = stage_names(launcher.stages_text(config(tmp_path)))
    assert names == [
        "sim-node-ready",
        "sim-node-heartbeat",
        "sim-pod-running",
        "sim-pod-succeed",
        "sim-pod-fail",
        "sim-pod-delete",
    ]


def test_job_pods_succeed_after_adds_one_stage(tmp_path: Path) -> None:
    text = launcher.stages_text(config(tmp_path, job_pods_succeed_after="2m"))
    docs = list(yaml.safe_load_all(text))
    extra = docs[-1]
    assert extra["metadata"]["name"] == "sim-job-pod-succeed-default"
    assert extra["spec"]["delay"] == {"durationMilliseconds": 120_000}
    assert "phase: Succeeded" in extra["spec"]["next"]["statusTemplate"]


@pytest.mark.parametrize(("text", "ms"), [("500ms", 500), ("5s", 5000), ("1.5m", 90_000), ("2h", 7_200_000)])
def test_parse_duration(text: str, ms: int) -> None:
    assert launcher.parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["5", "s", "five s", "5d"])
def test_parse_duration_refuses_nonsense(text: str) -> None:
    with pytest.raises(launcher.ClusterError, match="expected a duration"):
        launcher.parse_duration_ms(text)


def test_config_refuses_clusters_without_nodes(tmp_path: Path) -> None:
    with pytest.raises(launcher.ClusterError, match="at least one node"):
        config(tmp_path, nodes=0)
    with pytest.raises(launcher.ClusterError, match="must be at least 1"):
        config(tmp_path, gpus_per_node=0)


def test_gpu_node_manifest(tmp_path: Path) -> None:
    node = launcher.node_manifest(config(tmp_path), 2, "gpu-node-2", 8, "v1.36.3")
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert node["metadata"]["annotations"][launcher.KWOK_NODE_ANNOTATION] == "fake"
    assert node["spec"]["podCIDR"].startswith("127.")
    assert node["status"]["addresses"][0]["address"].startswith("127.")
    cpu_node = launcher.node_manifest(config(tmp_path), 4, "cpu-node-0", 0, "v1.36.3")
    assert "nvidia.com/gpu" not in cpu_node["status"]["capacity"]


def test_state_removal_never_deletes_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(launcher.ClusterError, match="refusing to delete"):
        launcher.remove_state(tmp_path)
    assert (tmp_path / "precious.txt").exists()


def test_state_removal_can_keep_logs(tmp_path: Path) -> None:
    d = tmp_path / "c"
    (d / "logs").mkdir(parents=True)
    (d / "pki").mkdir()
    (d / "state.json").write_text("{}")
    launcher.remove_state(d, keep_logs=True)
    assert sorted(p.name for p in d.iterdir()) == ["logs"]
    launcher.remove_state(d)
    assert not d.exists()


def test_exports_are_shell_quoted(tmp_path: Path) -> None:
    text = launcher.exports({"KUBECONFIG": "/a b/kubeconfig"}, Path("/bin dir"))
    assert text == "export KUBECONFIG='/a b/kubeconfig'\nexport PATH='/bin dir':\"$PATH\"\n"
