"""The Helm chart on the real control plane (tests/cluster).

- `helm template` output (default and custom values, CRDs included) passes a server-side dry run.
- A bad value is refused at `helm install` by values.schema.json, and nothing is installed.
- `helm install`, then `rljob operator` as a process with the arguments of the chart's Deployment
  and the token of the chart's ServiceAccount: an RLJob reconciles to Running. The same token is
  refused what the operator does not need. The operator's /metrics passes promlint, the linter
  behind `promtool check metrics`. `helm uninstall` keeps the CRD and the RLJobs.

The test cluster has no Prometheus Operator: its ServiceMonitor, PodMonitor and PrometheusRule
kinds are served by stand-in CRDs (any spec accepted), so the dry run checks those objects'
apiVersion, kind and metadata only; tests/unit/test_chart.py checks their contents.
Nothing dials a pod: the operator runs here and its ports are on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Cluster, http_get, wait_for
from kubernetes import client
from operator_helpers import deployment_of, helm, operator_process
from rljob_helpers import EXAMPLE, ROOT, delete_rljobs, rljob, rljob_phase

from rljob_operator.models import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.cluster

CHART = ROOT / "charts" / "rljob-operator"
RELEASE_NS = "rljob-chart"

# A stand-in for the Prometheus Operator's CRDs: the kinds exist, any spec is accepted.
MONITORING_KINDS = [("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"),
                    ("PrometheusRule", "prometheusrules")]  # fmt: skip


def stand_in_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                        }
                    },
                }
            ],
        },
    }


# ---------------------------------------------------------------------------
# Helpers


def ensure_namespace(cluster: Cluster, name: str) -> None:
    core = client.CoreV1Api(cluster.api)
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    except client.ApiException as err:
        if err.status != 409:
            raise


def token_kubeconfig(cluster: Cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount (a bound token, as a pod gets)."""
    token = (
        client.CoreV1Api(cluster.api)
        .create_namespaced_service_account_token(
            service_account,
            namespace,
            client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[])),
        )
        .status.token
    )
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    entry = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [entry],
                "users": [{"name": service_account, "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": entry["name"], "user": service_account}}],
                "current-context": "sa",
            }
        )
    )
    return path


