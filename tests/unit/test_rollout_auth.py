"""The trainer's rollout client sends the RLJob's API key: every request of ``http_json`` (generation,
health, weight sync: all go through it) carries ``Authorization: Bearer $TREETRAIN_ROLLOUT_API_KEY``.
Checked against a loopback HTTP server that refuses requests without the key, as SGLang does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from treetrain.rl.rollout import API_KEY_ENV, SGLangRollout, auth_headers, http_json

KEY = "k3y-Of-the-rljob"


class _Guarded(BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def _answer(self) -> None:
        auth = self.headers.get("Authorization")
        self.seen.append(auth)
        ok = self.path.startswith("/health") or auth == f"Bearer {KEY}"
        body = json.dumps({"ok": True} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Guarded)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=30)


def test_auth_headers_from_the_environment() -> None:
    assert auth_headers({API_KEY_ENV: KEY}) == {"Authorization": f"Bearer {KEY}"}
    assert auth_headers({}) == {} and auth_headers({API_KEY_ENV: " "}) == {}


def test_requests_carry_the_key_and_are_refused_without_it(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert http_json("GET", server + "/model_info", None, 30.0)[0] == 401
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert http_json("POST", server + "/update_weights_from_disk", {"model_path": "/x"}, 30.0) == (200, {"ok": True})
    # The clients the trainer and the weight sync use send it too.
    client = SGLangRollout(endpoints=[server], retries=0)
    assert client.call(server, "POST", "/init_weights_update_group", {}) == {"ok": True}
    assert _Guarded.seen[-1] == f"Bearer {KEY}"
