"""One real node for the test cluster (`tests/cluster/up --real-node`): a kubelet of the control
plane's version with containerd, runc and the CNI bridge, beside kwok's simulated nodes. Pods
scheduled on it run real containers from the images of `make images` (see docs/cluster.md).

Machine-wide, so one at a time per machine (the owner is recorded in RUN/owner.json):
- the bridge ``ttnode0`` with 198.18.0.1/24 (the benchmarking range, on no network here; pods get
  no default route, so nothing they send leaves the machine); the node's InternalIP is 198.18.0.1;
- containerd's state and socket under RUN, the kubelet's root under VAR, containerd's images under
  the cache (they outlive the cluster: the first import of the 7 GB trainer image takes minutes,
  later ones send only the layers that changed; only the unpacked layers are kept, about 7 GB:
  tests/images/node_load.py);
- two helper processes (node_services.py): cluster DNS for pods on 198.18.0.1:53, and a relay of
  198.18.0.1:<apiserver port> to the API server on 127.0.0.1 (the operator pod's way in).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from launcher import HERE, Api, ClusterError, alive, free_port, proc_start_time, say, spawn_detached

NODE_NAME = "real-node-0"
NODE_LABEL = "treetrain.dev/real-node"
BRIDGE = "ttnode0"
NODE_IP = "198.18.0.1"
SUBNET = "198.18.0.0/24"
RUN = Path("/run/treetrain-node")
VAR = Path("/var/lib/treetrain-node")
CNI_BIN = Path("/usr/lib/cni")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treetrain" / "node"
SOCK = RUN / "containerd.sock"
PROCS = ("kubelet", "node-dns", "node-api-relay", "containerd")
# What the first import may cost: `docker save` of the trainer image into Docker's temporary
# folder (7 GB) while containerd writes its layers (7 GB) and unpacks them (7 GB, kept; the other
# two go once it is done). Checked up front, before anything starts.
FREE_GIB_COLD = 22


def preflight(images_loaded: bool) -> None:
    """Everything the node needs from the machine, in one line naming what is missing."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (kubelet, containerd and pod networks need it; run as root)")
    cg = Path("/sys/fs/cgroup")
    if not ((cg / "cgroup.controllers").exists() or all((cg / c).is_dir() for c in ("cpu", "memory", "pids"))):
        missing.append("cgroups (mount cgroup v2, or v1 with cpu, memory and pids, at /sys/fs/cgroup)")
    if "overlay" not in Path("/proc/filesystems").read_text():
        missing.append("the overlay filesystem (modprobe overlay)")
    tools = [t for t in ("containerd", "ctr", "runc", "ip") if shutil.which(t) is None]
    tools += [f"CNI {p}" for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    if tools:
        missing.append(f"{', '.join(tools)} (run tests/images/host-packages node)")
    CACHE.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(CACHE).free / 2**30
    # Once the images were imported, a new key shares all but its last layers with them; `docker
    # save` still writes the whole image to a temporary folder first.
    need = 9 if images_loaded else FREE_GIB_COLD
    if free < need:
        missing.append(f"disk: {free:.1f} GiB free under {CACHE}, the node's images need {need} GiB")
    if missing:
        raise ClusterError("the real node cannot start: missing " + "; ".join(missing))
    owner = RUN / "owner.json"
    if owner.exists():
        other = json.loads(owner.read_text())
        state = Path(other["dir"]) / "state.json"
        procs = json.loads(state.read_text()).get("processes", {}) if state.exists() else {}
        if any(alive(procs[n]) for n in PROCS if n in procs):
            raise ClusterError(
                f"a real node is already running on this machine (cluster {other['dir']}); stop it first"
            )
        say(f"cleaning up after a real node that was not stopped (cluster {other['dir']})")
        cleanup()


def run(*cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-800:]}")
    return done


