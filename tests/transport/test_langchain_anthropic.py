"""LangChain Anthropic and a recorded Claude Code request against a live
``ember serve --model tiny`` (the real MLX engine, its grammar engine).

Oracles: LangChain's own parsing (``with_structured_output`` returns the
pydantic object, validated by pydantic), the schema itself (``jsonschema``),
and the anthropic SDK's types for the Claude Code request's answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anthropic
import jsonschema
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool
from pydantic import BaseModel

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_2.1.332_first_request.json"


class Forecast(BaseModel):
    # no numeric bounds: the anthropic SDK moves minimum/maximum into the
    # description before sending (Anthropic's structured outputs lack them), so
    # no server could enforce them
    city: Literal["Paris", "Oslo"]
    days: int


@tool
def get_weather(city: Literal["Paris", "Oslo"], days: int) -> str:
    """Weather forecast for a city."""
    return "sunny"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with ember_serve("--model", "tiny") as (_, url):
        yield url


def chat(server: str, **kw: object) -> ChatAnthropic:
    return ChatAnthropic(model="tiny", base_url=server, api_key="unused", max_retries=0, timeout=120, **kw)


def test_bind_tools_strict_is_accepted_and_a_forced_strict_call_follows_the_schema(server):
    out = chat(server, max_tokens=40).bind_tools([get_weather], strict=True).invoke("weather in Paris?")
    assert out.response_metadata["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    forced = chat(server, max_tokens=60).bind_tools([get_weather], strict=True, tool_choice="get_weather")
    out = forced.invoke("weather in Paris?")
    assert out.tool_calls, out
    call = out.tool_calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())


def test_with_structured_output_json_schema_returns_the_object(server):
    result = chat(server, max_tokens=80).with_structured_output(Forecast, method="json_schema").invoke("Oslo, 3 days")
    assert isinstance(result, Forecast)


def test_a_recorded_claude_code_request_runs_on_tiny(server):
    """Its 128000 max_tokens is clamped to the context the prompt leaves; the
    prompt (system message after the user's, thinking, output_config…) fits."""
    body = json.loads(FIXTURE.read_text())
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=300) as client:
        count = client.messages.count_tokens(
            model="tiny", messages=body["messages"], system=body["system"], tools=body["tools"]
        )
        kept = {k: v for k, v in body.items() if k not in ("model", "max_tokens", "stream", "context_management")}
        extra = {"context_management": body["context_management"]}  # a beta field of the SDK's
        with client.messages.stream(model="tiny", max_tokens=body["max_tokens"], extra_body=extra, **kept) as stream:
            for _ in stream:
                break  # the first events prove the request was taken; the rest would take minutes
            msg = stream.current_message_snapshot
    assert count.input_tokens > 1000
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == count.input_tokens
