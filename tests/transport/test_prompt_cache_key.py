"""The client's session key keeps its prefix in the prompt cache: Responses' and
chat's ``prompt_cache_key``, Messages' ``metadata.user_id`` (docs/agent-api.md).

An agent's turn, then other clients' traffic that overflows the RAM tier (while
the agent runs its tool), then the agent's next turn: with the key the next
turn is served from the cache, without it (the same traffic) it is prefilled
again. Fake GPU, virtual time, the real routes and scheduler.
"""

from __future__ import annotations

from typing import Any

import pytest

from ember import EngineConfig
from tests.transport.test_http import serving

pytestmark = pytest.mark.anyio

# 128 bytes a token on the fake GPU: room for about 900 tokens, the session's
# turn (~330) and two of the other requests' (~310 each), not three
CAP_TOKENS = 900
SMALL_RAM = EngineConfig(
    backend="fake", max_batch=4, max_queue=8, prefill_chunk=64, prompt_cache_gib=CAP_TOKENS * 128 / 2**30
)
HISTORY = "The agent's conversation so far: " + "read the file, run the tests, fix the bug. " * 7
OTHER = "Another client's one-off question number {i}: " + "what is the capital of a country? " * 8


def _responses(text: str, key: str | None, turn2: bool) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": text}]
    if turn2:
        items.append({"type": "message", "role": "user", "content": "and now the next step"})
    body: dict[str, Any] = {"input": items, "max_output_tokens": 2}
    if key is not None:
        body["prompt_cache_key"] = key
    return body


def _chat(text: str, key: str | None, turn2: bool) -> dict[str, Any]:
    msgs = [{"role": "user", "content": text}] + ([{"role": "user", "content": "and now"}] if turn2 else [])
    body: dict[str, Any] = {"messages": msgs, "max_tokens": 2}
    if key is not None:
        body["prompt_cache_key"] = key
    return body


def _messages(text: str, key: str | None, turn2: bool) -> dict[str, Any]:
    msgs = [{"role": "user", "content": text}] + ([{"role": "user", "content": "and now"}] if turn2 else [])
    body: dict[str, Any] = {"model": "fake-gpu-0", "messages": msgs, "max_tokens": 2}
    if key is not None:
        body["metadata"] = {"user_id": key}
    return body


ROUTES = {
    "/v1/responses": (_responses, lambda u: (u["input_tokens"], u["input_tokens_details"]["cached_tokens"])),
    "/v1/chat/completions": (_chat, lambda u: (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])),
    "/v1/messages": (_messages, lambda u: (u["input_tokens"], u["cache_read_input_tokens"])),
}


async def _session(path: str, key: str | None) -> tuple[int, int, int]:
    """(turn 1's prompt tokens, turn 2's cached tokens, the tier's session_kept)."""
    build, usage = ROUTES[path]
    async with serving(SMALL_RAM) as (app, client):
        r = await client.post(path, json=build(HISTORY, key, False))
        assert r.status_code == 200, r.text
        first, _ = usage(r.json()["usage"])
        for i in range(3):  # the traffic while the agent runs its tool: more than the tier holds
            r = await client.post(path, json=build(OTHER.format(i=i), None, False))
            assert r.status_code == 200, r.text
        r = await client.post(path, json=build(HISTORY, key, True))
        assert r.status_code == 200, r.text
        _, cached = usage(r.json()["usage"])
        stats = (await client.get("/stats")).json()
    return first, cached, stats["prompt_cache"]["session_kept"]


@pytest.mark.parametrize("path", list(ROUTES))
async def test_the_session_key_keeps_the_sessions_prefix_under_pressure(path):
    first, cached, kept = await _session(path, "session-0b7e")
    assert cached >= first - 32 and kept >= 1  # turn 1's prompt up to its generation prompt
    _, cached_without, kept_without = await _session(path, None)
    assert cached_without < first // 4 and kept_without == 0  # the same traffic, no key: evicted


async def test_responses_counts_the_key_as_honoured():
    async with serving(SMALL_RAM) as (app, client):
        r = await client.post("/v1/responses", json=_responses("hi", "k", False))
        assert r.status_code == 200 and r.json()["prompt_cache_key"] == "k"
        env = (await client.get("/stats")).json()["envelope"]["responses"]
    assert env["prompt_cache_key:honoured"] == 1 and "prompt_cache_key:ignored" not in env