def node_bin(build: bool) -> Path:
    done = run(str(HERE / "build"), "--node", *([] if build else ["--print"]), check=False, timeout=3600)
    if done.returncode != 0:
        raise ClusterError(
            "the real node's binaries (kubelet, pause) are not built: run `make node-bin` (tests/cluster/build --node)"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def images(*args: str) -> dict[str, str]:
    """NAME=REF of the images (tests/images/build ARGS: --print, or --load SOCKET to build what is
    missing and import what the node's containerd lacks: minutes for the 7 GB trainer image, once)."""
    script = HERE.parent / "images" / "build"
    done = subprocess.run([str(script), *args], stdout=subprocess.PIPE, text=True, timeout=3600)
    if done.returncode != 0:
        raise ClusterError(f"tests/images/build {' '.join(args)} failed: run `make images` first (output above)")
    return dict(line.split("=", 1) for line in done.stdout.split())


def containerd_config(root: Path, pause_ref: str) -> str:
    cri = '[plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{RUN / "containerd"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{SOCK}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"
{cri}]
  sandbox_image = "{pause_ref}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
{cri}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{RUN / "cni"}"
"""


def cni_config() -> str:
    ipam = {
        "type": "host-local",
        "ranges": [[{"subnet": SUBNET, "rangeStart": "198.18.0.10", "rangeEnd": "198.18.0.250", "gateway": NODE_IP}]],
        "dataDir": str(VAR / "cni-ipam"),
    }
    bridge = {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True, "ipam": ipam}
    return json.dumps({"cniVersion": "1.0.0", "name": "treetrain-node", "plugins": [bridge]}, indent=1)


def kubelet_config(d: Path, pki: Path, port: int, healthz: int) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {pki / "ca.crt"}}}
authorization: {{mode: AlwaysAllow}}
cgroupDriver: cgroupfs
failCgroupV1: false
containerRuntimeEndpoint: unix://{SOCK}
clusterDNS: [{NODE_IP}]
clusterDomain: cluster.local
resolvConf: {d / "resolv.conf"}
# The images are imported, never pulled: a disk that looks full must not make the kubelet delete them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}}
failSwapOn: false
serializeImagePulls: false
nodeStatusUpdateFrequency: 5s
syncFrequency: 5s
maxPods: 30
"""


def up(c: Any, api: Api, deadline: float) -> None:
    """Start the node of cluster ``c`` (launcher.Cluster) and wait until it is Ready."""
    nd = c.dir / "realnode"
    nd.mkdir()
    images() if c.cfg.build else images("--print")
    bins = node_bin(c.cfg.build)
    preflight((CACHE / "containerd" / "loaded.json").exists())
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / "owner.json").write_text(json.dumps({"dir": str(c.dir)}) + "\n")
    (nd / "netns-before.json").write_text(json.dumps(sorted(netns())) + "\n")

    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    (RUN / "cni").mkdir(exist_ok=True)
    (RUN / "cni" / "10-treetrain.conflist").write_text(cni_config())

    pause_ref = "treetrain.local/pause:" + str(proc_hash(bins / "pause"))
    (nd / "containerd.toml").write_text(containerd_config(CACHE / "containerd", pause_ref))
    start(c, "containerd", ["containerd", "--config", str(nd / "containerd.toml")])
    c.wait(
        "containerd",
        lambda: run("ctr", "-a", str(SOCK), "version", check=False).returncode == 0,
        deadline,
        "containerd",
    )
    if not run("ctr", "-a", str(SOCK), "-n", "k8s.io", "images", "ls", "-q", f"name=={pause_ref}").stdout.strip():
        from node_services import oci_image_tar

        oci_image_tar(bins / "pause", pause_ref, nd / "pause.tar")
        run("ctr", "-a", str(SOCK), "-n", "k8s.io", "images", "import", str(nd / "pause.tar"))
    # The refs imported are the ones the pods get (the tree may have changed since the check above).
    refs = images("--load", str(SOCK))
    (CACHE / "containerd" / "loaded.json").write_text(json.dumps(sorted(refs.values())) + "\n")

    services = [sys.executable, str(HERE / "node_services.py")]
    start(c, "node-dns", [*services, "dns", "--listen", NODE_IP, "--server", c.server, "--pki", str(c.pki)])
    api_port = c.ports["apiserver"]
    start(
        c,
        "node-api-relay",
        [*services, "forward", "--listen", f"{NODE_IP}:{api_port}", "--to", f"127.0.0.1:{api_port}"],
    )

    (nd / "resolv.conf").write_text("")
    port, healthz = free_port(), free_port()
    (nd / "kubelet.yaml").write_text(kubelet_config(nd, c.pki, port, healthz))
    VAR.mkdir(parents=True, exist_ok=True)
    start(
        c,
        "kubelet",
        [
            str(bins / "kubelet"),
            f"--config={nd / 'kubelet.yaml'}",
            f"--kubeconfig={c.kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={VAR / 'kubelet'}",
            f"--cert-dir={nd / 'kubelet-pki'}",
            f"--node-labels={NODE_LABEL}=true",
            "--v=1",
        ],
    )

    def ready() -> bool:
        status, body = api.request("GET", f"/api/v1/nodes/{NODE_NAME}")
        conds = body.get("status", {}).get("conditions", []) if status == 200 else []
        return any(x["type"] == "Ready" and x["status"] == "True" for x in conds)

    c.wait(f"real node {NODE_NAME} Ready", ready, deadline, "kubelet")
    if c.cfg.real_node_gpus:
        advertise(api, "nvidia.com/gpu", c.cfg.real_node_gpus)
    (c.dir / "env.real-node").write_text(
        json.dumps({"node": NODE_NAME, "node_ip": NODE_IP, "api_port": api_port, "images": refs}) + "\n"
    )


