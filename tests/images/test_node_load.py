"""node_load.py's re-packing of `docker save` output, without Docker or containerd: archives
built here in the layout Docker 20.10 writes (a folder per layer, manifest.json last). The real
import into the node's containerd runs in tests/cluster/test_real_node_e2e.py."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_load import SMALL, Resend, chain_ids, convert, unpacked_layers


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def docker_save(layers: list[bytes], ref: str = "treetrain.local/x:1") -> bytes:
    """A `docker save` archive of an image with these layer tars (the second one also as a symlink)."""
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [sha(x) for x in [*layers, layers[1]]]}}).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        names = []
        for i, layer in enumerate(layers):
            for name, body in ((f"l{i}/VERSION", b"1.0"), (f"l{i}/json", b"{}"), (f"l{i}/layer.tar", layer)):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
            names.append(f"l{i}/layer.tar")
        link = tarfile.TarInfo("dup/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, "../l1/layer.tar"
        tar.addfile(link)
        manifest = [{"Config": "cfg.json", "RepoTags": [ref], "Layers": [*names, "dup/layer.tar"]}]
        for name, body in (("cfg.json", config), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def read_oci(data: bytes) -> tuple[dict[str, bytes], dict[str, object]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    (entry,) = index["manifests"]
    manifest = json.loads(files[f"blobs/sha256/{entry['digest'][7:]}"])
    assert entry["annotations"] == {"io.containerd.image.name": "treetrain.local/x:1"}
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    return files, manifest


BIG = b"a" * (SMALL + 1)
BIG2 = b"b" * (SMALL + 7)
TINY = b"tiny layer"


def test_chain_ids_and_the_unpacked_bottom_of_an_image() -> None:
    diffs = [sha(b"1"), sha(b"2"), sha(b"3")]
    chain = chain_ids(diffs)
    assert chain[0] == diffs[0]
    assert chain[1] == sha(f"{diffs[0]} {diffs[1]}".encode())
    assert unpacked_layers(diffs, {chain[0], chain[1]}) == {diffs[0], diffs[1]}
    assert unpacked_layers(diffs, {chain[1], chain[2]}) == set()  # a chain is only as good as its bottom


def test_everything_is_sent_when_the_node_has_nothing() -> None:
    out = io.BytesIO()
    sizes = convert(io.BytesIO(docker_save([BIG, BIG2, TINY])), out, {}, "treetrain.local/x:1")
    files, manifest = read_oci(out.getvalue())
    layers = manifest["layers"]  # type: ignore[index]
    assert [x["digest"] for x in layers] == [sha(BIG), sha(BIG2), sha(TINY), sha(BIG2)]
    assert {x["mediaType"] for x in layers} == {"application/vnd.oci.image.layer.v1.tar"}
    assert sorted(len(b) for b in files.values() if len(b) > SMALL) == [len(BIG), len(BIG2)]
    assert sizes == {sha(BIG): len(BIG), sha(BIG2): len(BIG2), sha(TINY): len(TINY)}


def test_layers_the_node_has_are_hashed_not_sent() -> None:
    out = io.BytesIO()
    convert(io.BytesIO(docker_save([BIG, BIG2, TINY])), out, {sha(BIG): len(BIG)}, "treetrain.local/x:1")
    files, manifest = read_oci(out.getvalue())
    assert [len(b) for b in files.values() if len(b) > SMALL] == [len(BIG2)]
    assert manifest["layers"][0] == {  # type: ignore[index]
        "mediaType": "application/vnd.oci.image.layer.v1.tar",
        "digest": sha(BIG),
        "size": len(BIG),
    }


def test_a_layer_of_the_same_size_but_other_content_asks_for_a_resend() -> None:
    other = b"c" * len(BIG)
    with pytest.raises(Resend, match=r"l0/layer\.tar"):
        convert(io.BytesIO(docker_save([other, BIG2])), io.BytesIO(), {sha(BIG): len(BIG)}, "treetrain.local/x:1")
