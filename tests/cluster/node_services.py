"""Small services of the real test node (tests/cluster/realnode.py), standard library only.

    python3 node_services.py dns --listen IP --server URL --pki DIR       cluster DNS for pods
    python3 node_services.py forward --listen IP:PORT --to 127.0.0.1:PORT   the API server for pods

- ``dns``: answers A queries for the names the operator gives pods, all under headless Services:
  ``<hostname>.<subdomain>.<ns>.svc.cluster.local`` (a pod's own name: Indexed Job pods and
  StatefulSet pods) and ``<service>.<ns>.svc.cluster.local`` (the pods the Service selects), read
  from the API server (listings cached for a second). Anything else is NXDOMAIN at once: pods on
  the node reach nothing outside it. It stands in for cluster DNS (CoreDNS) on the test node.
- ``forward``: relays TCP from the node's bridge address to the API server, which listens on
  127.0.0.1 only (a pod's 127.0.0.1 is its own), so the operator pod reaches it.

``oci_image_tar`` writes a one-layer OCI image archive (the pause image) for ``ctr images import``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import socket
import socketserver
import struct
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from launcher import Api

DOMAIN = "cluster.local"
TTL = 1
A, AAAA = 1, 28
NOERROR, NXDOMAIN, FORMERR = 0, 3, 1


def parse_query(data: bytes) -> tuple[int, str, int, int]:
    """(id, name, qtype, end of the question) of a one-question query; ValueError if malformed."""
    if len(data) < 12:
        raise ValueError("short header")
    qid, _flags, qdcount = struct.unpack("!HHH", data[:6])
    if qdcount != 1:
        raise ValueError("one question expected")
    labels, pos = [], 12
    while True:
        length = data[pos]
        pos += 1
        if length == 0:
            break
        if length > 63:
            raise ValueError("compressed or bad label")
        labels.append(data[pos : pos + length].decode("ascii", "replace").lower())
        pos += length
    qtype, _qclass = struct.unpack("!HH", data[pos : pos + 4])
    return qid, ".".join(labels), qtype, pos + 4


def answer(data: bytes, lookup: Any) -> bytes:
    """The response to query ``data``; ``lookup(name)`` gives a list of IPv4 strings, or None for
    a name that does not exist."""
    try:
        qid, name, qtype, end = parse_query(data)
    except (ValueError, IndexError, struct.error):
        return data[:2] + struct.pack("!HHHHH", 0x8180 | FORMERR, 0, 0, 0, 0) if len(data) >= 2 else b""
    ips = lookup(name)
    rcode = NXDOMAIN if ips is None else NOERROR
    records = [ip for ip in (ips or []) if qtype == A]
    # QR, opcode 0, AA, RD copied, RA; one question echoed; answers point at it (offset 12).
    rd = data[2] & 0x01
    header = struct.pack("!HBBHHHH", qid, 0x84 | rd, 0x80 | rcode, 1, len(records), 0, 0)
    body = data[12:end]
    for ip in records:
        body += struct.pack("!HHHIH", 0xC00C, A, 1, TTL, 4) + socket.inet_aton(ip)
    return header + body


class ClusterNames:
    """Names to pod IPs from the API server, with each namespace's listing kept for a second."""

    def __init__(self, api: Api, api_address: str = "") -> None:
        self.api = api
        self.api_address = api_address
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str], tuple[float, list[dict[str, Any]]]] = {}

    def _list(self, ns: str, kind: str) -> list[dict[str, Any]]:
        key = (ns, kind)
        with self.lock:
            hit = self.cache.get(key)
            if hit and time.monotonic() - hit[0] < 1.0:
                return hit[1]
        status, body = self.api.request("GET", f"/api/v1/namespaces/{ns}/{kind}")
        items = body.get("items", []) if status == 200 and isinstance(body, dict) else []
        with self.lock:
            self.cache[key] = (time.monotonic(), items)
        return items

    def lookup(self, name: str) -> list[str] | None:
        suffix = f".svc.{DOMAIN}"
        if not name.endswith(suffix):
            return None
        parts = name[: -len(suffix)].split(".")
        try:
            if len(parts) == 3:  # hostname.subdomain.namespace
                host, sub, ns = parts
                ips = [
                    p["status"]["podIP"]
                    for p in self._list(ns, "pods")
                    if p["spec"].get("hostname") == host
                    and p["spec"].get("subdomain") == sub
                    and p.get("status", {}).get("podIP")
                    and not p["metadata"].get("deletionTimestamp")
                ]
                return ips or None
            if len(parts) == 2:  # service.namespace
                svc, ns = parts
                if (svc, ns) == ("kubernetes", "default") and self.api_address:
                    return [self.api_address]  # the relay (kopf's in-cluster login dials this name)
                (service,) = [s for s in self._list(ns, "services") if s["metadata"]["name"] == svc] or [None]
                if service is None:
                    return None
                if service["spec"].get("clusterIP") not in (None, "None"):
                    return [service["spec"]["clusterIP"]]
                selector = service["spec"].get("selector") or {}
                return [
                    p["status"]["podIP"]
                    for p in self._list(ns, "pods")
                    if selector
                    and all(p["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
                    and p.get("status", {}).get("podIP")
                ]
        except (OSError, KeyError, ValueError):
            return None
        return None


def serve_dns(listen: str, api: Api) -> None:
    names = ClusterNames(api, api_address=listen)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            data, sock = self.request
            reply = answer(data, names.lookup)
            if reply:
                sock.sendto(reply, self.client_address)

    class Server(socketserver.ThreadingUDPServer):
        daemon_threads = True
        allow_reuse_address = True

    with Server((listen, 53), Handler) as server:
        print(f"dns: answering *.svc.{DOMAIN} on {listen}:53", flush=True)
        server.serve_forever()


def serve_forward(listen: tuple[str, int], to: tuple[str, int]) -> None:
    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            try:
                upstream = socket.create_connection(to, timeout=10)
            except OSError:
                return
            upstream.settimeout(None)
            back = threading.Thread(target=pipe, args=(upstream, self.request), daemon=True)
            back.start()
            pipe(self.request, upstream)
            back.join()
            upstream.close()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    # Its own port and 443: in-cluster clients that ignore KUBERNETES_SERVICE_PORT (kopf) dial
    # https://kubernetes.default.svc, which the node's DNS answers with this address.
    servers = [Server(listen, Handler), Server((listen[0], 443), Handler)]
    print(f"forward: {listen[0]}:{listen[1]} and :443 -> {to[0]}:{to[1]}", flush=True)
    threading.Thread(target=servers[1].serve_forever, daemon=True).start()
    servers[0].serve_forever()


def oci_image_tar(binary: Path, ref: str, out: Path) -> None:
    """A one-layer OCI image archive holding ``binary`` as /<name>, its entrypoint."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        info = tar.gettarinfo(str(binary), arcname=binary.name)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755
        info.mtime = 0
        with binary.open("rb") as f:
            tar.addfile(info, f)
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    layer_desc = add(layer.getvalue())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [f"/{binary.name}"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }
    config_desc = add(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer_desc}],
    }
    manifest_desc = add(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_desc,
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref.split(":")[-1],
                },
            }
        ],
    }
    with tarfile.open(out, "w") as tar:
        files = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": json.dumps(index).encode()}
        files |= {f"blobs/sha256/{d.split(':')[1]}": b for d, b in blobs.items()}
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_services.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p_dns = sub.add_parser("dns")
    p_dns.add_argument("--listen", required=True)
    p_dns.add_argument("--server", required=True)
    p_dns.add_argument("--pki", required=True)
    p_fwd = sub.add_parser("forward")
    p_fwd.add_argument("--listen", required=True)
    p_fwd.add_argument("--to", required=True)
    args = parser.parse_args(argv)
    if args.command == "dns":
        serve_dns(args.listen, Api(args.server, Path(args.pki)))
    else:
        host, port = args.listen.rsplit(":", 1)
        to_host, to_port = args.to.rsplit(":", 1)
        serve_forward((host, int(port)), (to_host, int(to_port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