def merge_patch(api: Api, path: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(f"{api.server}{path}", data=json.dumps(body).encode(), method="PATCH")
    req.add_header("Content-Type", "application/merge-patch+json")
    with urllib.request.urlopen(req, context=api.ctx, timeout=10) as resp:
        if resp.status != 200:
            raise ClusterError(f"PATCH {path} failed: HTTP {resp.status}")


def advertise(api: Api, resource: str, count: int) -> None:
    """Give the node ``count`` of an extended resource (``nvidia.com/gpu``) with no device behind it:
    GPU-requesting pods of a CPU RLJob are scheduled and run on the CPU."""
    merge_patch(
        api,
        f"/api/v1/nodes/{NODE_NAME}/status",
        {"status": {"capacity": {resource: str(count)}, "allocatable": {resource: str(count)}}},
    )


def proc_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def start(c: Any, name: str, cmd: list[str]) -> None:
    (c.logs / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
    pid = spawn_detached(cmd, c.logs / f"{name}.log", cwd=c.dir)
    c.procs[name] = {"pid": pid, "start_time": proc_start_time(pid), "cmd": cmd[0]}
    c.save_state()


def netns() -> set[str]:
    with contextlib.suppress(OSError):
        return set(os.listdir("/var/run/netns"))
    return set()


def down(d: Path, procs: dict[str, dict[str, Any]], stop: Any, api: Api | None) -> None:
    """Stop the node of the cluster in ``d``: its pods first (while the kubelet and the API server
    still run, so each pod's network is torn down by CNI), then every process, then whatever is
    left on the machine (containers, mounts, network namespaces, the bridge)."""
    if api is not None and "kubelet" in procs and alive(procs["kubelet"]):
        with contextlib.suppress(OSError, urllib.error.URLError, ClusterError):
            merge_patch(api, f"/api/v1/nodes/{NODE_NAME}", {"spec": {"unschedulable": True}})
            status, body = api.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName={NODE_NAME}")
            for pod in body.get("items", []) if status == 200 else []:
                meta = pod["metadata"]
                api.request(
                    "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}?gracePeriodSeconds=0"
                )
            t_end = time.monotonic() + 30
            while time.monotonic() < t_end and tasks():
                time.sleep(0.5)
    stop([n for n in ("kubelet", "node-dns", "node-api-relay") if n in procs and alive(procs[n])], procs)
    for task in tasks():
        run("ctr", "-a", str(SOCK), "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", task, check=False)
    t_end = time.monotonic() + 20
    while time.monotonic() < t_end and any(t for t in tasks() if task_running(t)):
        time.sleep(0.3)
    for task in tasks():
        run("ctr", "-a", str(SOCK), "-n", "k8s.io", "tasks", "delete", "-f", task, check=False)
    stop([n for n in ("containerd",) if n in procs and alive(procs[n])], procs)
    before = (
        set(json.loads((d / "realnode" / "netns-before.json").read_text()))
        if (d / "realnode" / "netns-before.json").exists()
        else set()
    )
    cleanup(keep_netns=before)


def tasks() -> list[str]:
    if not SOCK.exists():
        return []
    done = run("ctr", "-a", str(SOCK), "-n", "k8s.io", "tasks", "ls", "-q", check=False, timeout=20)
    return done.stdout.split() if done.returncode == 0 else []


def task_running(task: str) -> bool:
    done = run("ctr", "-a", str(SOCK), "-n", "k8s.io", "tasks", "ls", check=False, timeout=20)
    return any(line.split()[:1] == [task] and "RUNNING" in line for line in done.stdout.splitlines())


def cleanup(keep_netns: set[str] | None = None) -> None:
    """Unmount what the node mounted, remove its pods' network namespaces and the bridge, and its
    state (containerd's images under the cache stay)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for target in reversed(mounts):
        if target.startswith((str(VAR) + "/", str(RUN) + "/", str(CACHE / "containerd") + "/")):
            run("umount", "-l", target, check=False)
    for ns in netns() - (keep_netns or set()):
        if ns.startswith("cni-"):
            run("ip", "netns", "delete", ns, check=False)
    run("ip", "link", "delete", BRIDGE, check=False)
    shutil.rmtree(VAR, ignore_errors=True)
    shutil.rmtree(RUN, ignore_errors=True)
