"""The trainer's weight sync with ``actor.lora`` (treetrain.trainer.weight_sync): the adapter alone
as a PEFT directory under ``checkpoint.dir/adapters`` that every server loads under a versioned
name, the window of versions kept on the servers and on disk, the figures it records, the merged
fallback through the full-weight path, and the one-line refusals.

A real FSDP engine of builtin:tiny-llama with a LoRA adapter; the servers are the stand-ins of
tests/unit/helpers/rollout.py (NOT vLLM or SGLang: the real vLLM server loads the adapters in
tests/vllm/test_lora_vllm.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.rollout import FakeServer
from safetensors import safe_open

from treetrain import config as C
from treetrain.config import check_training_backend
from treetrain.engines.errors import EngineConfigError
from treetrain.engines.factory import build_engine
from treetrain.rl.rollout import RolloutError, remote_client
from treetrain.trainer.checkpoints import Checkpoints
from treetrain.trainer.weight_sync import WeightSync


def engine(sync: str = "adapter") -> Any:
    cfg = C.validate(
        {
            "model": {"path": "builtin:tiny-llama", "seed": 1},
            "actor": {"backend": "fsdp:d1", "lora": {"rank": 4, "sync": sync}},
        }
    )
    actor = build_engine(
        cfg.model,
        check_training_backend("fsdp:d1"),
        role="actor",
        tree=cfg.actor.tree_training,
        optimizer=cfg.trainer.optimizer,
        lora=cfg.actor.lora,
    )
    return actor, cfg


@pytest.fixture(scope="module")
def actor() -> Any:
    return engine()


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer("vllm")
    fake.max_loras = 3  # maxStaleness 1 + 2
    yield fake
    fake.close()


def weight_sync(actor: Any, server: FakeServer, root: Path | None, *, method: str = "disk") -> WeightSync:
    model, cfg = actor
    client = remote_client([(server.url, "vllm")], retries=0)
    settings = C.RolloutServers(
        servers=[C.RolloutServer(url=server.url, kind="vllm")], weight_sync=C.WeightSyncSettings(method=method)
    )
    checkpoints = Checkpoints(str(root) if root is not None else None, keep=2)
    return WeightSync(
        actor=model,
        client=client,
        checkpoints=checkpoints,
        settings=settings,
        log=print,
        lora=cfg.actor.lora,
        max_staleness=1,
    )


def test_each_sync_sends_the_adapter_alone_and_keeps_the_window(actor: Any, server: FakeServer, tmp_path: Path) -> None:
    sync = weight_sync(actor, server, tmp_path, method="distributed")  # adapters go by disk whatever the method
    assert sync.payload == "adapter" and sync.slots is not None and sync.slots.keep == 3
    for version in range(1, 5):
        sync.sync(version)
        window = [version - k for k in range(3) if version - k >= 1]
        assert sorted(server.adapters) == sorted(f"actor-v{v}" for v in window)
        path = Path(server.adapters[f"actor-v{version}"])
        assert path == tmp_path / "adapters" / f"v{version:08d}"
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["peft_type"] == "LORA"
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert all(".lora_A." in k or ".lora_B." in k for k in f.keys())  # noqa: SIM118 - safe_open has no __iter__
        # On disk too: the window's directories (a server may read one again), nothing older.
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [f"v{v:08d}" for v in sorted(window)]
        rec = sync.last
        assert rec is not None and (rec.payload, rec.version, rec.adapter_version) == ("adapter", version, version)
        assert rec.bytes == sum(f.stat().st_size for f in path.iterdir()) and rec.seconds > 0
    assert server.most_adapters == 3 and sync.version == 4
    assert sync.client is not None and sync.client.stale_servers(4) == []
    server.adapters.clear()  # a restart: the base model alone; the trainer sends the adapter again
    sync.resend_if_restarted()
    assert list(server.adapters) == ["actor-v4"]


def test_a_refused_load_fails_the_sync_in_one_line(actor: Any, server: FakeServer, tmp_path: Path) -> None:
    sync = weight_sync(actor, server, tmp_path)
    server.refuse_loads = True
    with pytest.raises(RolloutError) as err:
        sync.sync(1)
    assert "\n" not in str(err.value) and server.url in str(err.value), err.value
    assert sync.version == 0 and not sync.gate.is_open  # nothing samples as if the server had version 1


def test_adapter_sync_needs_a_checkpoint_dir(actor: Any, server: FakeServer) -> None:
    with pytest.raises(EngineConfigError, match=r"needs checkpoint\.dir .*actor\.lora\.sync: merged"):
        weight_sync(actor, server, None)


def test_merged_goes_through_the_full_weight_path(server: FakeServer, tmp_path: Path) -> None:
    """``sync: merged``: full Hugging Face weights (W + scale B A, the engine merges them) through
    the disk reload, no adapter anywhere; the figures say full."""
    merged = engine("merged")
    sync = weight_sync(merged, server, tmp_path)
    assert sync.payload == "full" and sync.slots is None
    sync.sync(1)
    loads = [b for m, p, b in server.calls if p == "/collective_rpc" and b["method"] == "load_weights_from_disk"]
    assert [b["kwargs"]["version"] for b in loads] == [1] and not server.adapters
    assert not any("lora" in p for _, p, _ in server.calls)
    rec = sync.last
    assert rec is not None and rec.payload == "full" and rec.adapter_version is None
    weights = Path(loads[0]["kwargs"]["weights_path"])
    assert rec.bytes == sum(f.stat().st_size for f in weights.iterdir() if f.is_file())
    with safe_open(str(next(weights.glob("*.safetensors"))), "pt") as f:
        assert not any("lora" in k for k in f.keys())  # noqa: SIM118
