"""Prometheus metrics for one app, in its own ``CollectorRegistry``.

Latencies the HTTP layer sees (time to first token, inter-token latency,
request duration) are histograms observed here. Everything the engine already
counts (requests admitted/finished/aborted, tokens, queue depth, the cache
tiers, speculation) is read from ``engine.stats()`` at scrape time, so the
numbers cannot drift from ``/stats`` and a new section of the stats (a cache
tier, the drafter) shows up without touching this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import Usage
from transport.ui_stats import RecentRequests

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The Scheduler's cumulative counters (engine.stats()["scheduler"]).
SCHEDULER_COUNTERS = {
    "admitted": "requests admitted to the scheduler",
    "finished": "requests that finished (stop or length)",
    "aborted": "requests aborted (client went away)",
    "failed": "requests that failed inside the engine",
    "prompt_tokens": "prompt tokens admitted",
    "generated_tokens": "tokens generated",
    "cached_tokens": "prompt tokens served from the prompt cache",
    "ssd_cached_tokens": "prompt tokens served from the prompt cache's SSD tier",
    "prefilled_tokens": "prompt tokens run through prefill",
    "steps": "GPU steps run",
}
SCHEDULER_GAUGES = {
    "queued": "requests waiting for a batch slot (queue depth)",
    "active_rows": "rows in the running batch",
    "max_batch": "batch size limit",
}
CORE_SECTIONS = {"model", "ready", "dead", "scheduler", "gateway"}

# TTFT spans a queue wait plus a prefill: tens of ms to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)

_NAME = re.compile(r"[^a-zA-Z0-9_]")


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        sched = stats.get("scheduler", {})
        for key, doc in SCHEDULER_COUNTERS.items():
            if key in sched:
                yield CounterMetricFamily(f"ember_scheduler_{key}", doc, value=sched[key])
        for key, doc in SCHEDULER_GAUGES.items():
            if key in sched:
                yield GaugeMetricFamily(f"ember_scheduler_{key}", doc, value=sched[key])
        gw = stats.get("gateway", {})
        if "in_flight" in gw:
            yield GaugeMetricFamily(
                "ember_requests_in_flight", "requests admitted and not finished", value=gw["in_flight"]
            )
        if "rejected" in gw:
            rejected = CounterMetricFamily(
                "ember_requests_rejected", "requests refused at admission", labels=["reason"]
            )
            for reason, n in gw["rejected"].items():
                rejected.add_metric([reason], n)
            yield rejected
        ready = 1 if stats.get("ready") and not stats.get("dead") else 0
        yield GaugeMetricFamily("ember_ready", "1 when the engine accepts requests", value=ready)
        for section, value in stats.items():
            if section not in CORE_SECTIONS and isinstance(value, dict):
                yield from _numeric_leaves(f"ember_{section}", value)


def _numeric_leaves(prefix: str, d: dict[str, Any]) -> Iterator[Metric]:
    """Each number in a stats section as a gauge named by its path."""
    for key, value in d.items():
        name = _NAME.sub("_", f"{prefix}_{key}")
        if isinstance(value, bool):
            yield GaugeMetricFamily(name, f"engine.stats() {prefix}.{key}", value=int(value))
        elif isinstance(value, (int, float)):
            yield GaugeMetricFamily(name, f"engine.stats() {prefix}.{key}", value=value)
        elif isinstance(value, dict):
            yield from _numeric_leaves(name, value)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            # per-position series (e.g. accepted draft tokens by position) as one labelled gauge
            family = GaugeMetricFamily(name, f"engine.stats() {prefix}.{key} by position", labels=["pos"])
            for i, v in enumerate(value):
                family.add_metric([str(i)], v)
            yield family


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "ember_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "ember_time_to_first_token_seconds",
            "from the request arriving to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "ember_inter_token_latency_seconds",
            "time between a request's tokens",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "ember_request_duration_seconds",
            "from the request arriving to its last token",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats))
        self.recent = RecentRequests()  # the last requests' TTFT and cache shares, for /stats (the dashboard)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """Observes one request's TTFT and inter-token latencies as deltas arrive."""

    def __init__(self, metrics: Metrics, now: Callable[[], float], model: str | None = None):
        self.metrics = metrics
        self.now = now
        self.model = model  # the served name, so the dashboard shows each model its own requests
        self.start = now()
        self.last: float | None = None
        self.ttft: float | None = None
        self.usage: Usage | None = None

    def tokens(self, n: int, usage: Usage | None = None) -> None:
        """``n`` tokens arrived (and, with the last delta, the request's usage)."""
        if usage is not None and self.usage is None:  # n > 1 choices: the prompt's figures are the same
            self.usage = usage
        if n <= 0:
            return
        t = self.now()
        if self.last is None:
            self.ttft = t - self.start
            self.metrics.ttft.observe(self.ttft)
        else:
            # a speculative step can bring several tokens at once: spread the gap
            gap = (t - self.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last = t

    def done(self) -> None:
        self.metrics.e2e.observe(self.now() - self.start)
        self.metrics.recent.add(self.ttft, self.usage, self.model)
