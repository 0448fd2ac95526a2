"""Start and stop the test control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok, all on 127.0.0.1, with simulated GPU nodes.

Used through `tests/cluster/up` and `tests/cluster/down` (see docs/cluster.md), by hand and by
the pytest fixture in tests/cluster/conftest.py. Standard library only, so any python3 >= 3.10
runs it without the project's virtualenv.

`up` prints shell `export` lines on stdout (everything else goes to stderr), so
`eval "$(tests/cluster/up)"` gives a shell whose kubectl and helm talk to the cluster. The
processes keep running after `up` returns; `down` stops them by the pids recorded in the state
directory and removes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# tests/suite_helpers.py (standard library only, like this file): on sys.path under pytest; a
# run as a script (tests/cluster/up) puts tests/ there itself.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from suite_helpers import free_port

HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / ".build" / "cluster"
STAGES = HERE / "kwok-stages.yaml"
BUILD = HERE / "build"
# Start order; `down` stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
LOG_TAIL_LINES = 40
# Service ClusterIPs: loopback too (they are data only; nothing routes them).
SERVICE_CIDR = "127.4.0.0/16"


def realnode_module() -> Any:
    """tests/cluster/realnode.py, imported when a real node is asked for. It imports this module
    by name, so a launcher run as a script registers itself as `launcher` first (one ClusterError)."""
    sys.modules.setdefault("launcher", sys.modules[__name__])
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import realnode

    return realnode


class ClusterError(Exception):
    """A failure with a message meant for the person who ran the command."""


def say(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Processes


def spawn_detached(cmd: list[str], log_path: Path, cwd: Path | None = None) -> int:
    """Start ``cmd`` in its own session, output appended to ``log_path``; returns its pid."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    return proc.pid


def proc_start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat), or None if it is gone.
    Stored next to each pid so that `down` never signals an unrelated process that reused it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # zombie: exited, waiting for its parent
        return None
    return fields[19]


def alive(entry: dict[str, Any]) -> bool:
    return proc_start_time(int(entry["pid"])) == entry["start_time"]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    tail = text[-lines:]
    return "\n".join(f"    {line}" for line in tail) if tail else f"(empty log {path})"


# ---------------------------------------------------------------------------------------------
# Certificates and kubeconfig


def openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed:\n{res.stderr.strip()}")


