"""The operator's readiness (handlers.Readiness, kube_login.cannot_list_rljobs): ready only once
RLJobs were listed with the login kopf watches with. A small local HTTPS server stands in for the
API server (a real one runs in tests/cluster; the operator pod's probe in test_real_node_e2e)."""

from __future__ import annotations

import http.server
import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import kopf
import pytest

from rljob_operator.handlers import Readiness
from rljob_operator.kube_login import Credentials, cannot_list_rljobs
from rljob_operator.models import GROUP, VERSION


class _Api(http.server.BaseHTTPRequestHandler):
    status = 200
    items: ClassVar[str] = "[]"  # JSON text: a test may store what json cannot nest
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        listed = f'{{"apiVersion": "{GROUP}/{VERSION}", "items": {self.items}, "kind": "RLJobList"}}'
        body = (listed if self.status == 200 else json.dumps({"kind": "Status"})).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _cert(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return crt, key


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """An HTTPS server on 127.0.0.1 whose certificate names `localhost`, and a CA file for it."""
    crt, key = _cert(tmp_path, "localhost")
    _Api.status, _Api.items, _Api.seen = 200, "[]", []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://localhost:{server.server_address[1]}", crt, tmp_path
    finally:
        server.shutdown()
        server.server_close()


def creds(server: str, ca: Path | None, token: str | None = "t0k") -> Credentials:
    return Credentials(server=server, ca_path=str(ca) if ca else None, insecure=False, token=token,
                       certificate_path=None, private_key_path=None)  # fmt: skip


def test_lists_rljobs_in_each_watched_namespace_with_the_token(api: tuple[str, Path, Path]) -> None:
    server, ca, _ = api
    assert cannot_list_rljobs(creds(server, ca), ["a", "b"]) is None
    base = f"/apis/{GROUP}/{VERSION}"
    assert _Api.seen == [(f"{base}/namespaces/a/rljobs?limit=1", "Bearer t0k"),
                         (f"{base}/namespaces/b/rljobs?limit=1", "Bearer t0k")]  # fmt: skip
    assert cannot_list_rljobs(creds(server, ca), []) is None
    assert _Api.seen[-1][0] == f"{base}/rljobs?limit=1"


def test_what_is_not_ready_says_why(api: tuple[str, Path, Path]) -> None:
    server, ca, d = api
    _Api.status = 403
    assert (
        cannot_list_rljobs(creds(server, ca), ["a"])
        == f"GET {server}/apis/{GROUP}/{VERSION}/namespaces/a/rljobs: HTTP 403 Forbidden"
    )
    _Api.status = 200
    # The certificate names localhost, not 127.0.0.1 (the operator pod's first failure, for real).
    why = cannot_list_rljobs(creds(server.replace("localhost", "127.0.0.1"), ca), ["a"])
    assert why is not None and "certificate" in why.lower() and "127.0.0.1" in why, why
    other_ca, _ = _cert(d, "elsewhere")
    why = cannot_list_rljobs(creds(server, other_ca), ["a"])
    assert why is not None and "certificate verify failed" in why, why
    why = cannot_list_rljobs(creds("https://127.0.0.1:1", ca), [])
    assert why is not None and "refused" in why.lower(), why


def test_readiness_fails_the_probe_until_listed_then_holds(api: tuple[str, Path, Path]) -> None:
    server, ca, _ = api
    ready = Readiness(["a"])
    with pytest.raises(kopf.PermanentError, match="not ready: not logged in"):
        ready.check()
    ready.login = creds(server, ca)
    _Api.status = 403
    with pytest.raises(kopf.PermanentError, match="HTTP 403"):
        ready.check()
    _Api.status = 200
    ready.check()
    assert ready.ready
    calls = len(_Api.seen)
    _Api.status = 500  # an outage later is kopf's to retry: ready stays, no more lists
    ready.check()
    assert len(_Api.seen) == calls


def test_an_rljob_nested_deeper_than_json_recurses_is_still_listed(api: tuple[str, Path, Path]) -> None:
    # The API server stores such an object (the operator refuses it with Valid=False); the
    # readiness check must not parse it, or the operator never becomes ready while it exists.
    server, ca, _ = api
    _Api.items = '[{"spec": ' + "[" * 5000 + "]" * 5000 + "}]"
    assert cannot_list_rljobs(creds(server, ca), ["a"]) is None
