"""Operator load and idle cost on a fresh test control plane (tests/cluster).

    python bench/operator_load.py [--rljobs 200] [--idle-seconds 300] [--json out.json]

Starts a control plane with enough simulated GPU nodes (``tests/cluster/launcher.py up``), runs
``rljob operator`` as a subprocess against it, then:

1. load: applies ``--rljobs`` RLJobs at once (2 GPUs each: ``sglang:d1`` + ``fsdp:d1``, so
   2 pods each) and times until every one is ``Running``; reads p50/p99 reconcile time from the
   operator's ``rljob_reconcile_duration_seconds`` histogram and its peak RSS (VmHWM in /proc);
2. idle: after the load settles, counts the operator's own API requests
   (``rljob_operator_api_requests_total``) over ``--idle-seconds`` (default 300 s, one resync
   period: a shorter window could miss the resync and look cheaper than it is), per RLJob per
   minute;
3. watch recovery: restarts the API server, then creates one more RLJob and times until the
   operator has written its status (it was seen and reconciled).

Prints progress while it runs, then a table (and ``--json``). Everything stays on loopback; the
operator, the control plane and the state directory are removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import yaml
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "tests" / "cluster" / "launcher.py"
GROUP, VERSION, PLURAL = "treetrain.dev", "v1alpha1", "rljobs"
NAMESPACE = "bench"
GPUS_PER_NODE = 8
T = TypeVar("T")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.25) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # loopback only
            return str(response.read().decode())
    except OSError:
        return None


# ---------------------------------------------------------------------------
# Figures from the operator's /metrics


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a Prometheus histogram from its cumulative (upper bound, count) buckets,
    interpolated linearly inside the bucket it falls in (as ``histogram_quantile`` does)."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: that bound is all one can say
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def scrape(url: str) -> dict[str, Any]:
    """Reconcile histogram and API request counts from one /metrics scrape."""
    text = http_get(url)
    if text is None:
        raise RuntimeError(f"{url} did not answer")
    buckets: list[tuple[float, float]] = []
    out: dict[str, Any] = {"requests": {}, "reconciles": 0.0, "reconcile_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rljob_reconcile_duration_seconds_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == "rljob_reconcile_duration_seconds_count":
                out["reconciles"] = s.value
            elif s.name == "rljob_reconcile_duration_seconds_sum":
                out["reconcile_sum"] = s.value
            elif s.name == "rljob_operator_api_requests_total":
                key = f"{s.labels['verb']} {s.labels['resource']}"
                out["requests"][key] = out["requests"].get(key, 0.0) + s.value
    out["buckets"] = buckets
    return out


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far (fields 14 and 15 of /proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------
# The control plane and the operator


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="treetrain-operator-bench-"))
        self.cluster_dir = self.dir / "cluster"
        self.operator: subprocess.Popen[bytes] | None = None
        self.up = False
        self.api: client.ApiClient | None = None

    def start_cluster(self, nodes: int) -> None:
        say(f"starting the control plane with {nodes} simulated GPU nodes in {self.cluster_dir}")
        cmd = [sys.executable, str(LAUNCHER), "up", "--dir", str(self.cluster_dir), "--no-build",
               "--nodes", str(nodes), "--owner-pid", str(os.getpid())]  # fmt: skip
        self.up = True  # from here on, `down` must run whatever happens
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"tests/cluster/launcher.py up failed:\n{done.stderr}")
        exports = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in done.stdout.splitlines())
        self.kubeconfig = exports["KUBECONFIG"]
        self.bin = Path(json.loads((self.cluster_dir / "state.json").read_text())["bin"])
        self.api = config.new_client_from_config(config_file=self.kubeconfig)
        self.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "rljob.yaml"))
        crds = client.ApiextensionsV1Api(self.api)

        def established() -> bool:
            conditions = crds.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_for("the RLJob CRD Established", established, 60)
        self.kubectl("create", "namespace", NAMESPACE)

    def kubectl(self, *args: str) -> str:
        env = dict(os.environ, KUBECONFIG=self.kubeconfig)
        done = subprocess.run([str(self.bin / "kubectl"), *args], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {shlex.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def start_operator(self) -> None:
        self.metrics_port, liveness = free_port(), free_port()
        env = dict(os.environ, KUBECONFIG=self.kubeconfig)
        cmd = [sys.executable, "-m", "rljob_operator.cli", "operator", "--bind", "127.0.0.1",
               "--metrics-port", str(self.metrics_port), "--liveness-port", str(liveness)]  # fmt: skip
        self.operator_log = self.dir / "operator.log"
        with self.operator_log.open("wb") as log:
            self.operator = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for("the operator's /healthz", lambda: http_get(f"http://127.0.0.1:{liveness}/healthz"), 120)
        say(f"operator running (pid {self.operator.pid}), /metrics on 127.0.0.1:{self.metrics_port}")

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the operator and of each control plane process."""
        procs = json.loads((self.cluster_dir / "state.json").read_text())["processes"]
        out = {name: cpu_seconds(int(p["pid"])) for name, p in procs.items()}
        if self.operator is not None:
            out["operator"] = cpu_seconds(self.operator.pid)
        return out

    def metrics(self) -> dict[str, Any]:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def restart_apiserver(self) -> float:
        """Stop the API server and start it again (``launcher.py apiserver stop|start``: same
        port, certificates and etcd); returns the seconds until it answered /readyz again."""
        started = time.monotonic()
        for action in ("stop", "start"):
            done = subprocess.run([sys.executable, str(LAUNCHER), "apiserver", action, "--dir", str(self.cluster_dir)],
                                  capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"launcher.py apiserver {action} failed:\n{done.stderr}")
        return time.monotonic() - started

    def close(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            try:
                self.operator.wait(30)
            except subprocess.TimeoutExpired:
                self.operator.kill()
                self.operator.wait(10)
        if self.api is not None:
            self.api.close()
        if self.up:
            subprocess.run([sys.executable, str(LAUNCHER), "down", "--dir", str(self.cluster_dir)],
                           capture_output=True, text=True)  # fmt: skip
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# The measurements


def rljob(name: str) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text()))
    body["metadata"] = {"name": name}
    body["spec"].update(rollout={"backend": "sglang:d1"}, actor={"backend": "fsdp:d1"})
    return body


