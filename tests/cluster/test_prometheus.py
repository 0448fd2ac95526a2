"""The chart's dashboards and alert rules, evaluated by a real Prometheus (tests/cluster).

Prometheus (Debian's package, fetched by tests/prometheus/build) runs on 127.0.0.1 with a 1 s
scrape and rule interval and the chart's PrometheusRule loaded as a rules file (rendered with
`helm template`, every `for:` set to 1 s through the chart's values). It scrapes:

- a real `treetrain train` run (tiny model, builtin:parity, tree packing on), as the chart's
  PodMonitor would: the labels `namespace`, `rljob`, `component` and `pod` of the trainer pod of
  a real RLJob on the test cluster, added as target labels (file-based discovery, so targets can
  come and go like pods);
- `rljob operator` as a process with the chart's Deployment arguments and the chart's RBAC
  rules, its metrics port on loopback, scraped with `honor_labels` as the ServiceMonitor does.

Healthy run: every target's expr of every panel of every dashboard JSON (rows' nested panels
included, the dashboard variables filled in with the values the scrape gives), queried over
the run as Grafana does (query_range), returns at least one number; a panel without one fails
the test by name. The variables' own label_values() queries list the healthy RLJob. Every alert
rule evaluates without error, and none is pending or firing.

Faults, one per alert rule, all on loopback (a rule added to the chart without a fault here fails
the test):

- RLJobTreeTokenRatioHigh: a second trainer with tree packing off (tree_token_ratio 1.0);
- RLJobFailed: an RLJob with a layout the operator refuses (fsdp has no pipeline parallelism);
- RLJobReconcileErrors: an RLJob in a namespace whose ResourceQuota allows no StatefulSet, so
  the API server refuses its rollout StatefulSet on every reconcile;
- RLJobTrainerRestartsClimbing: an RLJob whose simulated trainer pod is made to fail three times
  (kwok's fail label), more than the chart's default trainerRestartsPerHour of 2.

Every alert can be made to fire here, none needs a real pod or GPU: restarts come from kwok's
simulated pod failures. Each alert must fire, with the labels of its fault. Every process and
directory is cleaned up, also when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Cluster, http_get, operator_account, scratch_namespace, wait_for
from kubernetes import client
from operator_helpers import deployment_of, helm, operator_process
from prometheus_helpers import Prometheus, prometheus_binary, prometheus_process, stop, tail
from rljob_helpers import FAIL, ROOT, SMALL, delete_rljobs, pods, rljob, rljob_phase, trainer_selector
from suite_helpers import small, subprocess_env

from rljob_operator.models import GROUP, PLURAL, VERSION
from rljob_operator.rbac import RULES

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHART = ROOT / "charts" / "rljob-operator"

SCRAPE = "1s"
# Grafana's $__rate_interval is at least four scrape intervals; 10 s keeps two samples in every
# window even when a busy machine delays a scrape.
RATE_INTERVAL = "10s"
# How long any one condition of the test may take to show in Prometheus.
DEADLINE_S = 90.0


def trainer_config(*, tree: bool, ref: bool = False) -> dict[str, Any]:
    """The unit tests' seconds-long trainer config, with steps enough to outlast the test (it is
    stopped with SIGTERM once the queries are done) and metrics on a free loopback port; ``ref``:
    with a reference model and a KL term, so that treetrain_kl has samples."""
    extra: dict[str, Any] = {"loss": {"klCoef": 0.05}} if ref else {}
    config: dict[str, Any] = small(
        steps=100000, metrics={"enabled": True, "port": 0, "addr": "127.0.0.1"}, compareFlat=False, **extra
    )
    config["actor"]["treeTraining"]["enabled"] = tree
    if ref:
        config["ref"] = {}
    return config


# ---------------------------------------------------------------------------
# Prometheus


def set_targets(path: Path, targets: list[dict[str, Any]]) -> None:
    """Rewrite a file_sd file in one rename: Prometheus watches it and never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets))
    tmp.rename(path)


# ---------------------------------------------------------------------------
# Processes


