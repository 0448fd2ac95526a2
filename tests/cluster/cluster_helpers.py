"""Small helpers shared by the cluster tests (polling, loopback ports and HTTP)."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 60.0) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """GET a loopback URL: (status, body), or (0, "") when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # loopback only
            return response.status, response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""
