"""The Helm chart, rendered with `helm template` (no cluster): RBAC equals the operator's rules,
the Deployment is hardened, toggles render the monitors, alerts and dashboards, and
values.schema.json refuses bad values with a clear message.

helm comes from the test control plane's binaries (`make cluster-bin`; `make test` builds them).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.cli import build_parser
from rljob_operator.metrics import Metrics
from rljob_operator.network import parse_peer
from rljob_operator.plan import METRICS_PORT, plan
from rljob_operator.rbac import RULES
from treetrain import __version__

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rljob-operator"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="module")
def helm() -> Path:
    built = subprocess.run([str(ROOT / "tests" / "cluster" / "build"), "--print"], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail("helm is not built: run `make cluster-bin` (or tests/cluster/build) first", pytrace=False)
    return Path(built.stdout.strip()) / "helm"


def run_template(helm: Path, values: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return subprocess.run(
        [str(helm), "template", "rel", str(CHART), "--namespace", "ops", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def render(helm: Path, tmp_path: Path) -> Render:
    def _render(**values: Any) -> list[dict[str, Any]]:
        done = run_template(helm, values, tmp_path)
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d]

    return _render


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


# ---------------------------------------------------------------------------
# Chart metadata and CRDs


def test_chart_version_and_crd_match_the_repo() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert (CHART / "crds" / "rljob.yaml").read_text() == (ROOT / "crds" / "rljob.yaml").read_text(), (
        "charts/rljob-operator/crds/rljob.yaml is stale: cp crds/rljob.yaml charts/rljob-operator/crds/"
    )


def test_helm_lint_strict(helm: Path) -> None:
    done = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_defaults_render_only_the_operator(render: Render) -> None:
    docs = render()
    assert kinds(docs) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy", "Service", "ServiceAccount",
    ]  # fmt: skip
    for doc in docs:
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "ops"


# ---------------------------------------------------------------------------
# RBAC


def test_rbac_rules_are_exactly_the_operators(render: Render) -> None:
    docs = render()
    role = one(docs, "ClusterRole")
    assert role["rules"] == RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "rel-rljob-operator",
    }
    sa = one(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ops"}]
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_rbac_watched_namespaces_grant_only_there(render: Render) -> None:
    docs = render(watchNamespaces=["team-a", "team-b"])
    namespaced = one(docs, "ClusterRole", "rel-rljob-operator")
    cluster = one(docs, "ClusterRole", "rel-rljob-operator-cluster")
    assert namespaced["rules"] + cluster["rules"] == RULES
    # Only namespaces and CRDs (list, watch) and nodes (list) are cluster-wide.
    verbs = {r: rule["verbs"] for rule in cluster["rules"] for r in rule["resources"]}
    assert verbs == {"namespaces": ["list", "watch"], "customresourcedefinitions": ["list", "watch"], "nodes": ["list"]}
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["name"] == "rel-rljob-operator" for b in bindings)
    (crb,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert crb["roleRef"]["name"] == "rel-rljob-operator-cluster"
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "operator" and "--namespace=team-a" in args and "--namespace=team-b" in args


def test_rbac_can_be_left_to_an_administrator(render: Render) -> None:
    docs = render(rbac={"create": False}, serviceAccount={"create": False, "name": "given"})
    assert not [d for d in docs if d["kind"].endswith(("Role", "RoleBinding")) or d["kind"] == "ServiceAccount"]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "given"


def _rbac_table(guide: str) -> dict[tuple[str, str], list[str]]:
    """docs/install.md's RBAC table: (API group, resource) -> verbs, as written."""
    section = guide.split("### What the operator may do", 1)[1].split("\n\n| API group |", 1)[1]
    rows: dict[tuple[str, str], list[str]] = {}
    for line in section.split("\n\n", 1)[0].splitlines()[2:]:
        group, resources, verbs = (cell.strip() for cell in line.strip("|").split("|"))
        group = "" if group == "core" else group.strip("`")
        for resource in resources.split(","):
            rows[(group, resource.strip().strip("`"))] = [v.strip() for v in re.sub(r"\(.*?\)", "", verbs).split(",")]
    return rows