def phases(custom: client.CustomObjectsApi) -> dict[str, str]:
    items = custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)["items"]
    return {o["metadata"]["name"]: (o.get("status") or {}).get("phase", "-") for o in items}


def count(values: Iterable[str]) -> str:
    seen: dict[str, int] = {}
    for v in values:
        seen[v] = seen.get(v, 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(seen.items()))


def load(bench: Bench, n: int, timeout: float) -> dict[str, Any]:
    custom = client.CustomObjectsApi(bench.api)
    names = [f"load-{i:04d}" for i in range(n)]
    say(f"creating {n} RLJobs at once (8 client threads)")
    cpu_before = bench.cpu()
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda m: custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL,
                                                                       rljob(m)), names))  # fmt: skip
    created = time.monotonic() - started
    say(f"created in {created:.1f} s; waiting for every one to be Running")
    last = 0.0
    while True:
        now = phases(custom)
        running = sum(1 for p in now.values() if p == "Running")
        elapsed = time.monotonic() - started
        if running == n:
            break
        if elapsed > timeout:
            raise TimeoutError(f"after {timeout:.0f} s: {count(now.values())}")
        if elapsed - last >= 5:
            say(f"  {elapsed:5.1f} s: {count(now.values())}")
            last = elapsed
        time.sleep(0.5)
    say(f"all {n} Running after {elapsed:.1f} s")
    assert bench.operator is not None
    m = bench.metrics()
    cpu = {k: round(v - cpu_before.get(k, 0.0), 1) for k, v in bench.cpu().items()}
    return {
        "rljobs": n,
        "create_seconds": round(created, 2),
        "seconds_to_running": round(elapsed, 2),
        "reconciles": int(m["reconciles"]),
        "reconcile_p50_s": round(quantile(m["buckets"], 0.5), 4),
        "reconcile_p99_s": round(quantile(m["buckets"], 0.99), 4),
        "reconcile_mean_s": round(m["reconcile_sum"] / max(m["reconciles"], 1), 4),
        "requests": {k: int(v) for k, v in sorted(m["requests"].items())},
        "operator_peak_rss_mib": round(peak_rss_mib(bench.operator.pid), 1),
        "cpu_seconds_during_load": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
    }


