"""The proxy's own ``GET /metrics``: its counters in the Prometheus text format, read at scrape time.

``treetrain proxy`` has no trainer (whose registry exports the first three families on port 9400),
so the endpoint serves them itself, with the token counts and request durations besides.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from treetrain.metrics import (
    PROXY_COMPLETION_TOKENS_TOTAL,
    PROXY_FRESH_RENDERS_TOTAL,
    PROXY_PROMPT_TOKENS_TOTAL,
    PROXY_REQUEST_DURATION_SECONDS,
    PROXY_REQUESTS_TOTAL,
    PROXY_SESSIONS_OPEN,
)
from treetrain.proxy.stats import DURATION_BUCKETS, ProxyStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatsCollector(Collector):
    def __init__(self, stats: ProxyStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        snap = self.stats.snapshot()
        requests = CounterMetricFamily(
            PROXY_REQUESTS_TOTAL.removesuffix("_total"),
            "Requests the proxy answered, by HTTP status code.",
            labels=["code"],
        )
        for code, n in sorted(snap["requests"].items()):
            requests.add_metric([code], n)
        yield requests
        yield GaugeMetricFamily(PROXY_SESSIONS_OPEN, "Proxy sessions open now.", value=snap["sessions_open"])
        fresh = CounterMetricFamily(
            PROXY_FRESH_RENDERS_TOTAL.removesuffix("_total"),
            "Chat requests rendered afresh instead of extending an earlier completion's tokens, by reason.",
            labels=["reason"],
        )
        for reason, n in snap["fresh_renders"].items():
            fresh.add_metric([reason], n)
        yield fresh
        yield CounterMetricFamily(
            PROXY_PROMPT_TOKENS_TOTAL.removesuffix("_total"),
            "Prompt tokens of the completions sampled (each choice counts its prompt).",
            value=snap["prompt_tokens"],
        )
        yield CounterMetricFamily(
            PROXY_COMPLETION_TOKENS_TOTAL.removesuffix("_total"),
            "Tokens the model sampled (what the trainer trains).",
            value=snap["completion_tokens"],
        )
        durations = HistogramMetricFamily(
            PROXY_REQUEST_DURATION_SECONDS,
            "Seconds from a request's headers to its answer, by route.",
            labels=["route"],
        )
        bounds = [*(f"{b:g}" for b in DURATION_BUCKETS), "+Inf"]
        for route, hist in snap["durations"].items():
            durations.add_metric([route], list(zip(bounds, hist["buckets"], strict=True)), hist["sum"])
        yield durations


def prometheus_text(stats: ProxyStats) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    return generate_latest(registry)