def test_install_guide_rbac_table_is_the_operators_rules() -> None:
    guide = (ROOT / "docs" / "install.md").read_text()
    want = {(g, r): rule["verbs"] for rule in RULES for g in rule["apiGroups"] for r in rule["resources"]}
    assert _rbac_table(guide) == want


# ---------------------------------------------------------------------------
# Network policies

PROMETHEUS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def _network_args(docs: list[dict[str, Any]]) -> list[str]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return [a for a in container["args"] if a.startswith(("--metrics-from", "--no-network-policy"))]


def test_operator_network_policy_admits_prometheus_to_metrics_only(render: Render) -> None:
    docs = render()
    policy = one(docs, "NetworkPolicy")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [PROMETHEUS_PEER], "ports": [{"protocol": "TCP", "port": 8080}]}]
    # The same peer reaches every RLJob's trainers: the operator gets it as --metrics-from, which it parses.
    (arg,) = _network_args(docs)
    peer = build_parser().parse_args(["operator", arg]).metrics_from
    assert peer == parse_peer(arg.removeprefix("--metrics-from=")) == PROMETHEUS_PEER


def test_operator_network_policy_values(render: Render) -> None:
    liveness = [{"ipBlock": {"cidr": "10.0.0.0/16"}}]
    # Helm merges maps with the defaults: a default label is dropped by setting it to null.
    custom = {
        "namespaceSelector": {"matchLabels": {"team": "obs", "kubernetes.io/metadata.name": None}},
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": None},
            "matchExpressions": [{"key": "app", "operator": "In", "values": ["prom"]}],
        },
        "scrapeRolloutServers": True,
    }
    docs = render(metrics={"port": 9090}, networkPolicy={"prometheus": custom, "livenessFrom": liveness})
    ingress = one(docs, "NetworkPolicy")["spec"]["ingress"]
    peer = {
        "namespaceSelector": {"matchLabels": {"team": "obs"}},
        "podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["prom"]}], "matchLabels": {}},
    }
    assert ingress == [
        {"from": [peer], "ports": [{"protocol": "TCP", "port": 9090}]},
        {"from": liveness, "ports": [{"protocol": "TCP", "port": 8081}]},
    ]
    assert _network_args(docs) == [
        f"--metrics-from={json.dumps(peer, separators=(',', ':'))}",
        "--metrics-from-scrapes-servers",
    ]
    # No Prometheus: nothing reaches the operator's ports through its policy, and no RLJob's metrics port.
    docs = render(networkPolicy={"prometheus": {"enabled": False}})
    assert one(docs, "NetworkPolicy")["spec"]["ingress"] == [] and _network_args(docs) == []
    # Off: no policy for the operator, none per RLJob.
    docs = render(networkPolicy={"enabled": False})
    assert "NetworkPolicy" not in kinds(docs) and _network_args(docs) == ["--no-network-policy"]


# ---------------------------------------------------------------------------
# The Deployment