class Trainer:
    """`treetrain train` in a subprocess (started at once; it takes a while to import torch),
    its output in ``NAME.log``."""

    def __init__(self, workdir: Path, name: str, config: dict[str, Any]) -> None:
        self.name, self.log_path = name, workdir / f"{name}.log"
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        env = subprocess_env()
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "treetrain"), "train", str(path)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=workdir)  # fmt: skip

    def _alive(self) -> None:
        code = self.proc.poll()
        assert code is None, f"trainer {self.name} exited with {code}:\n{tail(self.log_path)}"

    def port(self) -> int:
        """The metrics port, once /metrics answers."""

        def found() -> int | None:
            # The log's head: the address is printed before the first step, and a trainer that
            # ran for minutes has pushed it out of any tail.
            with self.log_path.open(errors="replace") as log:
                line = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", log.read(65536))
            if line and http_get(f"http://127.0.0.1:{line.group(1)}/metrics")[0] == 200:
                return int(line.group(1))
            self._alive()
            return None

        return wait_for(f"trainer {self.name}'s /metrics", found, timeout=DEADLINE_S)

    def terminate(self) -> None:
        """SIGTERM without waiting (the trainer stops after its current step)."""
        self._alive()  # it must have outlived the queries
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        stop(self.proc)
        self._log.close()
        assert "Traceback" not in tail(self.log_path, 100000), tail(self.log_path)


# ---------------------------------------------------------------------------
# Dashboards


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, also those inside collapsed rows."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def fill(expr: str, values: dict[str, str], where: str) -> str:
    """``expr`` with Grafana's variables ($name and ${name}) replaced by ``values``."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"{where}: no value for the dashboard variable ${name} in {expr!r}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def has_number(result: list[dict[str, Any]]) -> bool:
    """True when a query_range result has a sample that is a number (NaN draws nothing in a panel)."""
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def dashboard_targets() -> list[tuple[str, str]]:
    """(where, expr) for every target of every panel of every dashboard."""
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in panels(board):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    where = f"{path.stem} dashboard, panel {panel.get('title')!r} target {target.get('refId')}"
                    out.append((where, target["expr"]))
    assert out, "no panel queries found in the dashboards"
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(where, label, series selector) of every label_values(SELECTOR, LABEL) dashboard variable."""
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            match = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", query)
            assert match, f"{path.stem} dashboard, variable {var['name']}: not a label_values() query: {query!r}"
            out.append((f"{path.stem} dashboard, variable ${var['name']}", match.group(2), match.group(1)))
    return out


# ---------------------------------------------------------------------------
# Chart


