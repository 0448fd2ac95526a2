"""The request handler the loopback stand-in servers share (bench/rollout_standin.py and the
fake servers of tests/unit): quiet, JSON bodies in and out."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass  # a stand-in's request log is noise in test and bench output

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        """The request's JSON body (None when empty); ValueError when it is not JSON."""
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None
