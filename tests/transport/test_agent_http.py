"""The agent routes over HTTP on the fake GPU (virtual time): tools reach the
chat template on all three APIs, and bad tool traffic is a 400 naming the
parameter in each route's own error shape, while other requests keep running."""

from __future__ import annotations

from typing import Any

import pytest

from tests.transport.test_http import FAKE, TOK, expected_text, serving

pytestmark = pytest.mark.anyio

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "w", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "w", "parameters": WEATHER}]
TEMPLATE_TOOLS = CHAT_TOOLS
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
TEMPLATE_HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


async def test_tools_and_history_reach_the_template_on_every_route():
    prompt = TOK.apply_chat_template(TEMPLATE_HISTORY, tools=TEMPLATE_TOOLS)
    async with serving(FAKE) as (app, client):
        r = await client.post("/v1/chat/completions", json={"messages": HISTORY, "tools": CHAT_TOOLS, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)
        assert r.json()["choices"][0]["message"]["content"] == expected_text(prompt, 3)
        anthropic_msgs = [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}]},
        ]
        body = {"model": "fake-gpu-0", "messages": anthropic_msgs, "tools": ANTHROPIC_TOOLS}
        r = await client.post("/v1/messages/count_tokens", json=body)
        assert r.json() == {"input_tokens": len(prompt)}
        r = await client.post("/v1/messages", json={**body, "max_tokens": 3})
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(prompt)
        assert usage["cache_read_input_tokens"] > 0  # the chat request above left this prompt in the cache
        assert r.json()["content"][0]["text"] == expected_text(prompt, 3)
        items = [
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
        r = await client.post("/v1/responses", json={"input": items, "tools": RESPONSES_TOOLS, "max_output_tokens": 3})
        assert r.json()["usage"]["input_tokens"] == len(prompt)
        assert r.json()["output"][0]["content"][0]["text"] == expected_text(prompt, 3)
        # tool_choice none: no tools are offered
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": HISTORY, "tools": CHAT_TOOLS, "tool_choice": "none", "max_tokens": 1},
        )
        assert r.json()["usage"]["prompt_tokens"] == len(TOK.apply_chat_template(TEMPLATE_HISTORY))


def _openai_error(r: Any, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def _anthropic_error(r: Any, param: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert param in body["error"]["message"], body


BAD_CHAT = [
    ({"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "r"}]},
        "messages[1].tool_call_id",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objet"}}}]},
        "tools[0].function.parameters.type",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": CHAT_TOOLS + CHAT_TOOLS}, "tools[1].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
]


async def test_bad_tool_traffic_is_a_400_naming_the_parameter_on_every_route():
    async with serving(FAKE) as (app, client):
        for extra, param in BAD_CHAT:
            _openai_error(
                await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra}
                ),
                param,
            )
        base = {"model": "fake-gpu-0", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        bad_anthropic = [
            ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
            (
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "r"}]}
                    ]
                },
                "messages[0].content[0].tool_use_id",
            ),
            (
                {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": 3}}}]},
                "tools[0].input_schema.properties.a",
            ),
            ({"tool_choice": {"type": "any"}}, "tool_choice"),
            (
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
                "messages[0].content[0].type",
            ),
            (
                {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "pre"}]},
                "messages[1].role",
            ),
            ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers"),
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ]
        for extra, param in bad_anthropic:
            _anthropic_error(await client.post("/v1/messages", json={**base, **extra}), param)
        bad_responses = [
            ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
            ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "r"}]}, "input[0].call_id"),
            (
                {"tools": [{"type": "function", "name": "f", "parameters": {"required": "a"}}]},
                "tools[0].parameters.required",
            ),
            ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
            ({"background": True}, "background"),
            ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ]
        for extra, param in bad_responses:
            _openai_error(await client.post("/v1/responses", json={"input": "x", **extra}), param)
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "still fine"}], "max_tokens": 2}
        )
        assert r.status_code == 200


async def test_a_forced_call_is_refused_while_the_engine_cannot_enforce_grammars():
    """Never ignored: without constrained decoding a forced call would be a wish."""
    from transport.turn.chat_turn import engine_enforces_constraints

    async with serving(FAKE) as (app, client):
        # the fake backend has no grammar engine; forced calls on MLX: test_agent_clients.py
        assert not engine_enforces_constraints(app.state.ember.engine)
        body = {"messages": [{"role": "user", "content": "x"}], "tools": CHAT_TOOLS, "tool_choice": "required"}
        _openai_error(await client.post("/v1/chat/completions", json=body), "tool_choice")
        body = {
            "model": "fake-gpu-0",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "any"},
        }
        _anthropic_error(await client.post("/v1/messages", json=body), "tool_choice")
        body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": WEATHER}}}
        _openai_error(await client.post("/v1/responses", json=body), "text.format")
