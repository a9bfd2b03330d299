"""One validation path (issue 18): the same out-of-range value gets the same
limit and a 400 naming the parameter whichever door it comes in by — the
embedded Engine API, OpenAI chat and completions, Anthropic Messages and
Responses — and an unset max_tokens means the same default everywhere."""

from __future__ import annotations

from typing import Any

import pytest

from ember import EngineConfig, InvalidRequest, SamplingParams
from engine.limits import DEFAULT_MAX_TOKENS, MAX_DRAFT_TOKENS, MAX_STOP_STRINGS
from tests.transport.test_http import serving

pytestmark = pytest.mark.anyio

# a drafter, so that num_draft_tokens reaches its range check (without one,
# any num_draft_tokens > 0 is refused as "no drafter")
SPEC = EngineConfig(backend="fake", max_batch=4, max_queue=8, prefill_chunk=64, draft_model="ngram")
USER = [{"role": "user", "content": "x"}]

# (SamplingParams field, value, the message, {entry point: the field as that API spells it})
CASES: list[tuple[str, Any, str, dict[str, str]]] = [
    (
        "top_p",
        1.5,
        "top_p must be in (0, 1]",
        {"chat": "top_p", "completions": "top_p", "messages": "top_p", "responses": "top_p"},
    ),
    (
        "temperature",
        -1.0,
        "temperature must be a finite number >= 0",
        {"chat": "temperature", "completions": "temperature", "messages": "temperature", "responses": "temperature"},
    ),
    (
        "max_tokens",
        0,
        "max_tokens must be at least 1",
        {"chat": "max_tokens", "completions": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"},
    ),
    (
        "stop",
        ["s"] * (MAX_STOP_STRINGS + 1),
        f"at most {MAX_STOP_STRINGS} stop strings",
        {"chat": "stop", "completions": "stop", "messages": "stop_sequences"},
    ),
    (
        "num_draft_tokens",
        MAX_DRAFT_TOKENS + 1,
        f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]",
        {"chat": "num_draft_tokens", "completions": "num_draft_tokens"},
    ),
]


def _body(route: str, api_field: str, value: Any) -> dict[str, Any]:
    if route == "chat":
        return {"messages": USER, api_field: value}
    if route == "completions":
        return {"prompt": "x", api_field: value}
    if route == "messages":
        return {"model": "fake-gpu-0", "max_tokens": 4, "messages": USER, api_field: value}
    return {"input": "x", api_field: value}


PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}


@pytest.mark.parametrize("field,value,message,routes", CASES, ids=[c[0] for c in CASES])
async def test_the_same_bad_value_gets_the_same_400_at_every_entry_point(
    field: str, value: Any, message: str, routes: dict[str, str]
) -> None:
    async with serving(SPEC) as (app, client):
        engine = app.state.ember.engine
        with pytest.raises(InvalidRequest) as caught:
            await engine.asubmit([1, 2, 3], SamplingParams(**{field: value}))
        assert (str(caught.value), caught.value.param) == (message, field)
        for route, api_field in routes.items():
            r = await client.post(PATHS[route], json=_body(route, api_field, value))
            assert r.status_code == 400, (route, r.text)
            if route == "messages":  # Anthropic's error has no param field: it leads the message
                assert r.json()["error"]["message"] in (message, f"{api_field}: {message}"), r.text
                assert api_field in r.json()["error"]["message"]
            else:
                err = r.json()["error"]
                assert (err["message"], err["param"]) == (message, api_field), (route, err)


async def test_max_completion_tokens_is_named_as_sent() -> None:
    async with serving(SPEC) as (app, client):
        r = await client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 0})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "max_completion_tokens"


async def test_an_unset_max_tokens_is_what_the_context_leaves_on_every_route() -> None:
    """Every HTTP route gives an unset limit the room the prompt leaves
    (transport/wire/limits.py); the embedded API keeps its own default."""
    assert SamplingParams().max_tokens == DEFAULT_MAX_TOKENS
    seen: list[tuple[int, int]] = []
    async with serving(SPEC) as (app, client):
        engine = app.state.ember.engine
        submit = engine.asubmit

        async def spy(prompt: Any, params: SamplingParams | None = None, **kw: Any) -> Any:
            seen.append(((params or SamplingParams()).max_tokens, len(prompt)))
            return await submit(prompt, SamplingParams(max_tokens=1))  # the answer itself does not matter here

        engine.asubmit = spy
        await spy([1, 2, 3])  # the embedded API's own default: no params at all
        for route in ("chat", "completions", "responses", "messages"):
            field = {"responses": "instructions", "messages": "system"}.get(route, "user")
            body = _body(route, field, "u")
            body.pop("max_tokens", None)
            r = await client.post(PATHS[route], json=body)
            assert r.status_code == 200, (route, r.text)
        context = engine.info.context_length
    assert seen[0][0] == DEFAULT_MAX_TOKENS
    assert len(seen) == 5
    assert [m for m, _ in seen[1:]] == [context - n for _, n in seen[1:]]


async def test_top_logprobs_out_of_range_is_named_as_sent() -> None:
    """The engine's limit (MAX_TOP_LOGPROBS), under chat's own field name."""
    async with serving(SPEC) as (app, client):
        body = {"messages": USER, "logprobs": True, "top_logprobs": 21}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "top_logprobs"
        assert r.json()["error"]["message"] == "logprobs (top alternatives) must be in [0, 20]"
