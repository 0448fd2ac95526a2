"""Distributed weight sync against stand-in servers that really join the group over gloo.

The stand-ins (tests/unit/weight_standin.py) are NOT SGLang or vLLM: separate Python processes on
127.0.0.1 that answer SGLang's or our vLLM extension's weight-sync routes and receive the
broadcast with the same group code as the trainer. The real vLLM server is in tests/vllm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from suite_helpers import free_port

from treetrain import config as C
from treetrain.rl import weight_group as wg
from treetrain.rl.rollout import RolloutError, remote_client
from treetrain.rl.weight_sync import WeightSender

HERE = Path(__file__).resolve().parent


class StandIn:
    def __init__(self, kind: str, out: Path, *, join: bool = True, port: int = 0) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.kind, self.out = kind, out
        args = [sys.executable, str(HERE / "weight_standin.py"), kind, str(out), "--port", str(port)]
        args += [] if join else ["--no-join"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "port N" once it listens
        assert line.startswith("port "), line
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"

    def paths(self) -> list[str]:
        calls = (self.out / "calls.jsonl").read_text().splitlines() if (self.out / "calls.jsonl").exists() else []
        return [json.loads(c)["path"] for c in calls]

    def bodies(self, path: str) -> list[Any]:
        lines = (self.out / "calls.jsonl").read_text().splitlines()
        return [c["body"] for c in map(json.loads, lines) if c["path"] == path]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        loaded: dict[str, torch.Tensor] = torch.load(self.out / f"weights-v{version}.pt")
        return loaded

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[list[StandIn]]:
    servers = [StandIn("sglang", tmp_path / "sglang"), StandIn("vllm", tmp_path / "vllm")]
    yield servers
    for s in servers:
        s.close()


def settings(**kw: Any) -> C.WeightSyncSettings:
    return C.WeightSyncSettings(master_port=free_port(), backend="gloo", **kw)


def test_buckets_pack_and_unpack_bit_exact() -> None:
    named = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7)),
        ("c", torch.randn(2, 2).bfloat16()),
        ("d", torch.randn(9)),
    ]
    cut = list(wg.buckets(named, bucket_bytes=64))
    assert [[n for n, _ in b] for b in cut] == [["a"], ["b"], ["c"], ["d"]]  # 60 B, 28 B + a dtype change, 36 B
    assert [[n for n, _ in b] for b in wg.buckets(named, 1 << 20)] == [["a", "b"], ["c"], ["d"]]
    for bucket in cut:
        specs = [wg.spec_of(n, t) for n, t in bucket]
        back = wg.unpack(wg.pack(bucket), specs)
        for (n, t), (m, u) in zip(bucket, back, strict=True):
            assert n == m and u.dtype == t.dtype and torch.equal(u, t)


def test_weights_arrive_bit_exact_in_buckets_at_every_server(standins: list[StandIn]) -> None:
    """One group: trainer rank 0, the SGLang stand-in rank 1, the vLLM stand-in (our extension) rank 2."""
    sglang, vllm = standins
    servers = [C.RolloutServer(url=sglang.url, kind="sglang"), C.RolloutServer(url=vllm.url, kind="vllm")]
    client = remote_client([(s.url, s.kind) for s in servers])
    sender = WeightSender(client.sync_targets(), servers, settings(bucket_mb=1))  # type: ignore[attr-defined]
    weights = {f"layer{i}.weight": torch.randn(256, 300) for i in range(4)}  # 300 KB each: 2 buckets of 1 MB
    weights["norm.weight"] = torch.randn(300).bfloat16()
    try:
        sender.push(weights.items(), version=7)
        weights["layer0.weight"] += 1
        sender.push(weights.items(), version=8)
    finally:
        sender.close()
    for server in standins:
        got = server.weights(8)
        assert list(got) == list(weights)
        for name, t in weights.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert not torch.equal(server.weights(7)["layer0.weight"], weights["layer0.weight"])
    # SGLang: joined once as rank 1, three buckets per version (fp32 x2, then the bf16 one), paused around each.
    (init,) = sglang.bodies("/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 3, "gloo")
    updates = sglang.bodies("/update_weights_from_distributed")
    assert [len(u["names"]) for u in updates] == [3, 1, 1] * 2
    assert [u["flush_cache"] for u in updates] == [False, False, True] * 2
    assert {u["weight_version"] for u in updates} == {"7", "8"}
    assert sglang.paths()[:2] == ["/init_weights_update_group", "/pause_generation"]
    assert sglang.paths()[-1] == "/continue_generation"
    # vLLM: our extension through /collective_rpc, as rank 2; the prefix cache dropped before resuming.
    rpcs = [b["method"] for b in vllm.bodies("/collective_rpc")]
    assert rpcs == ["join_weight_group"] + ["receive_weights"] * 6
    assert vllm.bodies("/collective_rpc")[0]["kwargs"]["rank_offset"] == 2
    assert vllm.paths()[-2:] == ["/reset_prefix_cache", "/resume"]


def test_a_server_that_does_not_join_is_named(tmp_path: Path) -> None:
    good, lost = StandIn("sglang", tmp_path / "good"), StandIn("vllm", tmp_path / "lost", join=False)
    try:
        servers = [C.RolloutServer(url=good.url, kind="sglang"), C.RolloutServer(url=lost.url, kind="vllm")]
        client = remote_client([(s.url, s.kind) for s in servers], retries=0)
        sender = WeightSender(client.sync_targets(), servers, settings(timeout_seconds=3))  # type: ignore[attr-defined]
        with pytest.raises(RolloutError) as info:
            sender.connect()
        message = str(info.value)
        assert f"weight sync: {lost.url} (POST {lost.url}/collective_rpc failed: HTTP 500" in message
        assert "cannot reach 127.0.0.1" in message and good.url not in message
        assert "did not join the weight-update group" in message
        assert f"127.0.0.1:{sender.request.port}" in message and "world size 3" in message
    finally:
        good.close()
        lost.close()


def test_rank_offsets_follow_each_servers_gpus(standins: list[StandIn]) -> None:
    sglang, vllm = standins
    servers = [C.RolloutServer(url=sglang.url, kind="sglang", gpus=4), C.RolloutServer(url=vllm.url, kind="vllm")]
    client = remote_client([(s.url, s.kind) for s in servers])
    sender = WeightSender(client.sync_targets(), servers, settings())  # type: ignore[attr-defined]
    assert sender.offsets == {sglang.url: 1, vllm.url: 5} and sender.request.world_size == 6
    with pytest.raises(RolloutError, match=r"not in rollout\.servers"):
        WeightSender(client.sync_targets(), servers[:1], settings())  # type: ignore[attr-defined]


@pytest.mark.slow
def test_trainer_syncs_by_broadcast_every_step(standins: list[StandIn], tmp_path: Path, monkeypatch: Any) -> None:
    """The whole loop, distributed sync (the default): no checkpoint.dir, and after each step both
    servers hold exactly the trainer's weights."""
    from suite_helpers import small

    from treetrain.trainer.loop import Trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sglang, vllm = standins
    raw = small()
    raw["trainer"]["steps"] = 2
    raw["rollout"] = {
        "servers": [{"url": sglang.url, "kind": "sglang"}, {"url": vllm.url, "kind": "vllm"}],
        "weightSync": {"masterPort": free_port(), "backend": "gloo"},
    }
    trainer = Trainer(C.validate(raw), log=lambda _: None)
    try:
        trainer.run()
        final = trainer.actor.hf_weights()
    finally:
        trainer.close()
    assert final is not None
    for server in standins:
        got = server.weights(2)
        assert set(got) == set(final)
        assert all(torch.equal(got[n], t) for n, t in final.items())
        assert server.weights(1).keys() == got.keys()


