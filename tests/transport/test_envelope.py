"""The envelope counter: per route, field and action, in /metrics and /stats."""

from prometheus_client import CollectorRegistry, generate_latest

from transport.wire.envelope import EnvelopeCounter


def test_counts_per_route_field_and_action_in_metrics_and_snapshot():
    c = EnvelopeCounter()
    c.note("messages", "context_management")
    c.note("messages", "context_management")
    c.note("responses", "web_search", "dropped")
    registry = CollectorRegistry()
    registry.register(c)
    text = generate_latest(registry).decode()
    assert 'ember_envelope_fields_total{action="ignored",field="context_management",route="messages"} 2.0' in text
    assert 'ember_envelope_fields_total{action="dropped",field="web_search",route="responses"} 1.0' in text
    assert c.snapshot() == {
        "messages": {"context_management:ignored": 2},
        "responses": {"web_search:dropped": 1},
    }