def test_deployment_is_hardened_single_replica_with_probes(render: Render) -> None:
    deployment = one(render(), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["privileged"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["image"] == f"ghcr.io/treetrain/rljob-operator:{__version__}"
    # In a pod the listeners must take the pod IP (kubelet probes, Prometheus); loopback is the CLI default.
    assert container["args"] == [
        "operator", "--metrics-port=8080", "--liveness-port=8081", "--bind=0.0.0.0",
        "--max-gpus-per-rljob=4096", "--max-pods-per-rljob=1024", f"--metrics-from={json.dumps(PROMETHEUS_PEER, separators=(',', ':'))}",
    ]  # fmt: skip
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "liveness": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_deployment_custom_values(render: Render) -> None:
    docs = render(
        image={"repository": "registry.local/rljob", "tag": "dev", "pullPolicy": "Always"},
        metrics={"port": 9090, "service": {"enabled": True}},
        liveness={"port": 9091},
        nodeSelector={"pool": "system"},
        tolerations=[{"key": "dedicated", "operator": "Exists"}],
        extraEnv=[{"name": "KOPF_DEBUG", "value": "1"}],
        podLabels={"team": "ml"},
    )
    pod = one(docs, "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.local/rljob:dev" and container["imagePullPolicy"] == "Always"
    assert container["args"][:4] == ["operator", "--metrics-port=9090", "--liveness-port=9091", "--bind=0.0.0.0"]
    assert {"name": "KOPF_DEBUG", "value": "1"} in container["env"]
    assert pod["spec"]["nodeSelector"] == {"pool": "system"} and pod["metadata"]["labels"]["team"] == "ml"
    service = one(docs, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]


# ---------------------------------------------------------------------------
# Monitoring toggles

ALL_ON: dict[str, Any] = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True, "treeTokenRatioThreshold": 0.75, "trainerRestartsPerHour": 3},
    "grafana": {"dashboards": {"enabled": True, "annotations": {"grafana_folder": "treetrain"}}},
}


def test_admission_allow_lists_become_operator_flags(render: Render) -> None:
    (container,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith("--allow-")]  # default: anything
    admission = {"allowedTaskModules": ["acme.tasks", "rl"], "allowedImagePrefixes": ["registry.acme/"]}
    (container,) = one(render(admission=admission), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [a for a in container["args"] if a.startswith("--allow-")] == [
        "--allow-task-module=acme.tasks", "--allow-task-module=rl", "--allow-image-prefix=registry.acme/",
    ]  # fmt: skip


def test_monitoring_toggles_render_everything(render: Render) -> None:
    docs = render(**ALL_ON)
    assert kinds(docs).count("ConfigMap") == 2
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert one(docs, kind)["apiVersion"] == "monitoring.coreos.com/v1"


def test_service_monitor_scrapes_the_metrics_service(render: Render) -> None:
    docs = render(**ALL_ON)
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["honorLabels"] is True
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
    return True


def test_pod_monitor_selects_trainer_pods_not_rollout_pods(render: Render) -> None:
    monitor = one(render(**ALL_ON), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    planned = plan(EXAMPLE).objects
    templates = {o["kind"]: o["spec"]["template"] for o in planned if o["kind"] in ("Job", "StatefulSet")}
    trainer, rollout = templates["Job"], templates["StatefulSet"]
    # The Job controller adds the completion index label to each pod; rank 0 is in pod 0.
    index = "batch.kubernetes.io/job-completion-index"
    assert _matches(monitor["spec"]["selector"], {**trainer["metadata"]["labels"], index: "0"})
    assert not _matches(monitor["spec"]["selector"], {**trainer["metadata"]["labels"], index: "1"})
    assert not _matches(monitor["spec"]["selector"], rollout["metadata"]["labels"])
    # The endpoint's port name is the trainer container's metrics port.
    trainer_ports = {p["name"]: p["containerPort"] for p in trainer["spec"]["containers"][0]["ports"]}
    assert trainer_ports[endpoint["port"]] == METRICS_PORT
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets["rljob"] == ["__meta_kubernetes_pod_label_treetrain_dev_rljob"]
    assert targets["component"] == ["__meta_kubernetes_pod_label_treetrain_dev_component"]


def test_pod_monitor_follows_watched_namespaces(render: Render) -> None:
    docs = render(watchNamespaces=["team-a"], podMonitor={"enabled": True})
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    docs = render(watchNamespaces=["team-a"], podMonitor={"enabled": True, "namespaces": ["x"]})
    assert one(docs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["x"]}


def test_prometheus_rule_alerts_and_thresholds(render: Render) -> None:
    rule = one(render(**ALL_ON), "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {
        "RLJobFailed",
        "RLJobTrainerRestartsClimbing",
        "RLJobTreeTokenRatioHigh",
        "RLJobReconcileErrors",
    }
    assert alerts["RLJobTreeTokenRatioHigh"]["expr"].endswith("(treetrain_tree_token_ratio) > 0.75")
    assert alerts["RLJobTrainerRestartsClimbing"]["expr"].endswith("> 3")
    assert 'rljob_jobs{phase="Failed"}' in alerts["RLJobFailed"]["expr"]
    # Prometheus templates in annotations survive Helm's templating.
    assert "{{ $labels.rljob }}" in alerts["RLJobTreeTokenRatioHigh"]["annotations"]["summary"]
    operator_names = {m.name for m in Metrics().registry.collect()}
    assert {"rljob_jobs", "rljob_trainer_restarts", "rljob_reconcile_errors"} <= operator_names


def test_dashboards_are_configmaps_for_the_sidecar(render: Render) -> None:
    maps = [d for d in render(**ALL_ON) if d["kind"] == "ConfigMap"]
    assert sorted(m["metadata"]["name"] for m in maps) == [
        "rel-rljob-operator-dashboard-operator",
        "rel-rljob-operator-dashboard-training",
    ]
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "treetrain"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())
    docs = render(grafana={"dashboards": {"enabled": True, "namespace": "monitoring", "labels": {"custom": "x"}}})
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["custom"] == "x"


def test_service_monitor_needs_the_service(helm: Path, tmp_path: Path) -> None:
    done = run_template(
        helm, {"serviceMonitor": {"enabled": True}, "metrics": {"service": {"enabled": False}}}, tmp_path
    )
    assert done.returncode != 0 and "serviceMonitor.enabled needs metrics.service.enabled" in done.stderr


# ---------------------------------------------------------------------------
# values.schema.json

BAD_VALUES = [
    ({"replicas": 2}, "at '/replicas': value must be 1"),
    ({"watchNamespaces": ["Team_A"]}, "at '/watchNamespaces/0': 'Team_A' does not match pattern"),
    (
        {"image": {"pullPolicy": "Sometimes"}},
        "at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'",
    ),
    ({"metrics": {"port": 70000}}, "at '/metrics/port': maximum: got 70,000, want 65,535"),
    ({"prometheusRule": {"treeTokenRatioThreshold": 1.5}}, "at '/prometheusRule/treeTokenRatioThreshold'"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "at '/serviceMonitor/interval': '30 seconds' does not match"),
    ({"watchNamespace": ["a"]}, "additional properties 'watchNamespace' not allowed"),
    ({"resources": {"limits": {"memory": "lots"}}}, "at '/resources/limits/memory'"),
    ({"admission": {"allowedTaskModules": ["os:system"]}}, "at '/admission/allowedTaskModules/0': 'os:system'"),
    ({"networkPolicy": {"enable": False}}, "at '/networkPolicy': additional properties 'enable' not allowed"),
    (
        {"networkPolicy": {"prometheus": {"podSelector": {"matchLabels": {"app": "a b"}}}}},
        "at '/networkPolicy/prometheus/podSelector/matchLabels/app': 'a b' does not match pattern",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m.split("'")[1] for _, m in BAD_VALUES])
def test_schema_rejects_bad_values(helm: Path, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    done = run_template(helm, values, tmp_path)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr
    assert message in done.stderr, done.stderr


def test_schema_accepts_documented_values(render: Render) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert render(**values)
    assert render(**ALL_ON, watchNamespaces=["a", "b"], resources={"requests": {"cpu": "250m", "memory": "1Gi"}})


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        # `resources` and label selectors are Kubernetes objects, documented as wholes.
        nested = isinstance(value, dict) and value and key not in ("resources", "namespaceSelector", "podSelector")
        out += _leaves(value, f"{path}.") if nested else [path]
    return out


def test_install_guide_documents_every_value() -> None:
    guide = (ROOT / "docs" / "install.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) <= set(schema["properties"])
    # Each value's last name appears in the guide's table (`image.tag` as `image.tag` or `.tag`).
    missing = [p for p in _leaves(values) if p.rsplit(".", 1)[-1] not in guide]
    assert not missing, f"docs/install.md does not mention {missing}"
