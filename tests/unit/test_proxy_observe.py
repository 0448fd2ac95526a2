"""What the proxy tells its operator: ``GET /metrics`` (treetrain.proxy.exposition) and one log line
per request, in-process; and a burst of concurrent agent connections that all get answered (the
listen backlog). Scripted Generate: no model is loaded."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from proxy_helpers import SMOL, Scripted, new_session, request, serving

from treetrain import metrics as M
from treetrain.engines import builtin
from treetrain.proxy.chat import ChatRenderer
from treetrain.proxy.server import SESSION_PREFIX
from treetrain.proxy.sessions import ProxyLimits
from treetrain.proxy.stats import ROUTES
from treetrain.proxy.transport import ProxyHTTPServer

USER = [{"role": "user", "content": "hi"}]
DEADLINE_S = 120.0
BURST = 200


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(builtin.load_tokenizer(SMOL))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, text = request(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_and_one_log_line_per_request(renderer: ChatRenderer) -> None:
    lines: list[str] = []
    with serving(Scripted(renderer, ["hello there"]), renderer, request_log=lines.append) as server:
        before = scrape(server.url)
        sid, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            resp = client.chat.completions.create(model="m", messages=USER, n=2)
        assert request(server.url, "POST", "/v1/chat/completions", {"messages": USER})[0] == 401
        after = scrape(server.url)
    # Every family from the first scrape on; the counters count what was answered.
    assert before[("treetrain_proxy_sessions_open", ())] == 0
    assert {("treetrain_proxy_fresh_renders_total", (("reason", r),)) for r in M.FRESH_REASONS} <= set(before)
    assert after[("treetrain_proxy_requests_total", (("code", "200"),))] == 3  # the first scrape, session, chat
    assert after[("treetrain_proxy_requests_total", (("code", "401"),))] == 1
    assert after[("treetrain_proxy_sessions_open", ())] == 1
    assert resp.usage is not None
    assert after[("treetrain_proxy_completion_tokens_total", ())] == resp.usage.completion_tokens
    assert after[("treetrain_proxy_prompt_tokens_total", ())] == 2 * resp.usage.prompt_tokens  # each choice's
    count = M.PROXY_REQUEST_DURATION_SECONDS + "_count"
    assert after[(count, (("route", "chat_completions"),))] == 2
    assert after[(count, (("route", "sessions"),))] == 1 and after[(count, (("route", "metrics"),))] == 1
    assert {r for (name, labels) in after if name == count for _, r in labels} == set(ROUTES)
    # One line per request, the scrapes included: method, path, status, session, tokens, seconds.
    assert len(lines) == 5, lines
    assert lines[0].startswith("treetrain proxy: GET /metrics 200 session=- prompt_tokens=0 completion_tokens=0")
    assert lines[1].startswith(f"treetrain proxy: POST /rl/sessions 200 session={sid[:SESSION_PREFIX]} ")
    chat = (
        f"treetrain proxy: POST /v1/chat/completions 200 session={sid[:SESSION_PREFIX]} "
        f"prompt_tokens={resp.usage.prompt_tokens} completion_tokens={resp.usage.completion_tokens} seconds="
    )
    assert lines[2].startswith(chat) and float(lines[2].rsplit("=", 1)[1]) >= 0
    assert "POST /v1/chat/completions 401 session=- " in lines[3]


def test_a_burst_of_concurrent_completions_is_answered_without_resets(renderer: ChatRenderer) -> None:
    """ACCEPTANCE: BURST runs connect at the same moment, each on its own connection
    (groupsPerStep x groupSize agents starting a step): every one is answered, none is reset or
    refused at connect, and ``GET /v1/models`` answers throughout the burst. The listen backlog
    covers every session that may connect at once (maxSessions, which the trainer's check holds
    above the runs in flight)."""
    assert ProxyHTTPServer.request_queue_size >= 1024
    limits = ProxyLimits(max_sessions=2048, max_sessions_per_client=BURST + 1)
    with serving(Scripted(renderer, ["ok"]), renderer, limits=limits) as server:
        assert server._httpd is not None and server._httpd.request_queue_size == limits.max_sessions
        keys = [new_session(server)[1] for _ in range(BURST)]
        watcher = new_session(server)[1]
        start = threading.Barrier(BURST + 1)
        results: list[Any] = []
        models: list[Any] = []
        lock = threading.Lock()
        burst_over = threading.Event()

        def one(key: str) -> None:
            start.wait(DEADLINE_S)
            try:
                status = request(server.url, "POST", "/v1/chat/completions", {"messages": USER}, key=key)[0]
            except OSError as err:  # a reset or refused connection
                status = repr(err)
            with lock:
                results.append(status)
                if len(results) == BURST:
                    burst_over.set()

        def watch() -> None:
            """GET /v1/models in a loop from the burst's start to its end (and once more)."""
            start.wait(DEADLINE_S)
            while True:
                over = burst_over.is_set()
                try:
                    status = request(server.url, "GET", "/v1/models", key=watcher)[0]
                except OSError as err:
                    status = repr(err)
                models.append(status)
                if over and len(models) >= 2:
                    return

        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in keys]
        threads.append(threading.Thread(target=watch, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        served = server.stats.snapshot()["requests"]
    assert results == [200] * BURST, sorted(set(map(str, results)))
    assert len(models) >= 2 and models == [200] * len(models), models
    assert served["200"] == 2 * BURST + 1 + len(models)
