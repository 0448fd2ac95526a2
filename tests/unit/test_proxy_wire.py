"""The proxy's HTTP layer against hostile framing: a body nested 100,000 deep, a request that
carries both Transfer-Encoding and Content-Length (RFC 9112), an HTTP/0.9 request line, and
headers trickled in a byte at a time. Each gets one clear answer (or a closed connection) within
seconds, and the server keeps serving. Scripted Generate only: no model is loaded."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator

import pytest
from proxy_helpers import SMOL, Scripted, new_session, request, serving

from treetrain.engines import builtin
from treetrain.proxy import options, transport
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.server import ProxyServer

USER = [{"role": "user", "content": "hi"}]
DEADLINE_S = 60.0  # far past any deadline the server sets: a hang fails, a busy machine does not


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(builtin.load_tokenizer(SMOL))


@pytest.fixture
def server(renderer: ChatRenderer) -> Iterator[ProxyServer]:
    with serving(Scripted(renderer, ["fine"]), renderer) as s:
        yield s


def _still_serves(server: ProxyServer) -> None:
    _, key = new_session(server)
    status, _, body = request(server.url, "POST", "/v1/chat/completions", {"model": "m", "messages": USER}, key=key)
    assert status == 200 and body["choices"][0]["message"]["content"] == "fine", body


def _connect(server: ProxyServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=DEADLINE_S)


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes (a timeout fails the test: the server held on)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _status_and_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), str(json.loads(body)["error"]["message"])


@pytest.mark.parametrize("depth", [100_000, options.MAX_JSON_DEPTH + 1])
def test_a_deeply_nested_body_is_a_400(server: ProxyServer, depth: int) -> None:
    """100,000 deep overflows Python's JSON reader (RecursionError: a 500 before); a depth just past
    the bound parses, and is refused all the same (it would recurse in the chat template)."""
    _, key = new_session(server)
    deep = b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"
    status, _, body = request(server.url, "POST", "/v1/chat/completions", raw=deep, key=key)
    assert status == 400, body
    assert body["error"]["message"] == (
        f"the body nests deeper than {options.MAX_JSON_DEPTH} levels; send a JSON object of messages and fields"
    )
    assert request(server.url, "POST", "/rl/sessions", raw=b"[" * depth + b"]" * depth)[0] == 400
    assert server.stats.snapshot()["requests"].get("500", 0) == 0
    _still_serves(server)


def test_transfer_encoding_with_content_length_is_refused(server: ProxyServer) -> None:
    """Both framings at once are ambiguous (RFC 9112 section 6.3): 400, and the connection closes
    (what follows cannot be read as a request). Before, Content-Length won and a session opened."""
    for extra in (b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: gzip, chunked\r\n"):
        with _connect(server) as sock:
            sock.sendall(b"POST /rl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n" + extra + b"\r\n{}")
            raw = _read_all(sock)
        status, message = _status_and_error(raw)
        assert status == 400 and b"Connection: close" in raw
        assert message == (
            "the request has both Transfer-Encoding and Content-Length (RFC 9112 forbids it): "
            "send the body with a Content-Length only"
        )
    with _connect(server) as sock:  # two different lengths: which body is it?
        sock.sendall(b"POST /rl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}")
        status, message = _status_and_error(_read_all(sock))
    assert status == 400 and message == "the request has 2 different Content-Length headers: send one"
    assert server.stats.snapshot()["sessions_open"] == 0
    _still_serves(server)


def test_an_http_0_9_request_line_is_answered_at_once(server: ProxyServer) -> None:
    """``GET /`` without a version: the stdlib then waits for headers that never come (a thread
    held for the 300 s keep-alive timeout). Now: a 400 at once, and the connection closes."""
    started = time.monotonic()
    with _connect(server) as sock:
        sock.sendall(b"GET /v1/models\r\n")
        raw = _read_all(sock)
    status, message = _status_and_error(raw)
    assert status == 400 and message == "HTTP/0.9 requests are not served: send an HTTP/1.1 request"
    assert time.monotonic() - started < transport.HEADER_TIMEOUT_S  # no wait for a header deadline
    _still_serves(server)


def test_headers_that_trickle_in_are_cut_off_at_the_deadline(
    server: ProxyServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request line, then a header one byte every 0.2 s: each receive is quick, so the 300 s idle
    timeout never fires, and one header line may hold 64 KiB (slowloris: hours). The request line
    and headers get HEADER_TIMEOUT_S in all: a 408 and the connection closes. A connection idle
    between requests is not on that deadline."""
    monkeypatch.setattr(transport, "HEADER_TIMEOUT_S", 1.0)
    with _connect(server) as idle, _connect(server) as sock:  # idle: opened first, silent throughout
        started = time.monotonic()
        sock.sendall(b"POST /rl/sessions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = False
        while not closed and time.monotonic() - started < DEADLINE_S:
            try:
                sock.sendall(b"z")
            except OSError:  # the server closed its end
                break
            closed = bool(select.select([sock], [], [], 0.2)[0])
        elapsed = time.monotonic() - started
        raw = _read_all(sock)
        assert closed and elapsed < DEADLINE_S / 2, elapsed
        status, message = _status_and_error(raw)
        assert status == 408 and message == "the request line and headers must arrive within 1 s (header deadline)"
        idle.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _read_all(idle).startswith(b"HTTP/1.1 200 ")
    _still_serves(server)
