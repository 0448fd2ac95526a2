"""The proxy against hostile or broken input: malformed bodies, huge bodies, garbage on the wire,
floods of sessions and a model that writes broken tool calls. Every case gets one clear error
(or the raw text) and the server keeps serving. Scripted Generate only: no model is loaded."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI
from proxy_helpers import SMOL, Scripted, new_session, request, samples, serving

from treetrain.engines import builtin
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.server import ProxyServer
from treetrain.proxy.sessions import ENDED_KEPT_FACTOR, ProxyLimits

USER = [{"role": "user", "content": "hi"}]
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(builtin.load_tokenizer(SMOL))


@pytest.fixture
def server(renderer: ChatRenderer) -> Iterator[ProxyServer]:
    with serving(Scripted(renderer, ["fine"]), renderer, limits=ProxyLimits(max_body_bytes=1 << 20)) as s:
        yield s


@pytest.fixture
def key(server: ProxyServer) -> str:
    return new_session(server)[1]


def _still_serves(server: ProxyServer, key: str) -> None:
    status, _, body = request(server.url, "POST", "/v1/chat/completions", {"model": "m", "messages": USER}, key=key)
    assert status == 200 and body["choices"][0]["message"]["content"] == "fine", body


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got a JSON list"),
        (b"", "needs a JSON object body"),
        (b"\xff\xfe", "not valid JSON"),
        (json.dumps({"model": "m"}).encode(), "messages must be a non-empty list"),
        (json.dumps({"messages": "hi"}).encode(), "messages must be a non-empty list"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "role"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
        (json.dumps({"messages": [{"role": "user"}]}).encode(), "content"),
        (json.dumps({"messages": ["hi"]}).encode(), "messages[0]"),
        (json.dumps({"messages": USER, "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"messages": USER, "max_tokens": -1}).encode(), "max_tokens"),
        (json.dumps({"messages": USER, "top_p": 0}).encode(), "top_p"),
        (json.dumps({"messages": USER, "n": True}).encode(), "n must be"),
        (json.dumps({"messages": USER, "stop": [1]}).encode(), "stop"),
        (json.dumps({"messages": USER, "tools": "calculator"}).encode(), "tools"),
        (json.dumps({"messages": USER, "tool_choice": "always"}).encode(), "tool_choice"),
        (json.dumps({"messages": USER, "stream": "yes"}).encode(), "stream"),
    ],
)
def test_malformed_bodies_get_400_with_a_message(server: ProxyServer, key: str, raw: bytes, says: str) -> None:
    status, _, body = request(server.url, "POST", "/v1/chat/completions", raw=raw, key=key)
    assert status == 400, body
    err = body["error"]
    assert (
        says in err["message"]
        and err["type"] == "invalid_request_error"
        and set(err) == {"message", "type", "param", "code"}
    )
    assert "Traceback" not in err["message"]
    _still_serves(server, key)


def test_bad_completion_prompts_and_reward_bodies(server: ProxyServer, key: str) -> None:
    for prompt in (None, "", [], ["a", "b"], [1, -2], [1, 10**9], [1.5], {"text": "x"}):
        status, _, body = request(server.url, "POST", "/v1/completions", {"prompt": prompt}, key=key)
        assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)
    sid = server.service.store.authenticate(key).id
    for reward in ({}, {"reward": None}, {"reward": True}, {"reward": 1.0, "completion_id": 3}):
        assert request(server.url, "POST", f"/rl/sessions/{sid}/reward", reward, key=key)[0] == 400
    assert request(server.url, "POST", "/rl/sessions", {"seed": "x"})[0] == 400
    assert request(server.url, "POST", f"/rl/sessions/{sid}/reward", raw=b"1e999999", key=key)[0] == 400
    _still_serves(server, key)


def test_unknown_routes_and_methods(server: ProxyServer, key: str) -> None:
    status, _, body = request(server.url, "GET", "/v1/engines", key=key)
    assert status == 404 and "no route" in body["error"]["message"]
    assert request(server.url, "GET", "/v1/chat/completions", key=key)[0] == 405
    assert request(server.url, "DELETE", "/rl/sessions")[0] == 405
    status, _, body = request(server.url, "PATCH", "/rl/sessions")
    assert status == 501 and "error" in body
    _still_serves(server, key)


def test_a_10mb_message_gets_413_and_the_server_still_answers(server: ProxyServer, key: str) -> None:
    huge = [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]
    with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="m", messages=huge)
        assert err.value.status_code == 413 and "max_body_bytes" in err.value.message
        assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "fine"
    # Only the headers: the answer comes before (and without) the body.
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Authorization", f"Bearer {key}")
        conn.putheader("Content-Length", str(10 * 1024 * 1024))
        conn.endheaders()
        res = conn.getresponse()
        assert res.status == 413 and res.getheader("Connection") == "close"
        res.read()
    finally:
        conn.close()
    for length in ("-5", "lots"):
        raw = f"POST /rl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()
        assert b" 400 " in _raw_exchange(server, raw).split(b"\r\n", 1)[0]
    assert server.stats.snapshot()["requests"]["413"] == 2
    _still_serves(server, key)


def _raw_exchange(server: ProxyServer, data: bytes) -> bytes:
    """Send bytes, read until the server closes."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_garbage_on_the_wire_gets_a_json_error(server: ProxyServer, key: str) -> None:
    got = _raw_exchange(server, b"\x16\x03\x01 hello I am TLS\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0]
    assert "error" in json.loads(body)
    got = _raw_exchange(server, b"POST /rl/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert b"Content-Length" in got and b" 400 " in got.split(b"\r\n", 1)[0]
    _still_serves(server, key)


@pytest.mark.slow
def test_10000_sessions_stay_bounded(renderer: ChatRenderer) -> None:
    """10,000 sessions created and ended over HTTP: the store keeps 4 x max_sessions ended ones at
    most (the oldest go); then beyond max_sessions open, 429. One keep-alive connection, as a pool
    would use."""
    limits = ProxyLimits(max_sessions=16)
    with serving(Scripted(renderer, ["ok"]), renderer, limits=limits) as server:
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
        try:

            def call(path: str, key: str | None = None) -> tuple[int, Any]:
                headers = {"Content-Length": "2"} | ({"Authorization": f"Bearer {key}"} if key else {})
                conn.request("POST", path, body=b"{}", headers=headers)
                res = conn.getresponse()
                return res.status, json.loads(res.read())

            kept_max = 0
            for _ in range(10_000):
                status, body = call("/rl/sessions")
                assert status == 200, body
                assert call(f"/rl/sessions/{body['id']}/end", body["api_key"])[0] == 200
                kept_max = max(kept_max, len(server.service.store))
            assert kept_max <= limits.max_sessions * (1 + ENDED_KEPT_FACTOR)
            opened = [call("/rl/sessions")[0] for _ in range(limits.max_sessions + 3)]
        finally:
            conn.close()
        assert opened.count(200) <= limits.max_sessions and opened[-3:] == [429] * 3
        assert server.stats.snapshot()["sessions_open"] == limits.max_sessions
        assert len(server.service.store) <= limits.max_sessions * (1 + ENDED_KEPT_FACTOR)


def test_broken_tool_call_json_comes_back_as_text(renderer: ChatRenderer) -> None:
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"\n</tool_call>'
    with serving(Scripted(renderer, [broken, "still here"]), renderer) as server:
        sid, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            resp = client.chat.completions.create(model="m", messages=USER, tools=[CALCULATOR])
            choice = resp.choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason == "stop"
            assert choice.message.content == broken
            again = client.chat.completions.create(model="m", messages=USER, tools=[CALCULATOR])
            assert again.choices[0].message.content == "still here"
        assert len(samples(server, sid, key)) == 2


def test_tool_choice_none_returns_a_call_as_text(renderer: ChatRenderer) -> None:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    with serving(Scripted(renderer, [call]), renderer) as server:
        _, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            none = client.chat.completions.create(model="m", messages=USER, tools=[CALCULATOR], tool_choice="none")
            auto = client.chat.completions.create(model="m", messages=USER, tools=[CALCULATOR])
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == call
    assert auto.choices[0].message.tool_calls is not None and auto.choices[0].finish_reason == "tool_calls"
