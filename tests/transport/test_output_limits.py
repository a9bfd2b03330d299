"""Output limits on every route (transport/wire/limits.py): a limit above what the
context leaves is clamped to it and the answer ends with the route's ordinary
length reason; an unset one is what the context leaves, or the operator's cap;
a prompt that fills the context is still a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest

from ember import EngineConfig, FakeGPUConfig
from tests.transport.test_http import serving
from transport.wire.limits import output_limit

pytestmark = pytest.mark.anyio

SMALL = EngineConfig(backend="fake", fake=FakeGPUConfig(context_length=96, eos_bias=-100.0))
LONG = "word " * 8  # leaves the prompt well inside 96 byte-tokens


def test_output_limit():
    assert output_limit(None, 60, 64) == 4
    assert output_limit(32000, 60, 64) == 4
    assert output_limit(2, 60, 64) == 2
    assert output_limit(None, 10, 64, cap=5) == 5
    assert output_limit(None, 62, 64, cap=5) == 2
    assert output_limit(0, 10, 64) == 0  # the engine's own 400 on max_tokens
    assert output_limit(32000, 64, 64) == 32000  # the engine's 400: the prompt fills the context
    assert output_limit(None, 70, 64) == 1


def _bodies(limit: int | None) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, where the finish reason is) per route."""
    user = [{"role": "user", "content": LONG}]

    def lim(name: str) -> dict[str, Any]:
        return {} if limit is None else {name: limit}

    return [
        ("/v1/chat/completions", {"messages": user, **lim("max_tokens")}, "chat"),
        ("/v1/chat/completions", {"messages": user, **lim("max_completion_tokens")}, "chat"),
        ("/v1/completions", {"prompt": LONG, **lim("max_tokens")}, "completions"),
        ("/v1/messages", {"messages": user, **lim("max_tokens")}, "messages"),
        ("/v1/responses", {"input": LONG, **lim("max_output_tokens")}, "responses"),
    ]


def _finish(kind: str, body: dict[str, Any]) -> tuple[str, int, int]:
    """(length reason?, prompt tokens, output tokens)"""
    if kind in ("chat", "completions"):
        u = body["usage"]
        return body["choices"][0]["finish_reason"], u["prompt_tokens"], u["completion_tokens"]
    if kind == "messages":
        u = body["usage"]
        return body["stop_reason"], u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"]
    u = body["usage"]
    reason = (body.get("incomplete_details") or {}).get("reason") or body["status"]
    return reason, u["input_tokens"], u["output_tokens"]


LENGTH = {"chat": "length", "completions": "length", "messages": "max_tokens", "responses": "max_output_tokens"}


@pytest.mark.parametrize("limit", [32000, None], ids=["above-the-room", "unset"])
async def test_a_limit_above_the_room_or_unset_runs_to_the_end_of_the_context(limit):
    async with serving(SMALL) as (app, client):
        for path, body, kind in _bodies(limit):
            r = await client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            reason, prompt, out = _finish(kind, r.json())
            assert prompt + out == 96, (path, prompt, out)
            assert reason == LENGTH[kind], (path, reason)


async def test_the_operator_cap_applies_to_an_unset_limit_only():
    async with serving(SMALL, default_max_tokens=3) as (app, client):
        for path, body, kind in _bodies(None):
            r = await client.post(path, json=body)
            assert _finish(kind, r.json())[2] == 3, path
        for path, body, kind in _bodies(5):
            r = await client.post(path, json=body)
            assert _finish(kind, r.json())[2] == 5, path


async def test_a_prompt_that_fills_the_context_is_a_400():
    async with serving(SMALL) as (app, client):
        r = await client.post("/v1/completions", json={"prompt": [7] * 96, "max_tokens": 32000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = await client.post("/v1/messages", json={"messages": [{"role": "user", "content": "x" * 120}]})
        assert r.status_code == 400
        assert "exceeds the model's context" in r.json()["error"]["message"]
