"""Import images from the Docker daemon into the real test node's containerd, sending only the
layers it has not unpacked yet, then dropping the layer blobs it keeps after unpacking.

    python3 node_load.py --address SOCKET --docker DOCKER --sizes FILE REF...

Called by `tests/images/build --load` (DOCKER_HOST set to the daemon the images live in).

Why not `docker save REF | ctr images import -`: containerd then writes every layer again (7 GB
for the trainer image, 2.5 min here) although a source edit changes only its top layers, and it
keeps each layer twice (the blob and the unpacked snapshot). Here `docker save` is read as it
streams and re-packed as an OCI archive that holds the new layers only: containerd's OCI import
takes any blob file and looks layers up by digest, and its unpack skips every layer whose chain
already has a snapshot, without reading the blob. Which member of `docker save` is which layer is
known only once it was hashed, so a layer whose size matches one the node has unpacked (a layer's
tar size is fixed by its digest: FILE records them) is hashed without being sent; if the hash
then says otherwise the image is sent again whole. After the imports, `ctr content prune
references` drops the layer blobs (as the CRI plugin's discard_unpacked_layers does for pulls).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import posixpath
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import IO, Any

SMALL = 1 << 20  # members up to this size (configs, manifests, tiny layers) are kept in memory
LAYER = "application/vnd.oci.image.layer.v1.tar"


class Resend(Exception):
    """A member skipped by its size turned out to be a layer the node lacks."""


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The snapshot key of each layer: its chain ID (the OCI image spec's ChainID)."""
    chain: list[str] = []
    for diff in diff_ids:
        chain.append(diff if not chain else "sha256:" + hashlib.sha256(f"{chain[-1]} {diff}".encode()).hexdigest())
    return chain


def unpacked_layers(diff_ids: list[str], snapshots: set[str]) -> set[str]:
    """The diffIDs of the image's bottom layers whose chain the node has already unpacked."""
    have: set[str] = set()
    for diff, chain in zip(diff_ids, chain_ids(diff_ids), strict=True):
        if chain not in snapshots:
            break
        have.add(diff)
    return have


class _Hashing(io.RawIOBase):
    """Reads ``size`` bytes of ``src``, hashing them (tarfile.addfile reads the data through it)."""

    def __init__(self, src: IO[bytes], digest: Any) -> None:
        self.src, self.digest = src, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self.src.read(len(buf))
        self.digest.update(data)
        buf[: len(data)] = data
        return len(data)


