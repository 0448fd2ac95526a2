"""HTTP for the proxy: the threaded stdlib server, bodies in and out, OpenAI error objects.

Each connection is answered in its own daemon thread (HTTP/1.1 keep-alive, so the openai SDK's
connection pool works). Every answered request is reported once to the proxy's ``observe`` (the
counters, the request log line) with its wall time.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from treetrain.proxy.options import BadRequest
from treetrain.proxy.sessions import ProxyLimits, Refused

# A refused body (too large) is discarded, not kept, up to this much (then the connection closes).
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 5.0
# A request's line and headers must arrive within this long of its first byte: a client that
# trickles them (or sends an HTTP/0.9 line and no headers) would otherwise hold a thread for
# the idle timeout, and reset it with every byte.
HEADER_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0  # an idle keep-alive connection (or a stalled upload) frees its thread
# Pending connections the kernel queues before accept(): the stdlib's 5 resets connections when
# groupsPerStep x groupSize agent runs connect at once, so at least max_sessions (every run may
# connect at once). The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 1024
SOMAXCONN = "/proc/sys/net/core/somaxconn"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Errors a retry cannot fix: the openai SDK retries 409 (and 429, 5xx) unless told not to.
_NO_RETRY = {400, 401, 404, 409, 413}


class Response:
    """A status, a JSON body (dict), SSE text (str) or Prometheus text (bytes), extra headers, and
    what the request log line reports (the session, the tokens)."""

    def __init__(self, status: int, body: dict[str, Any] | str | bytes, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or {}
        self.content_type = "text/event-stream" if isinstance(body, str) else "application/json"
        self.session_id: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0


def error(err: Refused) -> Response:
    body = {
        "error": {
            "message": err.message,
            "type": _ERROR_TYPES.get(err.status, "invalid_request_error"),
            "param": getattr(err, "param", None),
            "code": err.status,
        }
    }
    headers = {}
    if err.retry_after_s is not None:
        wait = max(0.0, float(err.retry_after_s))
        headers = {"Retry-After": str(math.ceil(wait)), "retry-after-ms": str(int(wait * 1000))}
    if err.status in _NO_RETRY:
        headers["x-should-retry"] = "false"
    return Response(err.status, body, headers)


class Routes(Protocol):
    """What the transport needs of the proxy."""

    limits: ProxyLimits

    def handle(self, method: str, path: str, headers: Any, body: bytes | None, client: str | None) -> Response: ...

    def observe(self, method: str, path: str, res: Response, seconds: float) -> None: ...

    def log(self, line: str) -> None: ...


class ProxyHTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], proxy: Routes, backlog: int) -> None:
        self.request_queue_size = max(LISTEN_BACKLOG, backlog)  # read by listen() in server_activate
        self.log = proxy.log
        super().__init__(address, handler_for(proxy))

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed outside a request: one line, not the stdlib's traceback, and
        none for a client that went away (a reset mid-read)."""
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            self.log(f"treetrain proxy: error on a connection from {client_address[0]}: {type(err).__name__}: {err}")