def make_certs(pki: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """A throw-away CA (ECDSA P-256, 7 days), a serving certificate for 127.0.0.1 used by every
    component, the admin client certificate (group system:masters) and the service-account
    signing key."""
    pki.mkdir(parents=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req", "-x509", *ec, "-days", "7", "-subj", "/CN=treetrain-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    leaves = {
        "serving": (
            "/CN=127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost"
            + "".join(f",IP:{ip}" for ip in extra_ips)
            # In-cluster clients of a real node's pods dial the API server by its Service name.
            + (",DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" if extra_ips else ""),
            "extendedKeyUsage=serverAuth",
        ),
        "admin": ("/O=system:masters/CN=admin", None, "extendedKeyUsage=clientAuth"),
        # The apiserver's identity towards aggregated APIs; publishing a request-header CA also
        # lets the controller-manager and scheduler configure their delegated authentication.
        "front-proxy-client": ("/CN=front-proxy-client", None, "extendedKeyUsage=clientAuth"),
    }
    for name, (subj, san, eku) in leaves.items():
        extra = ["-addext", "basicConstraints=critical,CA:FALSE", "-addext", eku]
        extra += ["-addext", "keyUsage=critical,digitalSignature"]
        if san:
            extra += ["-addext", san]
        openssl(
            "req", "-x509", *ec, "-days", "7", "-subj", subj, "-CA", "ca.crt", "-CAkey", "ca.key",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", *extra,
            cwd=pki,
        )  # fmt: skip
    openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: treetrain-test
  cluster:
    server: {server}
    certificate-authority: {pki / "ca.crt"}
users:
- name: admin
  user:
    client-certificate: {pki / "admin.crt"}
    client-key: {pki / "admin.key"}
contexts:
- name: treetrain-test
  context:
    cluster: treetrain-test
    user: admin
    namespace: default
current-context: treetrain-test
"""
    )
    path.chmod(0o600)


# ---------------------------------------------------------------------------------------------
# A tiny API client (stdlib only): enough to create nodes and wait for readiness.


class Api:
    def __init__(self, server: str, pki: Path):
        self.server = server
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=10) as resp:
                payload = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            payload = e.read()
            status = e.code
        try:
            return status, json.loads(payload) if payload else None
        except json.JSONDecodeError:
            return status, payload.decode(errors="replace")


def https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(kw_only=True)
class Config:
    dir: Path
    nodes: int
    gpus_per_node: int
    cpu_nodes: int
    cpu_per_node: str
    memory_per_node: str
    gpu_product: str
    job_pods_succeed_after: str | None
    timeout: float
    build: bool
    owner_pid: int | None
    bin_dir: Path | None = None
    # A real kubelet beside the kwok nodes (tests/cluster/realnode.py), advertising this many
    # nvidia.com/gpu with no device behind them (GPU-requesting pods of CPU RLJobs run there).
    real_node: bool = False
    real_node_gpus: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.cpu_nodes < 0 or self.nodes + self.cpu_nodes + self.real_node == 0:
            raise ClusterError(f"--nodes {self.nodes} --cpu-nodes {self.cpu_nodes}: need at least one node in all")
        if self.nodes + self.cpu_nodes > 250:
            raise ClusterError("at most 250 simulated nodes (one loopback /24 of pod IPs each)")
        if self.gpus_per_node < 1:
            raise ClusterError(f"--gpus-per-node {self.gpus_per_node}: must be at least 1")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ClusterError(f"{name}={raw!r}: expected a whole number") from None


# ---------------------------------------------------------------------------------------------
# Binaries


def find_bin_dir(build: bool) -> Path:
    """The cached binaries of tests/cluster/build; builds them first when `build` is true."""
    res = subprocess.run([str(BUILD), "--print"], capture_output=True, text=True)
    if res.returncode == 0:
        return Path(res.stdout.strip())
    if not build:
        raise ClusterError(
            "the control-plane binaries are not built (or not for this go.mod/go version).\n"
            "Build them first with `make cluster-bin` (or tests/cluster/build); a cold build "
            "takes 10-15 minutes on 2 cores, later ones seconds."
        )
    say("binaries missing: building them (tests/cluster/build)")
    res = subprocess.run([str(BUILD)], stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise ClusterError("tests/cluster/build failed (see its output above)")
    return Path(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# up


@dataclass
class Cluster:
    cfg: Config
    bin: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return self.cfg.dir

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def save_state(self) -> None:
        state = {
            "bin": str(self.bin),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "ports": self.ports,
            "processes": self.procs,
        }
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.dir / "state.json")

    def start(self, name: str, args: list[str]) -> None:
        cmd = [str(self.bin / name), *args]
        (self.logs / f"{name}.log").with_suffix(".cmd").write_text(shlex.join(cmd) + "\n")
        pid = spawn_detached(cmd, self.logs / f"{name}.log", cwd=self.dir)
        self.procs[name] = {"pid": pid, "start_time": proc_start_time(pid), "cmd": cmd[0]}
        self.save_state()

    def check_alive(self) -> None:
        for name, entry in self.procs.items():
            if not alive(entry):
                raise ClusterError(
                    f"{name} exited during start-up; last lines of {self.logs / name}.log:\n"
                    + log_tail(self.logs / f"{name}.log")
                )

    def wait(
        self,
        what: str,
        check: Callable[[], bool],
        deadline: float,
        log: str,
        detail: Callable[[], str] | None = None,
    ) -> None:
        """Poll `check` until it passes; fail fast when a started process exits, and on the
        deadline with `detail()` (what is still missing) and the tail of `log`."""
        t0 = time.monotonic()
        while True:
            self.check_alive()
            if check():
                say(f"{what}: ready after {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() > deadline:
                extra = f"{detail()}\n" if detail else ""
                raise ClusterError(
                    f"timed out after {self.cfg.timeout:g}s waiting for {what}; {extra}"
                    f"last lines of {self.logs / log}.log:\n" + log_tail(self.logs / f"{log}.log")
                )
            time.sleep(0.2)


def node_manifest(cfg: Config, index: int, name: str, gpus: int, version: str) -> dict[str, Any]:
    capacity = {
        "cpu": cfg.cpu_per_node,
        "memory": cfg.memory_per_node,
        "pods": "110",
        "ephemeral-storage": "1Ti",
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "treetrain.dev/simulated": "true",
    }
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
        labels |= {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.count": str(gpus),
            "nvidia.com/gpu.product": cfg.gpu_product,
        }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        # Pod IPs come from this range (kwok reads spec.podCIDR): loopback, so even a stray
        # dial of a pod address stays on this machine.
        "spec": {"podCIDR": f"127.2.{index}.0/24", "podCIDRs": [f"127.2.{index}.0/24"]},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [
                {"type": "InternalIP", "address": f"127.1.0.{index + 1}"},
                {"type": "Hostname", "address": name},
            ],
            # As a kubelet of the control plane's version would report it.
            "nodeInfo": {"kubeletVersion": version},
        },
    }


def stages_text(cfg: Config) -> str:
    text = STAGES.read_text()
    if cfg.job_pods_succeed_after:
        ms = parse_duration_ms(cfg.job_pods_succeed_after)
        succeed = text.split("name: sim-pod-succeed", 1)[1].split("\n---", 1)[0]
        template = succeed.split("  next:", 1)[1]
        text += f"""---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: sim-job-pod-succeed-default
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: DoesNotExist
    - key: '.status.phase'
      operator: In
      values: ['Running']
    - key: '.metadata.ownerReferences.[].kind'
      operator: In
      values: ['Job']
    - key: '.metadata.labels["sim.treetrain.dev/fail"]'
      operator: NotIn
      values: ['true']
    - key: '.metadata.labels["sim.treetrain.dev/succeed"]'
      operator: NotIn
      values: ['true']
  delay:
    durationMilliseconds: {ms}
  next:{template}"""
    return text


def parse_duration_ms(text: str) -> int:
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                return int(float(number) * units[unit])
            except ValueError:
                break
    raise ClusterError(f"{text!r}: expected a duration such as 500ms, 5s or 2m")


# What `up` writes into its directory; anything else there means it is not ours to delete.
STATE_ENTRIES = {
    "logs", "pki", "etcd", "apiserver-certs", "state.json", "state.json.tmp", "admin.kubeconfig",
    "stages.yaml", "scheduler.yaml", "env.sh", "watchdog.json", "realnode", "env.real-node",
}  # fmt: skip


def remove_state(d: Path, *, keep_logs: bool = False) -> None:
    foreign = sorted(p.name for p in d.iterdir() if p.name not in STATE_ENTRIES)
    if foreign:
        raise ClusterError(
            f"{d} holds files that tests/cluster did not write ({', '.join(foreign[:5])}); "
            "refusing to delete it: pass a new or empty --dir"
        )
    for child in d.iterdir():
        if keep_logs and child.name == "logs":
            continue
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    if not keep_logs:
        d.rmdir()


def check_not_running(d: Path) -> None:
    if (d / "state.json").exists():
        state = json.loads((d / "state.json").read_text())
        running = [n for n, e in state.get("processes", {}).items() if alive(e)]
        if running:
            raise ClusterError(
                f"a cluster is already running from {d} ({', '.join(running)}); "
                f"stop it with `tests/cluster/down --dir {d}` or pick another --dir"
            )


def up(cfg: Config) -> Cluster:
    """Start the cluster in `cfg.dir` (which must hold no running cluster: check_not_running)."""
    t_start = time.monotonic()
    deadline = t_start + cfg.timeout
    d = cfg.dir
    if d.exists():
        remove_state(d)
    bin_dir = cfg.bin_dir or find_bin_dir(cfg.build)
    for name in (*COMPONENTS, "kubectl", "helm"):
        if not (bin_dir / name).is_file():
            raise ClusterError(f"{bin_dir / name} is missing: rerun tests/cluster/build")

    c = Cluster(cfg=cfg, bin=bin_dir)
    c.logs.mkdir(parents=True)
    make_certs(c.pki, extra_ips=(realnode_module().NODE_IP,) if cfg.real_node else ())
    pki = c.pki
    for key in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler"):
        c.ports[key] = free_port()
    write_kubeconfig(c.kubeconfig, c.server, pki)
    (d / "stages.yaml").write_text(stages_text(cfg))
    (d / "scheduler.yaml").write_text(
        f"""apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: {c.kubeconfig}
  qps: 100
  burst: 200
leaderElection:
  leaderElect: false
"""
    )
    c.save_state()
    if cfg.owner_pid:
        start_watchdog(d, cfg.owner_pid)

    serving = [f"--tls-cert-file={pki / 'serving.crt'}", f"--tls-private-key-file={pki / 'serving.key'}"]
    delegated = [
        f"--authentication-kubeconfig={c.kubeconfig}",
        f"--authorization-kubeconfig={c.kubeconfig}",
    ]
    etcd_url = f"http://127.0.0.1:{c.ports['etcd']}"
    peer_url = f"http://127.0.0.1:{c.ports['etcd-peer']}"
    c.start(
        "etcd",
        [
            "--name=treetrain",
            f"--data-dir={d / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=treetrain={peer_url}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ],
    )
    c.wait("etcd", lambda: http_ok(f"{etcd_url}/health"), deadline, "etcd")

    c.start(
        "kube-apiserver",
        [
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={c.ports['apiserver']}",
            *serving,
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--cert-dir={d / 'apiserver-certs'}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={c.server}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # Pods in a fresh namespace must not race the controller that creates its
            # `default` ServiceAccount; simulated pods mount no tokens anyway. A real node's pods
            # do (the operator's): there the plugin stays, and logs/exec reach the kubelet.
            *(
                [
                    "--kubelet-preferred-address-types=InternalIP",
                    f"--kubelet-client-certificate={pki / 'admin.crt'}",
                    f"--kubelet-client-key={pki / 'admin.key'}",
                ]
                if cfg.real_node
                else ["--disable-admission-plugins=ServiceAccount"]
            ),
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--allow-privileged=true",
            # The `kubernetes` Service would point at 127.0.0.1, which endpoint validation refuses.
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
        ],
    )
    api = Api(c.server, pki)

    def readyz_failures() -> str:
        try:
            status, body = api.request("GET", "/readyz?verbose")
        except OSError as e:
            return f"/readyz: {e}"
        failing = [line for line in str(body).splitlines() if line.startswith("[-]")]
        return "failing readyz checks: " + (", ".join(failing) or f"HTTP {status}")

    c.wait(
        "kube-apiserver",
        lambda: https_ok(f"{c.server}/readyz", api.ctx),
        deadline,
        "kube-apiserver",
        readyz_failures,
    )

    c.start(
        "kube-controller-manager",
        [
            f"--kubeconfig={c.kubeconfig}",
            *delegated,
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={c.ports['controller-manager']}",
            *serving,
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            "--controllers=*",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
        ],
    )
    c.start(
        "kube-scheduler",
        [
            f"--config={d / 'scheduler.yaml'}",
            *delegated,
            "--bind-address=127.0.0.1",
            f"--secure-port={c.ports['scheduler']}",
            *serving,
        ],
    )
    c.start(
        "kwok",
        [
            f"--kubeconfig={c.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            "--cidr=127.3.0.0/16",
            "--node-ip=127.1.0.255",
            "--node-lease-duration-seconds=40",
            f"--config={d / 'stages.yaml'}",
        ],
    )

    status, body = api.request("GET", "/version")
    version = body["gitVersion"] if status == 200 else "v0.0.0"
    names = [f"gpu-node-{i}" for i in range(cfg.nodes)] + [f"cpu-node-{i}" for i in range(cfg.cpu_nodes)]
    for i, name in enumerate(names):
        gpus = cfg.gpus_per_node if i < cfg.nodes else 0
        status, body = api.request("POST", "/api/v1/nodes", node_manifest(cfg, i, name, gpus, version))
        if status != 201:
            raise ClusterError(f"creating node {name} failed: HTTP {status}: {body}")
    say(f"created {cfg.nodes} GPU node(s) x {cfg.gpus_per_node} nvidia.com/gpu, {cfg.cpu_nodes} CPU node(s)")

    def nodes_ready() -> bool:
        try:
            status, body = api.request("GET", "/api/v1/nodes")
        except OSError:
            return False
        if status != 200:
            return False
        ready = 0
        for node in body["items"]:
            conds = node.get("status", {}).get("conditions") or []
            ready += any(x["type"] == "Ready" and x["status"] == "True" for x in conds)
        return ready == len(names)

    def sa_ready() -> bool:
        try:
            status, _ = api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        except OSError:
            return False
        return status == 200

    c.wait(
        "kube-controller-manager",
        lambda: https_ok(f"https://127.0.0.1:{c.ports['controller-manager']}/healthz", api.ctx),
        deadline,
        "kube-controller-manager",
    )
    c.wait(
        "kube-scheduler",
        lambda: https_ok(f"https://127.0.0.1:{c.ports['scheduler']}/healthz", api.ctx),
        deadline,
        "kube-scheduler",
    )
    c.wait("nodes Ready (kwok)", nodes_ready, deadline, "kwok")
    c.wait("default ServiceAccount (controllers)", sa_ready, deadline, "kube-controller-manager")
    if cfg.real_node:
        realnode_module().up(c, api, deadline)

    env = {"KUBECONFIG": str(c.kubeconfig), "TREETRAIN_CLUSTER_DIR": str(d)}
    (d / "env.sh").write_text(exports(env, c.bin))
    say(f"cluster ready in {time.monotonic() - t_start:.1f}s: {c.server}, state and logs in {d}")
    return c


def exports(env: dict[str, str], bin_dir: Path) -> str:
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f'export PATH={shlex.quote(str(bin_dir))}:"$PATH"')
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# down and the watchdog


def down(d: Path, *, keep_logs: bool, quiet: bool = False) -> None:
    state_file = d / "state.json"
    if not state_file.exists():
        if not quiet:
            say(f"no cluster state in {d}: nothing to stop")
        if d.exists() and not keep_logs:
            remove_state(d)
        return
    state = json.loads(state_file.read_text())
    procs: dict[str, dict[str, Any]] = state.get("processes", {})
    order = [n for n in reversed(COMPONENTS) if n in procs] + [n for n in procs if n not in COMPONENTS]
    if any(n in procs for n in ("kubelet", "containerd")):
        # Its pods go while the kubelet and the API server still run, then its processes.
        api = Api(state["server"], d / "pki") if "kube-apiserver" in procs and alive(procs["kube-apiserver"]) else None
        realnode_module().down(d, procs, stop, api)
    live = [n for n in order if alive(procs[n])]
    # Clients first, then the apiserver, then etcd: an apiserver whose etcd is gone, or that
    # still has controllers attached, takes long to shut down.
    for group in (["kwok", "kube-scheduler", "kube-controller-manager"], ["kube-apiserver"], ["etcd"]):
        stop([n for n in live if n in group], procs)
    stop([n for n in live if n not in COMPONENTS], procs)
    watchdog = d / "watchdog.json"
    if watchdog.exists():
        entry = json.loads(watchdog.read_text())
        if entry["pid"] != os.getpid() and alive(entry):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry["pid"]), signal.SIGTERM)
    if not quiet:
        say(f"stopped {', '.join(live) if live else 'nothing (no process was running)'}")
    remove_state(d, keep_logs=keep_logs)


def stop(names: list[str], procs: dict[str, dict[str, Any]], grace: float = 10) -> None:
    """SIGTERM `names`, wait up to `grace` seconds, then SIGKILL what is left."""
    for name in names:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(procs[name]["pid"]), signal.SIGTERM)
    t_end = time.monotonic() + grace
    while time.monotonic() < t_end and any(alive(procs[n]) for n in names):
        time.sleep(0.05)
    for name in names:
        if alive(procs[name]):
            say(f"{name} ignored SIGTERM for {grace:.0f}s: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(procs[name]["pid"]), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The apiserver alone (fault tests: the control plane's front door goes away and comes back)


def apiserver(d: Path, action: str, timeout: float) -> None:
    """Stop only the kube-apiserver, or start it again with its recorded command line (same
    port, certificates and etcd), waiting for /readyz. Everything else keeps running."""
    state_file = d / "state.json"
    if not state_file.exists():
        raise ClusterError(f"no cluster state in {d}")
    state = json.loads(state_file.read_text())
    procs: dict[str, dict[str, Any]] = state["processes"]
    name = "kube-apiserver"
    running = name in procs and alive(procs[name])
    if action == "stop":
        if running:
            # It drains for longer than a fault test cares to wait: SIGKILL after 3 s.
            stop([name], procs, grace=3)
        say(f"{name} stopped" if running else f"{name} was not running")
        return
    if running:
        say(f"{name} is already running")
        return
    cmd = shlex.split((d / "logs" / f"{name}.cmd").read_text())
    pid = spawn_detached(cmd, d / "logs" / f"{name}.log", cwd=d)
    procs[name] = {"pid": pid, "start_time": proc_start_time(pid), "cmd": cmd[0]}
    tmp = d / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(state_file)
    ctx = Api(state["server"], d / "pki").ctx
    t0 = time.monotonic()
    while not https_ok(f"{state['server']}/readyz", ctx):
        if not alive(procs[name]):
            raise ClusterError(f"{name} exited on restart:\n" + log_tail(d / "logs" / f"{name}.log"))
        if time.monotonic() - t0 > timeout:
            raise ClusterError(f"{name} not ready {timeout:g}s after restart:\n" + log_tail(d / "logs" / f"{name}.log"))
        time.sleep(0.2)
    say(f"{name} started again: ready after {time.monotonic() - t0:.1f}s")


def start_watchdog(d: Path, owner_pid: int) -> None:
    """A detached process that runs `down --keep-logs` when `owner_pid` exits, so that a killed
    pytest leaves nothing running."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "watch", "--dir", str(d), "--pid", str(owner_pid)]
    pid = spawn_detached(cmd, d / "logs" / "watchdog.log")
    entry = {"pid": pid, "start_time": proc_start_time(pid), "owner": owner_pid}
    (d / "watchdog.json").write_text(json.dumps(entry) + "\n")


def watch(d: Path, owner_pid: int) -> None:
    owner_start = proc_start_time(owner_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while (d / "state.json").exists():
        if owner_start is None or proc_start_time(owner_pid) != owner_start:
            say(f"owner process {owner_pid} is gone: stopping the cluster in {d}")
            down(d, keep_logs=True)
            return
        time.sleep(1)


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dir_help = f"state directory (default $TREETRAIN_CLUSTER_DIR or {DEFAULT_DIR})"
    default_dir = os.environ.get("TREETRAIN_CLUSTER_DIR") or str(DEFAULT_DIR)

    p_up = sub.add_parser("up", help="start the cluster, print export lines, return when ready")
    p_up.add_argument("--dir", default=default_dir, help=dir_help)
    p_up.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="simulated GPU nodes (default $TREETRAIN_CLUSTER_NODES or 4)",
    )
    p_up.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="nvidia.com/gpu per node (default $TREETRAIN_CLUSTER_GPUS_PER_NODE or 8)",
    )
    p_up.add_argument(
        "--cpu-nodes",
        type=int,
        default=None,
        help="extra simulated nodes without GPUs (default $TREETRAIN_CLUSTER_CPU_NODES or 0)",
    )
    p_up.add_argument("--cpu-per-node", default="96", help="cpu capacity of each node (default 96)")
    p_up.add_argument("--memory-per-node", default="1Ti", help="memory capacity of each node (default 1Ti)")
    p_up.add_argument(
        "--gpu-product",
        default="NVIDIA-H100-80GB-HBM3",
        help="value of the nvidia.com/gpu.product node label",
    )
    p_up.add_argument(
        "--job-pods-succeed-after",
        default=os.environ.get("TREETRAIN_CLUSTER_JOB_PODS_SUCCEED_AFTER") or None,
        metavar="DURATION",
        help="make every Job pod succeed this long after it runs (e.g. 5s); "
        "default: only pods labelled sim.treetrain.dev/succeed=true succeed",
    )
    p_up.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("TREETRAIN_CLUSTER_TIMEOUT") or 180),
        help="seconds to wait for readiness (default $TREETRAIN_CLUSTER_TIMEOUT or 180)",
    )
    p_up.add_argument(
        "--no-build",
        action="store_true",
        help="fail instead of building when the binaries are missing",
    )
    p_up.add_argument(
        "--real-node",
        action="store_true",
        help="add one real node (kubelet, containerd, CNI bridge; needs root and `make images node-bin`)",
    )
    p_up.add_argument(
        "--real-node-gpus",
        type=int,
        default=0,
        help="nvidia.com/gpu the real node advertises, with no device behind them (default 0)",
    )
    p_up.add_argument(
        "--owner-pid",
        type=int,
        default=None,
        help="stop the cluster (keeping logs) when this process exits",
    )

    p_down = sub.add_parser("down", help="stop what `up` started and remove its state")
    p_down.add_argument("--dir", default=default_dir, help=dir_help)
    p_down.add_argument("--keep-logs", action="store_true", help="keep <dir>/logs")

    p_api = sub.add_parser("apiserver", help="stop, or start again, only the kube-apiserver (fault tests)")
    p_api.add_argument("action", choices=("stop", "start"))
    p_api.add_argument("--dir", default=default_dir, help=dir_help)
    p_api.add_argument("--timeout", type=float, default=120, help="seconds to wait for /readyz after start")

    p_watch = sub.add_parser("watch", help=argparse.SUPPRESS)
    p_watch.add_argument("--dir", required=True)
    p_watch.add_argument("--pid", type=int, required=True)

    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cfg = Config(
                dir=Path(args.dir).resolve(),
                nodes=args.nodes if args.nodes is not None else env_int("TREETRAIN_CLUSTER_NODES", 4),
                gpus_per_node=(
                    args.gpus_per_node
                    if args.gpus_per_node is not None
                    else env_int("TREETRAIN_CLUSTER_GPUS_PER_NODE", 8)
                ),
                cpu_nodes=(args.cpu_nodes if args.cpu_nodes is not None else env_int("TREETRAIN_CLUSTER_CPU_NODES", 0)),
                cpu_per_node=args.cpu_per_node,
                memory_per_node=args.memory_per_node,
                gpu_product=args.gpu_product,
                job_pods_succeed_after=args.job_pods_succeed_after,
                timeout=args.timeout,
                build=not args.no_build,
                owner_pid=args.owner_pid,
                real_node=args.real_node,
                real_node_gpus=args.real_node_gpus,
            )
            # Outside the clean-up below, which must never stop a cluster that this call did not start.
            check_not_running(cfg.dir)
            try:
                c = up(cfg)
            except BaseException:
                if (cfg.dir / "state.json").exists():
                    down(cfg.dir, keep_logs=True, quiet=True)
                    say(f"start-up failed: stopped what had started; logs kept in {cfg.dir / 'logs'}")
                raise
            sys.stdout.write((c.dir / "env.sh").read_text())
        elif args.command == "down":
            down(Path(args.dir).resolve(), keep_logs=args.keep_logs)
        elif args.command == "apiserver":
            apiserver(Path(args.dir).resolve(), args.action, args.timeout)
        else:
            watch(Path(args.dir).resolve(), args.pid)
    except ClusterError as e:
        print(f"tests/cluster {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tests/cluster {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
