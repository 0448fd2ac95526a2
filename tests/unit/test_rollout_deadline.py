"""``trainer.rollout.timeoutSeconds`` bounds a whole request: a server that answers one byte a
second is cut off at the deadline and the generation fails over to the next server, with one
line (it used to hold a step for 155 s with a 10 s timeout: the timeout bounded each read)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout_standin import RolloutStandin

from treetrain.rl.rollout import SamplingParams, SGLangRollout, http_json
from treetrain.rl.rollout.http import DeadlineExceeded


class _Trickle(BaseHTTPRequestHandler):
    """Answers 200 with a body that arrives one byte a second, for ever (until the client goes)."""

    def do_POST(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            while not self.server.closing:  # type: ignore[attr-defined]
                self.wfile.write(b" ")
                self.wfile.flush()
                self.server.sent.set()  # type: ignore[attr-defined]
                time.sleep(1.0)  # the slow server's pace, not a wait of the test
        except OSError:
            return

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def trickle() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    server.closing = False  # type: ignore[attr-defined]
    server.sent = threading.Event()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.closing = True  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()


def test_a_trickling_answer_is_cut_at_the_deadline(trickle: str) -> None:
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no complete answer within 2s"):
        http_json("POST", trickle + "/generate", {"x": 1}, 2.0)
    took = time.monotonic() - began
    assert 2.0 <= took < 30, took  # the deadline, not the 100,000 s the body would take


def test_a_generation_fails_over_from_a_trickling_server(trickle: str, capfd: pytest.CaptureFixture[str]) -> None:
    with RolloutStandin(token_delay_s=0.001, vocab=64, first_token=4) as standin:
        client = SGLangRollout(endpoints=[trickle, standin.url], timeout_s=2.0, retries=3)
        began = time.monotonic()
        gens = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5), seed=0)  # prompt 0 -> the trickle first
        took = time.monotonic() - began
    assert len(gens[0].tokens) == 5 and client.resubmitted == 1
    assert took < 30, took  # one deadline, not (retries + 1) of them
    (line,) = [li for li in capfd.readouterr().err.splitlines() if li.startswith("rollout: ")]
    assert trickle in line and "no complete answer within 2s" in line and "timeoutSeconds" in line