def kernel_backlog() -> int | None:
    """net.core.somaxconn: the kernel's cap on any listen backlog (None: not readable here)."""
    try:
        with open(SOMAXCONN, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class _DeadlineReader(io.RawIOBase):
    """The connection's bytes for ``rfile``. While ``deadline`` (monotonic) is set, each receive
    waits only for the time left to it: the socket timeout alone restarts with every byte."""

    def __init__(self, sock: socket.socket, idle_timeout_s: float) -> None:
        self.sock = sock
        self.idle_timeout_s = idle_timeout_s
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("header deadline")
            self.sock.settimeout(left)
        return self.sock.recv_into(buffer)

    def arm(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline = None
            self.sock.settimeout(self.idle_timeout_s)


def handler_for(proxy: Routes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai SDK's httpx pool reuses connections
        server_version = "treetrain-proxy"
        timeout = IDLE_TIMEOUT_S
        # Headers and body go out in two writes: with Nagle's algorithm the second waits for the
        # client's delayed ACK (40 ms a response on Linux).
        disable_nagle_algorithm = True
        started = 0.0
        method = ""
        raw_requestline: bytes
        _reader: _DeadlineReader
        _buffered: io.BufferedReader

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the stdlib's reader, unused: this one reads with a deadline
            self._reader = _DeadlineReader(self.connection, IDLE_TIMEOUT_S)
            self.rfile = self._buffered = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            """Wait for a request's first byte as long as a connection may idle, then give its
            line and headers HEADER_TIMEOUT_S in all."""
            self._reader.disarm()
            try:
                if not self._buffered.peek(1):
                    self.close_connection = True  # the client closed the connection
                    return
            except OSError:  # idle past the timeout, or reset: nothing to answer
                self.close_connection = True
                return
            self._reader.arm(HEADER_TIMEOUT_S)
            try:
                super().handle_one_request()
            finally:
                self._reader.disarm()

        def parse_request(self) -> bool:
            if len(self.raw_requestline.split()) == 2:  # no version: HTTP/0.9, whose headers never come
                self.command, self.request_version = "", "HTTP/0.9"
                self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
                self.send_error(400, "HTTP/0.9 requests are not served: send an HTTP/1.1 request")
                return False
            try:
                parsed = bool(super().parse_request())
            except TimeoutError:
                self._reader.disarm()
                self.send_error(
                    408, f"the request line and headers must arrive within {HEADER_TIMEOUT_S:g} s (header deadline)"
                )
                return False
            self._reader.disarm()  # the body and the answer are on the idle timeout
            return parsed

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            self.started, self.method = time.monotonic(), method
            try:
                body = self._body(method)
                if isinstance(body, Response):
                    self.close_connection = True  # the unread body must not be parsed as a request
                    self._send(body)
                    self._drain()
                    return
                self._send(proxy.handle(method, self.path, self.headers, body, str(self.client_address[0])))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                self.close_connection = True  # the client went away: nobody to answer
            except Exception as err:  # one line for a server error, and the server serves on
                proxy.log(f"treetrain proxy: error serving {method} {self.path}: {type(err).__name__}: {err}")
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self._send(error(Refused(500, f"internal error: {type(err).__name__}: {err}")))

        def _body(self, method: str) -> bytes | Response | None:
            """The body as Content-Length frames it (a GET's is read and dropped), or the refusal:
            framing that is ambiguous (RFC 9112) or not read here is a 400, and closes."""
            lengths = set(self.headers.get_all("Content-Length") or [])
            if len(lengths) > 1:
                return error(BadRequest(f"the request has {len(lengths)} different Content-Length headers: send one"))
            length = next(iter(lengths), None)
            if self.headers.get("Transfer-Encoding"):
                if length is not None:
                    return error(
                        BadRequest(
                            "the request has both Transfer-Encoding and Content-Length (RFC 9112 forbids it): "
                            "send the body with a Content-Length only"
                        )
                    )
                return error(BadRequest("send the body with a Content-Length (chunked bodies are not read)"))
            if length is None:
                return None
            try:
                n = int(length)
                if n < 0:
                    raise ValueError
            except ValueError:
                return error(BadRequest(f"invalid Content-Length {length!r}"))
            if n > proxy.limits.max_body_bytes:
                return error(
                    Refused(413, f"the body has {n} bytes, the limit is {proxy.limits.max_body_bytes} (max_body_bytes)")
                )
            body = self.rfile.read(n)
            return None if method == "GET" else body

        def _drain(self) -> None:
            """Discard what the client still sends (bounded) before closing: closing with unread data
            resets the connection, and the client, still sending its body, would never read the answer."""
            with contextlib.suppress(OSError, ValueError):
                left = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT_BYTES)
                self.connection.settimeout(DRAIN_TIMEOUT_S)
                while left > 0 and (chunk := self.rfile.read1(min(left, 1 << 16))):
                    left -= len(chunk)

        def _send(self, res: Response) -> None:
            body = res.body
            data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
            self.send_response(res.status)
            self.send_header("Content-Type", res.content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in res.headers.items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            # Counted before the body goes out: a client that has its answer sees it counted.
            started = self.started or time.monotonic()
            path = str(getattr(self, "path", None) or "-").split("?", 1)[0]
            method = self.method or str(getattr(self, "command", None) or "-")
            proxy.observe(method, path, res, time.monotonic() - started)
            self.wfile.write(data)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """The stdlib's errors (a malformed request line, an unknown method) in OpenAI's shape."""
            self.close_connection = True
            if self.request_version == "HTTP/0.9":  # an unparsable request line: answer with headers all the same
                self.request_version = "HTTP/1.0"
            self.started, self.method = time.monotonic(), ""
            with contextlib.suppress(OSError):
                self._send(error(Refused(code, message or explain or f"HTTP {code}")))

        def log_message(self, format: str, *args: Any) -> None:
            """The stdlib's line per request is off: the proxy's ``observe`` writes its own."""

    return Handler