def chart_rules(cluster: Cluster) -> dict[str, Any]:
    """The chart's PrometheusRule as a Prometheus rules file, every `for:` at 1 s."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sets = ["--set", "prometheusRule.enabled=true"]
    for key in values["prometheusRule"]["for"]:
        sets += ["--set", f"prometheusRule.for.{key}=1s"]
    rendered = helm(cluster, "template", "prom", str(CHART), *sets, "--show-only", "templates/prometheusrule.yaml")
    rule = yaml.safe_load(rendered.stdout)
    return {"groups": rule["spec"]["groups"]}


def small_rljob(name: str, **spec: Any) -> dict[str, Any]:
    """The example RLJob at its smallest: one 1-GPU rollout server, one trainer GPU."""
    return rljob(name, **{**SMALL, **spec})


def restarts(cluster: Cluster, namespace: str, name: str) -> int:
    obj = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    return int((obj.get("status") or {}).get("restarts", 0))


def trainer_pods(cluster: Cluster, namespace: str, name: str, restart: int) -> list[client.V1Pod]:
    return pods(cluster, namespace, trainer_selector(name, restart))


def unfired(prom: Prometheus, faults: dict[str, dict[str, str]]) -> list[str]:
    """The alerts of ``faults`` not firing with (at least) their labels."""
    fired = {a["labels"]["alertname"]: a["labels"] for a in prom.alerts() if a["state"] == "firing"}
    return sorted(name for name, labels in faults.items() if not labels.items() <= fired.get(name, {}).items())


# ---------------------------------------------------------------------------


def test_dashboards_and_alerts_on_a_real_prometheus(cluster: Cluster, tmp_path: Path) -> None:
    binary = prometheus_binary()
    rules = chart_rules(cluster)
    alert_names = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cluster.run("kubectl", "apply", "--server-side", "-f", str(ROOT / "crds" / "rljob.yaml"))
    cluster.run("kubectl", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
    custom, core = client.CustomObjectsApi(cluster.api), client.CoreV1Api(cluster.api)

    with contextlib.ExitStack() as stack:
        # Both trainers start first: their start-up overlaps the cluster's work.
        # The watched run has a reference model: the RL health row's KL panel needs one.
        watched = Trainer(tmp_path, "watched", trainer_config(tree=True, ref=True))
        stack.callback(watched.stop)
        flat = Trainer(tmp_path, "flat", trainer_config(tree=False))
        stack.callback(flat.stop)
        ns = stack.enter_context(scratch_namespace(cluster.api, "prom"))
        quota_ns = stack.enter_context(scratch_namespace(cluster.api, "promq"))
        kubeconfig = stack.enter_context(
            operator_account(cluster.api, cluster.kubeconfig, "prom-op", RULES, tmp_path / "kubeconfig")
        )
        manifest = helm(cluster, "template", "prom", str(CHART), "--set", f"watchNamespaces[0]={ns}",
                        "--set", f"watchNamespaces[1]={quota_ns}", "--show-only", "templates/deployment.yaml")  # fmt: skip
        (container,) = deployment_of(manifest.stdout)["spec"]["template"]["spec"]["containers"]
        operator_metrics, _ = stack.enter_context(operator_process(kubeconfig, container["args"]))
        # Deleted while the operator runs, before the namespaces go: the simulated GPUs are shared
        # by the whole session.
        stack.callback(delete_rljobs, cluster, ns, quota_ns)

        (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
        trainers = tmp_path / "trainers.json"
        set_targets(trainers, [])
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "rule_files": [str(tmp_path / "rules.yml")],
            "scrape_configs": [
                # As the PodMonitor: the trainer pod's labels become target labels.
                {"job_name": "trainers", "file_sd_configs": [{"files": [str(trainers)]}]},
                # As the ServiceMonitor: honorLabels keeps rljob_gpus_requested's own namespace.
                {
                    "job_name": "operator",
                    "honor_labels": True,
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{operator_metrics}"],
                            "labels": {"namespace": "rljob-system", "service": "prom-rljob-operator-metrics"},
                        }
                    ],
                },
            ],
        }
        prom = stack.enter_context(prometheus_process(binary, tmp_path, config))
        stack.callback(lambda: (watched.terminate(), flat.terminate()))  # first thing on the way out
        start = time.time()
        wait_for("the operator scraped", lambda: prom.query('up{job="operator"} == 1'), timeout=DEADLINE_S)

        # -- the healthy run: an RLJob, its trainer's metrics under its pod's labels ------------
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, small_rljob("watched"))
        wait_for("watched Running", lambda: rljob_phase(cluster, ns, "watched") == "Running", timeout=DEADLINE_S)
        (pod,) = trainer_pods(cluster, ns, "watched", 0)
        targets = [{"targets": [f"127.0.0.1:{watched.port()}"],
                    "labels": {"namespace": ns, "rljob": "watched", "component": "actor", "pod": pod.metadata.name}}]  # fmt: skip
        set_targets(trainers, targets)

        values = {"namespace": ns, "rljob": "watched", "__rate_interval": RATE_INTERVAL, "__interval": SCRAPE}
        waiting = dashboard_targets()
        deadline = time.monotonic() + DEADLINE_S
        while waiting and time.monotonic() < deadline:
            now = time.time()
            values["__range"] = f"{max(1, int(now - start))}s"
            waiting = [(w, e) for w, e in waiting if not has_number(prom.query_range(fill(e, values, w), start, now))]
            if waiting:
                time.sleep(1)  # a scrape interval: the next poll sees new samples
        assert not waiting, "panels with no data:\n" + "\n".join(f"  {w}: {e}" for w, e in waiting)
        # Every RL health signal is among the queries that just had data (a panel dropped from the
        # dashboard would otherwise go unnoticed here).
        queried = " ".join(e for _, e in dashboard_targets())
        health = ("policy_entropy", "kl", "clip_fraction", "importance_ratio", "grad_norm",
                  "response_length_tokens_bucket", "response_length_tokens_sum", "zero_signal_groups_total")  # fmt: skip
        assert all(f"treetrain_{name}{{" in queried for name in health), queried

        for where, label, selector in variable_queries():
            listed = prom.api(f"label/{label}/values", **{"match[]": fill(selector, values, where)})
            assert values[label] in listed, f"{where}: label_values() gives {listed}, not {values[label]!r}"

        # Silent: rules evaluated a few times since the data came, without error, nothing pending.
        data_at = time.time()
        wait_for("three rule evaluations", lambda: prom.last_evaluation() > data_at + 3, timeout=DEADLINE_S)
        broken = [f"{r['name']}: {r.get('lastError')}" for r in prom.rules() if r.get("health") != "ok"]
        assert not broken, f"rules that do not evaluate: {broken}"
        assert {r["name"] for r in prom.rules()} == alert_names
        assert prom.alerts() == [], f"alerts in the healthy run: {prom.alerts()}"
        for rule in (r for g in rules["groups"] for r in g["rules"]):
            assert prom.query(rule["expr"]) == [], f"{rule['alert']}: {rule['expr']} is not empty in the healthy run"

        # -- faults, one per alert --------------------------------------------------------------
        faults: dict[str, dict[str, str]] = {
            "RLJobTreeTokenRatioHigh": {"namespace": ns, "rljob": "flat"},
            "RLJobFailed": {},
            "RLJobReconcileErrors": {},
            "RLJobTrainerRestartsClimbing": {"namespace": ns},
        }
        assert set(faults) == alert_names, f"alert rules without a fault in this test: {alert_names - set(faults)}"

        set_targets(trainers, [*targets, {"targets": [f"127.0.0.1:{flat.port()}"],
                                          "labels": {"namespace": ns, "rljob": "flat", "component": "actor"}}])  # fmt: skip

        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, small_rljob("broken", actor={"backend": "fsdp:d4p2"})
        )

        quota = {"metadata": {"name": "no-sts"}, "spec": {"hard": {"count/statefulsets.apps": "0"}}}
        core.create_namespaced_resource_quota(quota_ns, quota)
        wait_for("the quota counted", lambda: core.read_namespaced_resource_quota("no-sts", quota_ns).status.hard)
        custom.create_namespaced_custom_object(GROUP, VERSION, quota_ns, PLURAL, small_rljob("refused"))

        custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, small_rljob("flaky", maxRestarts=5, restartBackoffSeconds=0)
        )
        wait_for("flaky Running", lambda: rljob_phase(cluster, ns, "flaky") == "Running", timeout=DEADLINE_S)
        # increase() counts from the first sample: let Prometheus see the counter at 0 first.
        wait_for(
            "the restart counter scraped at 0",
            lambda: prom.query(f'rljob_trainer_restarts_total{{namespace="{ns}"}} == 0'),
            timeout=DEADLINE_S,
        )
        for restart in range(3):
            found = wait_for(f"flaky's trainer pod {restart}", lambda r=restart: trainer_pods(cluster, ns, "flaky", r))
            for p in found:
                core.patch_namespaced_pod(p.metadata.name, ns, {"metadata": {"labels": FAIL}})
            wait_for(f"flaky restarted {restart + 1} times", lambda r=restart: restarts(cluster, ns, "flaky") > r)

        deadline = time.monotonic() + DEADLINE_S
        while (missing := unfired(prom, faults)) and time.monotonic() < deadline:
            time.sleep(1)  # a rule interval
        assert not missing, f"alerts that did not fire on their fault: {missing}; active: {prom.alerts()}"
