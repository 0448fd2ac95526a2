"""LoRA adapter sync on the rollout side (treetrain.rl.rollout.adapters): versioned names, the
unload-before-load plan, the check that a server lists the new version, requests that name the
adapter of their version, and restarts noticed from the adapter listing.

The servers here are the stand-ins of tests/unit/helpers/rollout.py (NOT SGLang or vLLM; SGLang
has no CPU build). The real vLLM server serves LoRA in tests/vllm/test_lora_vllm.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.rollout import PARAMS, FakeServer

from treetrain.rl.rollout import AdapterSlots, RolloutError, remote_client, use_adapter
from treetrain.rl.rollout.adapters import plan_unloads, served_version


def test_names_window_and_plan() -> None:
    slots = AdapterSlots("actor", keep=3)
    assert slots.name_of(4) == "actor-v4" and slots.version_of("actor-v4") == 4
    assert slots.version_of("actor-v") is None and slots.version_of("other-v4") is None
    assert slots.version_of("actor-x-v4") is None
    assert slots.model_for(0) is None and slots.model_for(2) == "actor-v2"
    assert slots.window(1) == [1] and slots.window(5) == [3, 4, 5]
    # Unload before load: outside the new window, oldest first, and the new version if present.
    assert plan_unloads([1, 2, 3], 4, slots) == [1]
    assert plan_unloads([1, 2, 3, 4], 4, slots) == [1, 4]
    assert plan_unloads([], 1, slots) == []
    assert served_version([]) == 0 and served_version([2, 3]) == 3
    with pytest.raises(RolloutError, match="adapter name"):
        AdapterSlots("a b", keep=1)


@pytest.fixture(params=["vllm", "sglang"])
def server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    fake = FakeServer(request.param)
    fake.max_loras = 3
    yield fake
    fake.close()


def test_syncs_keep_the_window_and_never_exceed_the_slots(server: FakeServer) -> None:
    """Five syncs with keep 3: after each the server lists exactly the window, it never held more
    than 3 (it refuses a fourth), and a request at version k names adapter k (vLLM ``model``,
    SGLang ``lora_path``); version 0 names none."""
    slots = AdapterSlots("actor", keep=3)
    client = remote_client([(server.url, server.kind)], retries=0)
    use_adapter(client, slots)
    client.generate([[1, 2]], PARAMS, seed=0)
    for version in range(1, 6):
        with client.gate.update(version):
            client.update_adapter(f"/ckpt/adapters/v{version}", version)
        assert sorted(server.adapters) == sorted(slots.name_of(v) for v in slots.window(version))
        assert server.adapters[slots.name_of(version)] == f"/ckpt/adapters/v{version}"
        client.generate([[1, 2]], PARAMS, seed=0)
    assert server.most_adapters == 3
    route = "/v1/completions" if server.kind == "vllm" else "/generate"
    named = [b.get("model" if server.kind == "vllm" else "lora_path") for m, p, b in server.calls if p == route]
    assert named == [None, "actor-v1", "actor-v2", "actor-v3", "actor-v4", "actor-v5"]
    assert client.stale_servers(5) == []


def test_a_load_the_server_does_not_list_fails_the_sync(server: FakeServer) -> None:
    """A server that answers success but does not list the adapter (the silent no-op sync) fails
    the sync with one line naming it, and the gate stays failed: no request samples on."""
    client = remote_client([(server.url, server.kind)], retries=0)
    use_adapter(client, AdapterSlots("actor", keep=2))
    server.silent_loads = True
    with pytest.raises(RolloutError) as err, client.gate.update(1):
        client.update_adapter("/ckpt/adapters/v1", 1)
    msg = str(err.value)
    assert "\n" not in msg and server.url in msg and "does not list it" in msg, msg
    with pytest.raises(RolloutError, match="weights are unknown"):
        client.generate([[1, 2]], PARAMS, seed=0)


def test_a_refused_load_fails_the_sync(server: FakeServer) -> None:
    client = remote_client([(server.url, server.kind)], retries=0)
    use_adapter(client, AdapterSlots("actor", keep=2))
    server.refuse_loads = True
    with pytest.raises(RolloutError) as err:
        client.update_adapter("/ckpt/adapters/v1", 1)
    assert "rank too large" in str(err.value) and "\n" not in str(err.value)


def test_a_restarted_server_is_stale_and_gets_the_adapter_again(server: FakeServer) -> None:
    slots = AdapterSlots("actor", keep=2)
    client = remote_client([(server.url, server.kind)], retries=0)
    use_adapter(client, slots)
    for version in (1, 2):
        client.update_adapter(f"/a/v{version}", version)
    assert client.stale_servers(2) == []
    server.adapters.clear()  # a restart: the base model alone
    assert client.stale_servers(2) == [server.url]
    client.update_adapter("/a/v2", 2)
    assert sorted(server.adapters) == ["actor-v2"] and client.stale_servers(2) == []


def test_mixed_servers_each_load_the_adapter() -> None:
    a, b = FakeServer("vllm"), FakeServer("sglang")
    try:
        a.max_loras = b.max_loras = 2
        client = remote_client([(a.url, "vllm"), (b.url, "sglang")], retries=0)
        use_adapter(client, AdapterSlots("actor", keep=2))
        client.update_adapter("/a/v1", 1)
        assert list(a.adapters) == list(b.adapters) == ["actor-v1"]
    finally:
        a.close()
        b.close()