def can_i(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    done = subprocess.run(
        [str(cluster.bin / "kubectl"), "--kubeconfig", str(kubeconfig), "auth", "can-i", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip() == "yes"


# promlint: the linter that `promtool check metrics` runs, from client_golang, as a tiny Go
# program built once into a cache (promtool itself pulls in all of Prometheus).
PROMLINT_MAIN = """package main

import (
	"fmt"
	"os"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

// Reads the text exposition on stdin; exit 1 when it does not parse, 3 on lint problems (as promtool).
func main() {
	problems, err := promlint.New(os.Stdin).Lint()
	if err != nil {
		fmt.Fprintln(os.Stderr, "error while linting:", err)
		os.Exit(1)
	}
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "%s %s\\n", p.Metric, p.Text)
	}
	if len(problems) > 0 {
		os.Exit(3)
	}
}
"""
PROMLINT_GO_MOD = """module promlint

go 1.23.0

require github.com/prometheus/client_golang v1.23.2

require (
	github.com/kr/text v0.2.0 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/prometheus/client_model v0.6.2 // indirect
	github.com/prometheus/common v0.66.1 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	google.golang.org/protobuf v1.36.8 // indirect
)
"""


@pytest.fixture(scope="module")
def promlint() -> Path:
    key = hashlib.sha256((PROMLINT_MAIN + PROMLINT_GO_MOD).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "treetrain" / "promlint" / key
    binary = cache / "promlint"
    if binary.exists():
        return binary
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "main.go").write_text(PROMLINT_MAIN)
    (src / "go.mod").write_text(PROMLINT_GO_MOD)
    env = dict(os.environ, GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-mod=mod -trimpath")
    for step in (["go", "mod", "tidy"], ["go", "build", "-o", str(cache / "promlint.tmp"), "."]):
        done = subprocess.run(step, cwd=src, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(step)} failed:\n{done.stderr}"
    (cache / "promlint.tmp").rename(binary)
    return binary


def lint_metrics(promlint: Path, exposition: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promlint)], input=exposition, capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def monitoring_crds(cluster: Cluster) -> Iterator[None]:
    ext = client.ApiextensionsV1Api(cluster.api)
    for kind, plural in MONITORING_KINDS:
        ext.create_custom_resource_definition(stand_in_crd(kind, plural))
    for _, plural in MONITORING_KINDS:
        cluster.run("kubectl", "wait", "--for=condition=Established", "--timeout=60s",
                    f"crd/{plural}.monitoring.coreos.com")  # fmt: skip
    yield
    for _, plural in MONITORING_KINDS:
        ext.delete_custom_resource_definition(f"{plural}.monitoring.coreos.com")


CUSTOM_VALUES: dict[str, Any] = {
    "image": {"repository": "registry.local/rljob-operator", "tag": "dev", "pullPolicy": "Always"},
    "watchNamespaces": ["chart-team-a", "chart-team-b"],
    "metrics": {"port": 9090},
    "resources": {"requests": {"cpu": "200m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True, "treeTokenRatioThreshold": 0.8},
    "grafana": {"dashboards": {"enabled": True}},
}


# ---------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("values", [{}, CUSTOM_VALUES], ids=["default", "custom"])
def test_template_passes_server_side_dry_run(
    cluster: Cluster, monitoring_crds: None, tmp_path: Path, values: dict[str, Any]
) -> None:
    for ns in (RELEASE_NS, *values.get("watchNamespaces", [])):
        ensure_namespace(cluster, ns)
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    rendered = helm(cluster, "template", "dry", str(CHART), "-n", RELEASE_NS, "--include-crds", "-f", str(values_file))
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered.stdout)
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(rendered.stdout) if d)
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds
    if values:
        assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "RoleBinding"} <= set(kinds)
    done = cluster.run("kubectl", "apply", "--server-side", "--dry-run=server", "--field-manager=helm-dry-run",
                       "-f", str(manifest), check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(server dry run)") == len(kinds), done.stdout


def test_bad_value_is_refused_at_install(cluster: Cluster) -> None:
    done = helm(cluster, "install", "bad", str(CHART), "-n", RELEASE_NS, "--create-namespace",
                "--set", "replicas=2", "--set", "watchNamespaces[0]=Team_A", check=False)  # fmt: skip
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema(s)" in done.stderr
    assert "at '/replicas': value must be 1" in done.stderr
    assert "at '/watchNamespaces/0': 'Team_A' does not match pattern" in done.stderr
    assert "Traceback" not in done.stderr
    listed = helm(cluster, "list", "-n", RELEASE_NS, "-a", "-q")
    assert "bad" not in listed.stdout.split()


@pytest.mark.slow  # builds promlint with Go the first time (about a minute)
def test_install_operator_with_chart_rbac_then_uninstall_keeps_crds(
    cluster: Cluster, namespace: str, tmp_path: Path, promlint: Path
) -> None:
    release = "treetrain"
    helm(cluster, "install", release, str(CHART), "-n", RELEASE_NS, "--create-namespace")
    try:
        manifest = helm(cluster, "get", "manifest", release, "-n", RELEASE_NS).stdout
        deployment = deployment_of(manifest)
        pod = deployment["spec"]["template"]["spec"]
        service_account = pod["serviceAccountName"]
        kubeconfig = token_kubeconfig(cluster, RELEASE_NS, service_account, tmp_path / "kubeconfig")
        custom = client.CustomObjectsApi(cluster.api)
        # The CRD came from the chart's crds/ directory.
        crd = client.ApiextensionsV1Api(cluster.api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
        assert crd.spec.names.short_names == ["rlj"]

        # Least privilege: what the operator needs, and not more.
        assert can_i(cluster, kubeconfig, "patch", "rljobs.treetrain.dev", "--subresource=status", "-n", namespace)
        assert can_i(cluster, kubeconfig, "create", "jobs.batch", "-n", namespace)
        for verb, resource in [("get", "secrets"), ("create", "pods"), ("delete", "pods"), ("create", "rljobs.treetrain.dev"),
                               ("create", "deployments.apps"), ("delete", "namespaces"), ("patch", "nodes")]:  # fmt: skip
            assert not can_i(cluster, kubeconfig, verb, resource, "-n", namespace), (verb, resource)

        (container,) = pod["containers"]
        with operator_process(kubeconfig, container["args"]) as (metrics_port, _):
            # Two trainer pods (16 ranks on 8-GPU nodes) and two rollout pods.
            body = rljob("charted", actor={**EXAMPLE["spec"]["actor"], "backend": "fsdp:d16"})
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
            wait_for("charted Running", lambda: rljob_phase(cluster, namespace, "charted") == "Running")
            gpus = f'rljob_gpus_requested{{component="rollout",namespace="{namespace}",rljob="charted"}} 8.0'

            def scraped() -> str | None:
                status, text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
                return text if status == 200 and gpus in text else None

            text = wait_for("the RLJob's GPUs in /metrics", scraped, timeout=30)
        assert 'rljob_jobs{phase="Running"}' in text
        lint = lint_metrics(promlint, text)
        assert lint.returncode == 0, lint.stderr

        # The chart's PodMonitor selects, among the RLJob's real pods, only the trainer's pod 0
        # (whose rank 0 serves the metrics): not the other trainer pod, not the rollout servers.
        rendered = helm(cluster, "template", release, str(CHART), "-n", RELEASE_NS, "--set", "podMonitor.enabled=true",
                        "--show-only", "templates/podmonitor.yaml").stdout  # fmt: skip
        selector = yaml.safe_load(rendered)["spec"]["selector"]
        terms = [f"{k}={v}" for k, v in selector["matchLabels"].items()]
        terms += [f"{e['key']} notin ({','.join(e['values'])})" for e in selector["matchExpressions"]]
        core = client.CoreV1Api(cluster.api)
        everything = core.list_namespaced_pod(namespace, label_selector="treetrain.dev/rljob=charted").items
        assert len(everything) == 4, [p.metadata.name for p in everything]
        chosen = core.list_namespaced_pod(namespace, label_selector=",".join(terms)).items
        assert [p.metadata.name for p in chosen] == [
            p.metadata.name
            for p in everything
            if p.metadata.labels["treetrain.dev/component"] == "actor"
            and p.metadata.annotations["batch.kubernetes.io/job-completion-index"] == "0"
        ]
    finally:
        helm(cluster, "uninstall", release, "-n", RELEASE_NS, "--wait", "--timeout", "60s")

    # The CRD and the RLJob outlive the release; the release's own objects are gone.
    client.ApiextensionsV1Api(cluster.api).read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert rljob_phase(cluster, namespace, "charted") == "Running"
    names = [r.metadata.name for r in client.RbacAuthorizationV1Api(cluster.api).list_cluster_role().items]
    assert f"{release}-rljob-operator" not in names
    delete_rljobs(cluster, namespace)


def test_watched_namespaces_install_reconciles_only_there(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """watchNamespaces: the operator (with the chart's args and token) runs RLJobs in the watched
    namespace, and its token can do nothing in others."""
    release, other = "scoped", f"{namespace}-other"
    ensure_namespace(cluster, other)
    helm(cluster, "install", release, str(CHART), "-n", RELEASE_NS, "--create-namespace",
         "--set", f"watchNamespaces[0]={namespace}")  # fmt: skip
    try:
        deployment = deployment_of(helm(cluster, "get", "manifest", release, "-n", RELEASE_NS).stdout)
        pod = deployment["spec"]["template"]["spec"]
        kubeconfig = token_kubeconfig(cluster, RELEASE_NS, pod["serviceAccountName"], tmp_path / "kubeconfig")
        assert can_i(cluster, kubeconfig, "create", "statefulsets.apps", "-n", namespace)
        assert not can_i(cluster, kubeconfig, "create", "statefulsets.apps", "-n", other)
        assert not can_i(cluster, kubeconfig, "list", "rljobs.treetrain.dev", "-n", other)
        (container,) = pod["containers"]
        assert f"--namespace={namespace}" in container["args"]
        # Both RLJobs exist before the operator starts, the other namespace's first: an operator
        # that looked beyond its namespace would list it in the same first listing as the
        # watched one (and be refused: operator_process fails on a Forbidden line in its output).
        # So once the watched one runs, the other one was there to be seen all along: no timed wait.
        custom = client.CustomObjectsApi(cluster.api)
        for ns in (other, namespace):
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, rljob("scoped"))
        with operator_process(kubeconfig, container["args"]):
            wait_for("scoped Running", lambda: rljob_phase(cluster, namespace, "scoped") == "Running")
            assert rljob_phase(cluster, other, "scoped") is None  # never touched
    finally:
        helm(cluster, "uninstall", release, "-n", RELEASE_NS, "--wait", "--timeout", "60s")
        delete_rljobs(cluster, namespace, other)
        client.CoreV1Api(cluster.api).delete_namespace(other)


@pytest.mark.slow  # builds promlint with Go the first time (about a minute)
def test_trainer_metrics_endpoint_passes_promlint(promlint: Path) -> None:
    """The trainer's /metrics (treetrain.metrics.TrainerMetrics, what `treetrain train` serves on
    :9400), after one step, scraped over loopback, passes the linter."""
    from treetrain.metrics import StepRecord, TrainerMetrics

    metrics = TrainerMetrics()
    port = metrics.serve(0, "127.0.0.1")
    try:
        metrics.observe_step(
            StepRecord(step=1, tree_token_ratio=0.4, original_tokens=1000, tree_tokens=400, padded_tokens=20,
                        seconds=1.5, train_seconds=1.0, loss=0.7, reward=0.2)
        )  # fmt: skip
        status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    finally:
        metrics.close()
    assert status == 200 and 'treetrain_tokens_total{kind="tree"} 400.0' in text
    lint = lint_metrics(promlint, text)
    assert lint.returncode == 0, lint.stderr
    # And the linter catches what promtool catches.
    bad = lint_metrics(promlint, "# HELP treetrain_steps x\n# TYPE treetrain_steps counter\ntreetrain_steps 1\n")
    assert bad.returncode == 3 and 'counter metrics should have "_total" suffix' in bad.stderr
