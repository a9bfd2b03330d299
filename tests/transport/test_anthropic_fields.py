"""What Claude Code and the anthropic SDK send to ``/v1/messages``, on the fake
GPU (virtual time): a recorded Claude Code request is accepted by messages and
count_tokens; system messages render where they stand (or, for a template that
refuses them, as reminders that keep the history append-only); envelope fields
are counted; tool schemas compile only where enforced; volatile head lines are
canonicalised so the next turn hits the cache.

Oracles: the fake tokenizer's rendering of the expected template messages (its
prompt ids), a real jinja chat template (the bundled tiny one and one that
raises on a non-leading system message, like Qwen3's), and the engine's own
cache report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember import EngineConfig
from engine.errors import InvalidRequest
from engine.fake.gpu import FakeGPUConfig
from tests.transport.test_http import FAKE, TOK, serving
from transport.anthropic.schema import MessagesRequest, reminder
from transport.turn.decode import decode_request

pytestmark = pytest.mark.anyio

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_2.1.332_first_request.json"
TINY_TEMPLATE = (Path(__file__).parents[2] / "engine" / "models" / "tiny" / "chat_template.jinja").read_text()
# Qwen3-style: a system message anywhere but first is an error
REFUSING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
BIG = EngineConfig(
    backend="fake", max_batch=4, max_queue=8, prefill_chunk=4096, fake=FakeGPUConfig(context_length=131_072)
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Claude Code's TaskCreate-style schema: 2020-12 keywords llguidance cannot compile
TASKS = {
    "type": "object",
    "properties": {"metadata": {"type": "object", "propertyNames": {"pattern": "^[a-z_]+$"}}},
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}


def render(template: str, messages: list[dict[str, Any]], tools: Any = None) -> str:
    """A chat template as transformers renders it (tojson, raise_exception)."""

    def raise_exception(msg: str) -> None:
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, **kw)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True)


def request(body: dict[str, Any]) -> MessagesRequest:
    return decode_request(json.dumps(body).encode(), MessagesRequest)


def claude_code_body() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


# ---------------------------------------------------------------------------
# Claude Code's own request


async def test_a_recorded_claude_code_request_is_accepted_by_messages_and_count_tokens():
    body = claude_code_body()
    assert body["messages"][-1]["role"] == "system"  # what it sends by default: a system message after the user's
    assert {"thinking", "context_management", "output_config", "metadata"} <= set(body)
    assert body["max_tokens"] > 100_000
    body["model"] = "fake-gpu-0"  # Claude Code's --model (ember launch sets it to the served name)
    async with serving(BIG) as (app, client):
        r = await client.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200, r.text
        n = r.json()["input_tokens"]
        req = request(body)
        setup = req.tool_setup()
        expected = TOK.apply_chat_template(req.template_messages(setup), setup.template_tools())
        assert n == len(expected)
        r = await client.post("/v1/messages", json={**body, "stream": False})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n
        envelope = app.state.ember.envelope.snapshot()["messages"]
        for key in (
            "thinking:ignored",
            "context_management:ignored",
            "output_config.effort:ignored",
            "metadata.user_id:honoured",  # Claude Code's session id: the prompt cache's session key
            "messages[].role=system:honoured",
            "x-anthropic-billing-header:canonicalised",
            "tools[].defer_loading:honoured",
        ):
            assert envelope.get(key, 0) >= 1, (key, envelope)


def test_claude_code_system_message_stays_where_it_stands_and_the_deferred_tool_is_not_rendered():
    body = claude_code_body()
    req = request(body)
    setup = req.tool_setup()
    msgs = req.template_messages(setup)
    assert [m["role"] for m in msgs] == ["system", "user", "system"]
    assert not msgs[0]["content"].startswith("x-anthropic-billing-header")
    assert "x-anthropic-billing-header" not in json.dumps(msgs)
    rendered = {t["function"]["name"] for t in setup.template_tools() or []}
    assert "DeferredToolPlaceholder" not in rendered
    assert "Bash" in rendered
    assert "DeferredToolPlaceholder" in {t.name for t in setup.tools}  # still callable (parsed)


def test_thinking_choice():
    base = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    assert request(base).thinking_choice() is None
    assert request({**base, "thinking": {"type": "disabled"}}).thinking_choice() is False
    assert request({**base, "thinking": {"type": "adaptive", "display": "omitted"}}).thinking_choice() is True
    assert request({**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}).thinking_choice() is True
    with pytest.raises(InvalidRequest) as caught:
        request({**base, "thinking": {"type": "disabled", "budget_tokens": 10}})
    assert caught.value.param == "thinking.budget_tokens"


# ---------------------------------------------------------------------------
# System messages in place, or as reminders


MID_SYSTEM = [
    {"role": "user", "content": "hello"},
    {"role": "system", "content": [{"type": "text", "text": "the Agent tool is available"}]},
]


async def test_a_mid_conversation_system_message_renders_where_it_stands():
    async with serving(FAKE) as (app, client):
        body = {"system": "be brief", "messages": MID_SYSTEM, "max_tokens": 3}
        r = await client.post("/v1/messages/count_tokens", json=body)
        expected = TOK.apply_chat_template(
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello"},
                {"role": "system", "content": "the Agent tool is available"},
            ]
        )
        assert r.json() == {"input_tokens": len(expected)}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text


def test_the_tiny_template_takes_a_system_message_in_place_and_the_history_stays_append_only():
    turn1 = request({"system": "be brief", "messages": MID_SYSTEM, "tools": [{"name": "f", "input_schema": WEATHER}]})
    follow = MID_SYSTEM + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    turn2 = request({"system": "be brief", "messages": follow, "tools": [{"name": "f", "input_schema": WEATHER}]})
    s1, s2 = turn1.tool_setup(), turn2.tool_setup()
    p1 = render(TINY_TEMPLATE, turn1.template_messages(s1), s1.template_tools())
    p2 = render(TINY_TEMPLATE, turn2.template_messages(s2), s2.template_tools())
    assert "<|im_start|>system\nthe Agent tool is available<|im_end|>" in p1
    assert p2.startswith(p1)


async def test_a_template_that_refuses_a_later_system_message_gets_it_as_a_reminder(monkeypatch):
    async with serving(FAKE) as (app, client):
        tok = app.state.ember.engine.tokenizer
        monkeypatch.setattr(tok, "render_chat", lambda messages, tools=None, **kw: render(REFUSING_TEMPLATE, messages))
        body = {"system": "be brief", "messages": MID_SYSTEM, "max_tokens": 3}
        r = await client.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200, r.text
        want = render(
            REFUSING_TEMPLATE,
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello\n\n" + reminder("the Agent tool is available")},
            ],
        )
        assert r.json() == {"input_tokens": len(TOK.encode(want))}
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        assert app.state.ember.envelope.snapshot()["messages"]["messages[].role=system:canonicalised"] == 2

    # append-only: the next turn's prompt starts with this turn's whole prompt
    turns = [
        MID_SYSTEM,
        MID_SYSTEM + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}],
        MID_SYSTEM
        + [
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok"},
            {"role": "system", "content": "after an answer"},
        ],
    ]
    prompts = [
        render(REFUSING_TEMPLATE, request({"system": "s", "messages": m}).template_messages(reminders=True))
        for m in turns
    ]
    assert prompts[1].startswith(prompts[0])
    assert "after an answer" in prompts[2] and prompts[2].startswith(prompts[1])


# ---------------------------------------------------------------------------
# Volatile head lines


def _billing(cch: str) -> dict[str, Any]:
    return {
        "type": "text",
        "text": f"x-anthropic-billing-header: cc_version=2.1.332.9a2; cc_entrypoint=cli; cch={cch};",
    }


async def test_the_billing_header_is_canonicalised_and_the_next_turn_hits_the_cache():
    system_a = [
        _billing("1f2e3"),
        {"type": "text", "text": "You are an agent. " * 20, "cache_control": {"type": "ephemeral"}},
    ]
    system_b = [_billing("9a8b7"), system_a[1]]
    first = {"system": system_a, "messages": [{"role": "user", "content": "list the files"}], "max_tokens": 4}
    a, b = request(first), request({**first, "system": system_b})
    assert a.template_messages() == b.template_messages()
    assert "cch=" not in json.dumps(a.template_messages())
    async with serving(FAKE) as (app, client):
        r1 = await client.post("/v1/messages", json=first)
        n1 = r1.json()["usage"]["input_tokens"] + r1.json()["usage"]["cache_read_input_tokens"]
        answer = r1.json()["content"][0]["text"]
        follow = [*first["messages"], {"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
        r2 = await client.post("/v1/messages", json={**first, "system": system_b, "messages": follow})
        assert r2.status_code == 200, r2.text
        assert r2.json()["usage"]["cache_read_input_tokens"] >= n1
        metrics = (await client.get("/metrics")).text
        assert 'field="x-anthropic-billing-header"' in metrics and 'action="canonicalised"' in metrics


# ---------------------------------------------------------------------------
# Tool schemas: rendered always, compiled only where enforced


async def test_a_schema_the_grammar_cannot_compile_is_fine_until_a_request_enforces_it():
    base = {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
    tools = [{"name": "TaskCreate", "input_schema": TASKS}]
    async with serving(FAKE) as (app, client):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = await client.post(path, json={**base, "tools": tools})
            assert r.status_code == 200, r.text
        chat_tools = [{"type": "function", "function": {"name": "TaskCreate", "parameters": TASKS}}]
        r = await client.post("/v1/chat/completions", json={**base, "tools": chat_tools})
        assert r.status_code == 200, r.text
        for extra in (
            {"tool_choice": {"type": "tool", "name": "TaskCreate"}},
            {"tools": [{**tools[0], "strict": True}]},
        ):
            r = await client.post("/v1/messages", json={**base, "tools": tools, **extra})
            assert r.status_code == 400, r.text
            assert "propertyNames" in r.json()["error"]["message"]
            assert r.json()["error"]["message"].startswith("tools[0].input_schema")
        r = await client.post("/v1/chat/completions", json={**base, "tools": chat_tools, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"


async def test_output_config_format_is_a_constraint_never_ignored():
    """The fake GPU cannot enforce grammars: the format is refused by name, not
    dropped (the live tiny test, test_langchain_anthropic.py, honours it)."""
    base = {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
    async with serving(FAKE) as (app, client):
        fmt = {"format": {"type": "json_schema", "schema": WEATHER}}
        r = await client.post("/v1/messages", json={**base, "output_config": fmt})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("output_config.format")
        r = await client.post("/v1/messages/count_tokens", json={**base, "output_config": fmt})
        assert r.status_code == 200
        bad = {"format": {"type": "json_schema", "schema": TASKS}}
        r = await client.post("/v1/messages", json={**base, "output_config": bad})
        assert r.status_code == 400 and "propertyNames" in r.json()["error"]["message"]


async def test_every_envelope_field_is_accepted_and_counted():
    body = {
        "model": "fake-gpu-0",
        "max_tokens": 3,
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {}, "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "r"}, {"type": "tool_reference", "tool_name": "g"}],
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "tools": [
            {"name": "f", "input_schema": WEATHER, "cache_control": {"type": "ephemeral"}, "input_examples": [{}]},
            {"name": "g", "input_schema": WEATHER, "defer_loading": True, "eager_input_streaming": True},
        ],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "cache_control": {"type": "ephemeral"},
        "container": "c1",
        "inference_geo": "us",
        "speed": "standard",
        "mcp_servers": [],
        "stop_sequences": ["\n\n"],
        "top_k": 5,
    }
    async with serving(FAKE) as (app, client):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = await client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        seen = app.state.ember.envelope.snapshot()["messages"]
    for key in (
        "cache_control:ignored",
        "system[].cache_control:ignored",
        "messages[].content[].cache_control:ignored",
        "messages[].content[].type=thinking:honoured",
        "tools[].cache_control:ignored",
        "tools[].input_examples:ignored",
        "tools[].defer_loading:honoured",
        "context_management:ignored",
        "service_tier:ignored",
        "container:ignored",
        "inference_geo:ignored",
        "speed:ignored",
        "mcp_servers:ignored",
        "metadata.user_id:honoured",
    ):
        assert seen.get(key, 0) == 2, (key, seen)
    req = request(body)
    msgs = req.template_messages(req.tool_setup())
    # earlier thinking reaches the template as the assistant's reasoning_content (the template keeps or drops it)
    assert [m.get("reasoning_content") for m in msgs if m["role"] == "assistant"] == ["hmm"]
    assert msgs[-1]["role"] == "tool" and '"name": "g"' in msgs[-1]["content"]  # the deferred tool, loaded in place


async def test_get_and_head_on_the_root_answer_200():
    async with serving(FAKE) as (app, client):
        r = await client.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")  # the dashboard page
        r = await client.head("/")
        assert r.status_code == 200