@pytest.mark.slow
def test_a_restarted_server_gets_the_current_weights_before_sampling(
    standins: list[StandIn], tmp_path: Path, monkeypatch: Any
) -> None:
    """The vLLM stand-in restarts between two steps (same port, no weights, no version): before the
    second step samples, the trainer finds it through the version it reports, leaves the broken
    group, joins both servers afresh and sends version 1 again; then step 2 syncs version 2."""
    from suite_helpers import small

    from treetrain.trainer.loop import Trainer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sglang, vllm = standins
    raw = small()
    raw["trainer"].setdefault("rollout", {})["maxStaleness"] = 0  # train_step driven here: the synchronous loop
    raw["rollout"] = {
        "servers": [{"url": sglang.url, "kind": "sglang"}, {"url": vllm.url, "kind": "vllm"}],
        "weightSync": {"masterPort": free_port(), "backend": "gloo", "timeoutSeconds": 60},
    }
    lines: list[str] = []
    trainer = Trainer(C.validate(raw), log=lines.append)
    try:
        trainer.train_step(0)
        assert trainer.client is not None and trainer.client.stale_servers(1) == []
        port = int(vllm.url.rsplit(":", 1)[1])
        vllm.close()
        standins[1] = again = StandIn("vllm", tmp_path / "vllm-again", port=port)
        assert trainer.client.stale_servers(1) == [again.url]
        trainer.train_step(1)
        final = trainer.actor.hf_weights()
    finally:
        trainer.close()
    assert final is not None
    assert any(f"{again.url} does not hold weight version 1" in line for line in lines), lines
    rpcs = [b["method"] for b in again.bodies("/collective_rpc")]
    # Ours, then the trainer's check finds it stale; it leaves the old group and joins the new one.
    assert rpcs[:4] == ["loaded_weight_version", "loaded_weight_version", "leave_weight_group", "join_weight_group"]
    assert again.weights(1).keys() == final.keys()  # version 1 again, before step 2 sampled
    assert again.paths().index("/v1/completions") > again.paths().index("/resume")
    assert all(torch.equal(again.weights(2)[n], t) for n, t in final.items())
    assert sglang.paths().count("/init_weights_update_group") == 2  # rejoined the new group
    assert "/destroy_weights_update_group" in sglang.paths()