def idle(bench: Bench, n: int, seconds: float, settle: float) -> dict[str, Any]:
    say(f"letting the load settle for {settle:.0f} s, then counting API requests for {seconds:.0f} s")
    time.sleep(settle)
    before, t0 = bench.metrics(), time.monotonic()
    while (left := seconds - (time.monotonic() - t0)) > 0:
        time.sleep(min(30.0, left))
        sent = sum(bench.metrics()["requests"].values()) - sum(before["requests"].values())
        say(f"  idle {time.monotonic() - t0:5.0f} s: {sent:.0f} requests so far")
    after, minutes = bench.metrics(), (time.monotonic() - t0) / 60
    by_verb = {k: after["requests"][k] - before["requests"].get(k, 0.0) for k in after["requests"]}
    by_verb = {k: int(v) for k, v in sorted(by_verb.items()) if v}
    total = sum(by_verb.values())
    assert bench.operator is not None
    return {
        "idle_seconds": round(minutes * 60, 1),
        "idle_requests": total,
        "idle_requests_by_verb": by_verb,
        "idle_requests_per_rljob_per_minute": round(total / n / minutes, 3),
        "idle_writes": sum(v for k, v in by_verb.items() if not k.startswith(("get ", "list "))),
        "operator_peak_rss_mib_after_idle": round(peak_rss_mib(bench.operator.pid), 1),
    }


def watch_recovery(bench: Bench, timeout: float) -> dict[str, Any]:
    say("restarting the API server")
    down_for = bench.restart_apiserver()
    say(f"API server ready again after {down_for:.1f} s; creating one more RLJob")
    custom = client.CustomObjectsApi(bench.api)
    started = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, rljob("after-restart"))

    def seen() -> bool:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "after-restart")
        return bool((obj.get("status") or {}).get("observedGeneration"))

    wait_for("the new RLJob's status", seen, timeout)
    took = time.monotonic() - started
    say(f"new RLJob seen and reconciled {took:.1f} s after it was created")
    return {"apiserver_restart_seconds": round(down_for, 1), "new_rljob_seen_after_restart_s": round(took, 2)}


def table(result: dict[str, Any]) -> str:
    rows = [
        ("RLJobs applied at once", f"{result['rljobs']} ({2 * result['rljobs']} pods, {2 * result['rljobs']} GPUs)"),
        ("time until all Running", f"{result['seconds_to_running']:.1f} s"),
        ("reconciles during the load", f"{result['reconciles']}"),
        ("reconcile p50 / p99 / mean",
         f"{result['reconcile_p50_s'] * 1e3:.0f} / {result['reconcile_p99_s'] * 1e3:.0f} / "
         f"{result['reconcile_mean_s'] * 1e3:.0f} ms"),
        ("operator peak RSS", f"{result['operator_peak_rss_mib']:.0f} MiB after the load, "
                              f"{result.get('operator_peak_rss_mib_after_idle', math.nan):.0f} MiB at the end"),
    ]  # fmt: skip
    if "idle_requests" in result:
        rows += [
            ("idle API requests", f"{result['idle_requests']} in {result['idle_seconds']:.0f} s "
                                  f"({result['idle_writes']} writes)"),
            ("idle requests / RLJob / min", f"{result['idle_requests_per_rljob_per_minute']:.2f}"),
        ]  # fmt: skip
    if "new_rljob_seen_after_restart_s" in result:
        rows.append(("new RLJob seen after API restart", f"{result['new_rljob_seen_after_restart_s']:.1f} s"))
    cpu = ", ".join(f"{k} {v:.0f}" for k, v in result["cpu_seconds_during_load"].items())
    rows.insert(5, ("CPU seconds during the load", cpu))
    rows.append(("machine", f"{result['cpus']} CPUs, load average before {result['load_before']}"))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rljobs", type=int, default=200, help="RLJobs applied at once (default 200)")
    ap.add_argument("--idle-seconds", type=float, default=300.0,
                    help="idle window for counting requests (default 300: one resync period; 0 skips)")  # fmt: skip
    ap.add_argument("--settle-seconds", type=float, default=20.0, help="wait before the idle window (default 20)")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up on the load after this long (default 900)")
    ap.add_argument("--no-restart", action="store_true", help="skip the API server restart")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # clean up on `kill` like on Ctrl-C
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "command": shlex.join(["python", "bench/operator_load.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    bench = Bench(args)
    try:
        bench.start_cluster(nodes=-(-(2 * args.rljobs + 2) // GPUS_PER_NODE))
        bench.start_operator()
        result.update(load(bench, args.rljobs, args.timeout))
        if args.idle_seconds > 0:
            result.update(idle(bench, args.rljobs, args.idle_seconds, args.settle_seconds))
        if not args.no_restart:
            result.update(watch_recovery(bench, timeout=180))
        result["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except KeyboardInterrupt:
        say("interrupted: cleaning up")
        return 130
    except Exception:
        if bench.operator is not None and bench.operator_log.exists():
            tail = bench.operator_log.read_text(errors="replace")[-3000:]
            say(f"failed; the operator's last output:\n{tail}")
        raise
    finally:
        bench.close()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