def convert(src: IO[bytes], dst: IO[bytes], skip: dict[str, int], ref: str) -> dict[str, int]:
    """Re-pack the `docker save` stream ``src`` as an OCI archive on ``dst`` without the layers in
    ``skip`` (diffID -> tar size). Returns diffID -> size of every layer of the image."""
    skip_sizes = set(skip.values())
    small: dict[str, bytes] = {}
    large: dict[str, tuple[str, int]] = {}  # member name -> (digest, size)
    links: dict[str, str] = {}
    n = 0
    with tarfile.open(fileobj=src, mode="r|") as tin, tarfile.open(fileobj=dst, mode="w|") as tout:
        for member in tin:
            name = posixpath.normpath(member.name)
            if member.issym():
                links[name] = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
                continue
            if not member.isfile():
                continue
            data = tin.extractfile(member)
            assert data is not None
            if member.size <= SMALL:
                small[name] = data.read()
                continue
            digest = hashlib.sha256()
            if member.size in skip_sizes:  # most likely a layer the node has: hash it, send nothing
                while chunk := data.read(1 << 20):
                    digest.update(chunk)
                if f"sha256:{digest.hexdigest()}" not in skip:
                    raise Resend(name)
            else:
                n += 1
                info = tarfile.TarInfo(f"blobs/sha256/layer-{n}")  # containerd names blobs by their digest itself
                info.size = member.size
                tout.addfile(info, io.BufferedReader(_Hashing(data, digest), 1 << 20))
            large[name] = (f"sha256:{digest.hexdigest()}", member.size)

        (entry,) = json.loads(small.pop("manifest.json"))
        layers: list[dict[str, Any]] = []
        for layer_name in entry["Layers"]:
            layer_name = links.get(posixpath.normpath(layer_name), posixpath.normpath(layer_name))
            if layer_name in small:
                body = small[layer_name]
                layers.append({"mediaType": LAYER, "digest": blob(tout, body), "size": len(body)})
            else:
                digest_s, size = large[layer_name]
                layers.append({"mediaType": LAYER, "digest": digest_s, "size": size})
        config = small[posixpath.normpath(entry["Config"])]
        diff_ids = json.loads(config)["rootfs"]["diff_ids"]
        if diff_ids != [d["digest"] for d in layers]:
            raise ValueError(f"docker save {ref}: its layers do not match its config's diff_ids")
        manifest = json.dumps({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(tout, config),
                       "size": len(config)},
            "layers": layers,
        }).encode()  # fmt: skip
        index = {
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": blob(tout, manifest),
                "size": len(manifest), "annotations": {"io.containerd.image.name": ref},
            }],
        }  # fmt: skip
        add(tout, "index.json", json.dumps(index).encode())
        add(tout, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    return {d["digest"]: d["size"] for d in layers}


def blob(tout: tarfile.TarFile, body: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    add(tout, f"blobs/sha256/{digest[7:]}", body)
    return digest


def add(tout: tarfile.TarFile, name: str, body: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(body)
    tout.addfile(info, io.BytesIO(body))


def ctr(address: str, *args: str) -> list[str]:
    return ["ctr", "-a", address, "-n", "k8s.io", *args]


def output(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


def import_one(address: str, docker: str, ref: str, skip: dict[str, int]) -> dict[str, int]:
    save = subprocess.Popen([docker, "save", ref], stdout=subprocess.PIPE)
    load = subprocess.Popen(ctr(address, "images", "import", "-"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert save.stdout is not None and load.stdin is not None
    try:
        sizes = convert(save.stdout, load.stdin, skip, ref)
        load.stdin.close()
    except BaseException:
        for proc in (save, load):  # an unfinished archive makes no image
            proc.kill()
            proc.wait()
        raise
    save_rc, load_rc = save.wait(timeout=600), load.wait(timeout=1800)
    if save_rc != 0 or load_rc != 0:
        raise RuntimeError(f"importing {ref}: docker save exited {save_rc}, ctr images import exited {load_rc}")
    return sizes


def load(address: str, docker: str, refs: list[str], sizes_file: Path) -> None:
    known: dict[str, int] = json.loads(sizes_file.read_text()) if sizes_file.exists() else {}
    for ref in refs:
        if output(ctr(address, "images", "ls", "-q", f"name=={ref}")).strip():
            continue
        diff_ids = json.loads(output([docker, "image", "inspect", "-f", "{{json .RootFS.Layers}}", ref]))
        listing = output(ctr(address, "snapshots", "--snapshotter", "overlayfs", "ls")).splitlines()[1:]
        snaps = {line.split()[0] for line in listing if line.strip()}
        skip = {d: known[d] for d in unpacked_layers(diff_ids, snaps) if d in known}
        t0 = time.monotonic()
        say(f"importing {ref} into the node ({len(skip)} of {len(diff_ids)} layers already there)")
        try:
            sizes = import_one(address, docker, ref, skip)
        except Resend as e:
            say(f"{e} had the size of a layer the node has but not its content: sending {ref} whole")
            sizes = import_one(address, docker, ref, {})
        known |= sizes
        sizes_file.write_text(json.dumps(known, indent=0) + "\n")
        say(f"imported {ref} in {time.monotonic() - t0:.0f}s")
    forget_older(address, refs)


def forget_older(address: str, refs: list[str]) -> None:
    """Remove the older tags of these images' repositories and the CRI plugin's by-ID names of
    images no tag names any more (they kept 7 GB trainer images alive), then collect garbage:
    unpacked layers' blobs and whatever only removed images held."""
    images = [line.split() for line in output(ctr(address, "images", "ls")).splitlines()[1:] if line.strip()]
    repos = {ref.rsplit(":", 1)[0] for ref in refs}
    stale = [name for name, *_ in images if name.rsplit(":", 1)[0] in repos and name not in refs]
    named = {target for name, _kind, target, *_ in images if not name.startswith("sha256:") and name not in stale}
    stale += [name for name, _kind, target, *_ in images if name.startswith("sha256:") and target not in named]
    if stale:  # --sync: its garbage collection ends before the walk below starts
        output(ctr(address, "images", "rm", "--sync", *stale))
    output(ctr(address, "content", "prune", "references"))


def say(text: str) -> None:
    print(f"[images] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_load.py")
    parser.add_argument("--address", required=True)
    parser.add_argument("--docker", default="docker")
    parser.add_argument("--sizes", type=Path, required=True)
    parser.add_argument("refs", nargs="+")
    args = parser.parse_args(argv)
    try:
        load(args.address, args.docker, args.refs, args.sizes)
    except (RuntimeError, ValueError, OSError) as e:
        say(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