class _DiskActor:
    """The two things a disk weight sync asks of the actor: its layout and an HF export. With
    ``broken`` the export writes nothing, so the server cannot load the directory."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.layout = SimpleNamespace(is_main=True, world_size=1)
        self.broken = False

    def export_hf(self, path: Path) -> None:
        if not self.broken:
            path.mkdir(parents=True, exist_ok=True)


def test_a_failed_weight_update_keeps_the_gate_closed_and_labels_nothing(tmp_path: Path) -> None:
    """WeightSync.sync against an SGLang stand-in that cannot load the weights: RolloutError naming
    the server, the gate closed and failed at the old version, so a generation request fails at
    once instead of sampling weights of unknown version; the next sync that succeeds reopens it."""
    from helpers.rollout import PARAMS, FakeServer

    from treetrain.rl.rollout import SGLangRollout
    from treetrain.trainer.checkpoints import Checkpoints
    from treetrain.trainer.weight_sync import WeightSync

    server = FakeServer("sglang")
    try:
        client = SGLangRollout(endpoints=[server.url], retries=0)
        actor = _DiskActor()
        sync = WeightSync(
            actor=actor,  # type: ignore[arg-type]
            client=client,
            checkpoints=Checkpoints(str(tmp_path), keep=1),
            settings=C.RolloutServers(servers=[C.RolloutServer(url=server.url)], weight_sync={"method": "disk"}),
            log=lambda _: None,
        )
        sync.sync(1)
        assert client.gate.is_open and client.gate.version == 1
        actor.broken = True
        with pytest.raises(RolloutError, match=server.url):
            sync.sync(2)
        assert not client.gate.is_open and client.gate.version == 1
        sent = server.paths().count("/generate")
        with pytest.raises(RolloutError, match="update to version 2 failed"):
            client.generate([[1, 2]], PARAMS, seed=0)
        assert server.paths().count("/generate") == sent  # nothing was sampled
        actor.broken = False
        sync.sync(2)
        (gen,) = client.generate([[1, 2]], PARAMS, seed=0)
        assert gen.versions == [2, 2, 2]
    finally:
        server.close()
