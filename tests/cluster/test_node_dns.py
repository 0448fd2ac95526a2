"""The real node's DNS answers (node_services.py), without a cluster: queries built by hand,
answers read back field by field, the names looked up in a stand-in listing."""

from __future__ import annotations

import socket
import struct
import tarfile
from pathlib import Path
from typing import Any

from node_services import ClusterNames, answer, oci_image_tar


def query(name: str, qtype: int = 1, qid: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(x)]) + x.encode() for x in name.split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def parse(reply: bytes) -> tuple[int, int, list[str]]:
    qid, flags, _qd, ancount, _ns, _ar = struct.unpack("!HHHHHH", reply[:12])
    pos = reply.index(b"\0", 12) + 5
    ips = []
    for _ in range(ancount):
        ptr, rtype, _cls, _ttl, length = struct.unpack("!HHHIH", reply[pos : pos + 12])
        assert ptr == 0xC00C and rtype == 1 and length == 4
        ips.append(socket.inet_ntoa(reply[pos + 12 : pos + 16]))
        pos += 16
    return qid, flags & 0x0F, ips


class FakeApi:
    """The two listings ClusterNames reads (a stand-in for the API server: no cluster here)."""

    def __init__(self) -> None:
        pod = {
            "metadata": {"labels": {"app": "x"}},
            "spec": {"hostname": "job-0", "subdomain": "job"},
            "status": {"podIP": "198.18.0.11"},
        }
        svc = {"metadata": {"name": "job"}, "spec": {"clusterIP": "None", "selector": {"app": "x"}}}
        self.items = {"pods": [pod], "services": [svc]}
        self.calls = 0

    def request(self, method: str, path: str) -> tuple[int, Any]:
        self.calls += 1
        return 200, {"items": self.items[path.rsplit("/", 1)[1]]}


def test_pod_and_headless_service_names_resolve() -> None:
    names = ClusterNames(FakeApi())  # type: ignore[arg-type]
    assert parse(answer(query("job-0.job.ns.svc.cluster.local"), names.lookup)) == (0x1234, 0, ["198.18.0.11"])
    assert parse(answer(query("job.ns.svc.cluster.local"), names.lookup))[1:] == (0, ["198.18.0.11"])
    # The search list's wrong guesses and anything outside the cluster: NXDOMAIN at once.
    assert parse(answer(query("job-0.job.ns.svc.ns.svc.cluster.local"), names.lookup))[1:] == (3, [])
    assert parse(answer(query("pypi.org"), names.lookup))[1:] == (3, [])
    # AAAA for a name that exists: no error, no address (glibc then uses the A answer).
    assert parse(answer(query("job-0.job.ns.svc.cluster.local", qtype=28), names.lookup))[1:] == (0, [])


def test_listings_are_cached_for_a_second() -> None:
    api = FakeApi()
    names = ClusterNames(api)  # type: ignore[arg-type]
    for _ in range(5):
        names.lookup("job-0.job.ns.svc.cluster.local")
    assert api.calls == 1


def test_a_malformed_query_gets_formerr() -> None:
    assert answer(b"\x12\x34\x01", lambda name: None)[3] & 0x0F == 1


def test_pause_image_archive(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF-not-really")
    oci_image_tar(binary, "treetrain.local/pause:abc", tmp_path / "pause.tar")
    with tarfile.open(tmp_path / "pause.tar") as tar:
        names = tar.getnames()
        index = tar.extractfile("index.json").read().decode()  # type: ignore[union-attr]
    assert "oci-layout" in names and sum(n.startswith("blobs/sha256/") for n in names) == 3
    assert '"io.containerd.image.name": "treetrain.local/pause:abc"' in index
