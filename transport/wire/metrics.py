"""Prometheus metrics for one app, in its own ``CollectorRegistry``.

Latencies the HTTP layer sees (time to first token, inter-token latency,
request duration) are histograms observed here. Everything the engine already
counts (requests admitted/finished/aborted, tokens, queue depth, the cache
tiers, speculation) is read from ``engine.stats()`` at scrape time, so the
numbers cannot drift from ``/stats`` and a new section of the stats (a cache
tier, the drafter) shows up without touching this module.

Many models (``ember/registry.py``): every engine series and the latency
histograms carry a ``model`` label, the served name; a model that is not loaded
has no engine series (its counters restart at its next load, as a restarted
process's would: Prometheus' ``rate`` reads that as a counter reset).
"""

from __future__ import annotations

import functools
import re
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import Usage
from transport.wire.ui_stats import RecentRequests

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
    "cache_diverged": "prompts that diverged from a longer cached sequence (a cache miss with a reason)",
    "prefill_waits": "requests that waited for another request's prefill of their shared prefix",
    "shared_prefix_checkpoints": "checkpoints of a shared prefix taken for waiting requests",
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
    """Every loaded model's ``engine.stats()`` as metric families with a ``model``
    label (the served name), one family per metric name, so two models a
    server holds are told apart and sum up in PromQL (``sum by (model)``)."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]]):
        self._stats = stats  # served name -> engine.stats(), the loaded models only

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def family(kind: Callable[..., Any], name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            fam = families.get(name)
            if fam is None:
                fam = families[name] = kind(name, doc, labels=["model", *labels])
            return fam

        for model, stats in self._stats().items():
            sched = stats.get("scheduler", {})
            for key, doc in SCHEDULER_COUNTERS.items():
                if key in sched:
                    family(CounterMetricFamily, f"ember_scheduler_{key}", doc).add_metric([model], sched[key])
            for key, doc in SCHEDULER_GAUGES.items():
                if key in sched:
                    family(GaugeMetricFamily, f"ember_scheduler_{key}", doc).add_metric([model], sched[key])
            gw = stats.get("gateway", {})
            if "in_flight" in gw:
                doc = "requests admitted and not finished"
                family(GaugeMetricFamily, "ember_requests_in_flight", doc).add_metric([model], gw["in_flight"])
            if "rejected" in gw:
                rejected = family(
                    CounterMetricFamily, "ember_requests_rejected", "requests refused at admission", ("reason",)
                )
                for reason, n in gw["rejected"].items():
                    rejected.add_metric([model, reason], n)
            ready = 1 if stats.get("ready") and not stats.get("dead") else 0
            family(GaugeMetricFamily, "ember_ready", "1 when the engine accepts requests").add_metric([model], ready)
            for section, value in stats.items():
                if section not in CORE_SECTIONS and isinstance(value, dict):
                    if section == "speculation" and "by_proposer" in value:
                        value = dict(value)
                        _by_proposer(family, model, value.pop("by_proposer"))
                    _numeric_leaves(family, model, f"ember_{section}", value)
        yield from families.values()


def _by_proposer(family: Callable[..., Any], model: str, by: dict[str, dict[str, Any]]) -> None:
    """vLLM's ``spec_decode_*`` counters per proposer (prompt lookup, suffix
    decoding, a draft model), the proposer a label: ``sum by (proposer)``."""
    for proposer, counters in by.items():
        for key, value in counters.items():
            name = f"ember_{key}"
            if isinstance(value, list):
                doc = f"{key.removesuffix('_per_pos')} by draft position, per proposer"
                fam = family(CounterMetricFamily, name, doc, ("proposer", "pos"))
                for i, v in enumerate(value):
                    fam.add_metric([model, proposer, str(i)], v)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                family(CounterMetricFamily, name, f"{key}, per proposer", ("proposer",)).add_metric(
                    [model, proposer], value
                )


def _numeric_leaves(family: Callable[..., Any], model: str, prefix: str, d: dict[str, Any]) -> None:
    """Each number in a stats section as a gauge named by its path."""
    for key, value in d.items():
        name = _NAME.sub("_", f"{prefix}_{key}")
        if isinstance(value, bool):
            family(GaugeMetricFamily, name, f"engine.stats() {prefix}.{key}").add_metric([model], int(value))
        elif isinstance(value, (int, float)):
            family(GaugeMetricFamily, name, f"engine.stats() {prefix}.{key}").add_metric([model], value)
        elif isinstance(value, dict):
            _numeric_leaves(family, model, name, value)
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            # per-position series (e.g. accepted draft tokens by position) as one labelled gauge
            fam = family(GaugeMetricFamily, name, f"engine.stats() {prefix}.{key} by position", ("pos",))
            for i, v in enumerate(value):
                fam.add_metric([model, str(i)], v)


class ToolCallCounter(Collector):
    """Tool calls read from the output (``calls``) and call-like output that did
    not parse (``parse_failures``: kept as text, or a streamed call whose
    arguments are not JSON), per route and form: ``markers`` (the template's
    ``<tool_call>``), ``fence`` (a ```` ```json ```` block), ``bare`` (the whole
    reply as JSON); transport/turn/fenced_calls.py. A collector and a ``/stats`` section."""

    KINDS = {
        "calls": ("ember_tool_calls", "tool calls read from model output, by route and form"),
        "parse_failures": (
            "ember_tool_call_parse_failures",
            "tool calls in model output that did not parse (kept as text), by route and form",
        ),
    }

    def __init__(self) -> None:
        self.seen: Tally[tuple[str, str, str]] = Tally()  # (kind, route, form)

    def note(self, route: str, form: str, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown tool call count {kind!r}")
        self.seen[(kind, route, form)] += 1

    def for_route(self, route: str) -> Callable[[str, str], None]:
        """The ``count(form, kind)`` a route's ``CallSplitter`` is given."""
        return functools.partial(self.note, route)

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{kind: {route: {form: n}}}``, for ``/stats``."""
        out: dict[str, dict[str, dict[str, int]]] = {kind: {} for kind in self.KINDS}
        for (kind, route, form), n in sorted(self.seen.items()):
            out[kind].setdefault(route, {})[form] = n
        return out

    def collect(self) -> Iterator[Metric]:
        for kind, (name, doc) in self.KINDS.items():
            family = CounterMetricFamily(name, doc, labels=["route", "form"])
            for (k, route, form), n in sorted(self.seen.items()):
                if k == kind:
                    family.add_metric([route, form], n)
            yield family


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]]):
        """``stats``: each loaded model's ``engine.stats()`` by its served name."""
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "ember_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        # --api-keys: each named key's requests (the label is the key's name, never its secret)
        self.key_requests = Counter(
            "ember_key_requests",
            "HTTP requests by API key name (--api-keys), route and status",
            ["key", "route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "ember_time_to_first_token_seconds",
            "from the request arriving to its first token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "ember_inter_token_latency_seconds",
            "time between a request's tokens",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "ember_request_duration_seconds",
            "from the request arriving to its last token",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(stats))
        self.tool_calls = ToolCallCounter()  # calls read from the output, and those that did not parse
        self.registry.register(self.tool_calls)
        self.recent = RecentRequests()  # the last requests' TTFT and cache shares, for /stats (the dashboard)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenTimer:
    """Observes one request's TTFT and inter-token latencies as deltas arrive."""

    def __init__(self, metrics: Metrics, now: Callable[[], float], model: str | None = None):
        self.metrics = metrics
        self.now = now
        self.model = model  # the served name, so the dashboard shows each model its own requests
        label = model or ""
        self._ttft, self._itl, self._e2e = (h.labels(model=label) for h in (metrics.ttft, metrics.itl, metrics.e2e))
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
            self._ttft.observe(self.ttft)
        else:
            # a speculative step can bring several tokens at once: spread the gap
            gap = (t - self.last) / n
            for _ in range(n):
                self._itl.observe(gap)
        self.last = t

    def done(self) -> None:
        self._e2e.observe(self.now() - self.start)
        self.metrics.recent.add(self.ttft, self.usage, self.model)
