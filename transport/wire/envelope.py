"""Counted envelope fields: what a client sends that a local server accepts
without acting on it, and what Ember rewrites on the way in.

The rule (docs/agent-api.md): every field and tool type that the current
releases of the agent clients send is honoured, or accepted as a documented,
counted no-op where a no-op is the correct meaning for a local server. Each
such acceptance is counted here, per route and field, so an operator can see
what the clients send and what Ember did with it:

    ember_envelope_fields_total{route="messages", field="context_management", action="ignored"}

``action`` is ``ignored`` (accepted, no effect here), ``honoured`` (acted on,
e.g. ``thinking`` turning reasoning off), ``dropped`` (a hosted tool left out
of the prompt) or ``canonicalised`` (a volatile line taken out of the prompt).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class EnvelopeCounter(Collector):
    """Counts per (route, field, action); a Prometheus collector and a ``/stats`` section."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str, str]] = Counter()

    def note(self, route: str, field: str, action: str = "ignored", n: int = 1) -> None:
        self.seen[(route, field, action)] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{route: {"field:action": n}}``, for ``/stats``."""
        out: dict[str, dict[str, int]] = {}
        for (route, field, action), n in sorted(self.seen.items()):
            out.setdefault(route, {})[f"{field}:{action}"] = n
        return out

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ember_envelope_fields",
            "client fields accepted without effect, honoured, dropped or canonicalised, by route",
            labels=["route", "field", "action"],
        )
        for (route, field, action), n in sorted(self.seen.items()):
            family.add_metric([route, field, action], n)
        yield family
