"""Real clients against ``ember serve`` on the bundled tiny model: the official
``openai`` SDK (chat with tools, streamed tool calls, Responses), the official
``anthropic`` SDK (messages, streaming, tool use, count_tokens) and the OpenAI
Agents SDK running a function tool end to end.

Oracles: the SDKs parse every body and event with their own types; the three
APIs must produce the same greedy text for the same conversation (one model,
one prompt); a streamed answer must equal the non-streamed one. A forced tool
call needs grammar-constrained decoding, which the MLX engine always has
(llguidance is a dependency): a 400 for it fails the test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}}
]
SYSTEM = "You are terse."
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with ember_serve("--model", MODEL) as (_, url):
        yield url


@pytest.fixture(scope="module")
def oai(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grammar(oai) -> None:
    """The MLX engine enforces grammars (llguidance is a dependency): a forced call
    is served. A 400 here ("cannot enforce a grammar") is a failure, never a skip."""
    try:
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=CHAT_TOOLS,
            tool_choice="required",
            max_tokens=60,
        )
    except openai.BadRequestError as exc:
        pytest.fail(f"the bundled model on MLX refused a forced tool call: {exc}")


def check_weather_args(args: dict) -> None:
    assert set(args) == {"city", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7


MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def chat_text(oai) -> str:
    r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    return r.choices[0].message.content


# ---------------------------------------------------------------------------
# OpenAI Chat Completions


def test_chat_with_tools_offers_them_in_the_prompt(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    with_tools = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, max_tokens=4)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template wrote the tool list
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_named_tool_call_parses(oai, grammar):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=80
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather_args(json.loads(call.function.arguments))
    assert r.choices[0].finish_reason == "tool_calls"
    assert not r.choices[0].message.content


def test_streamed_tool_call_reassembles_to_the_same_call(oai, grammar):
    kw = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=CHAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    whole = oai.chat.completions.create(**kw).choices[0]
    with oai.chat.completions.stream(**kw) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert len(pieces) > 1  # the arguments arrived in pieces
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert final.finish_reason == "tool_calls"
    # the call goes back with its result; the next turn renders and answers
    call = whole.message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    nxt = oai.chat.completions.create(model=MODEL, messages=history, tools=CHAT_TOOLS, max_tokens=8)
    assert nxt.usage.prompt_tokens_details.cached_tokens > 0


# ---------------------------------------------------------------------------
# OpenAI Responses


def test_responses_text_matches_chat_streaming_and_not(oai, chat_text):
    r = oai.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12)
    assert r.output_text == chat_text and r.status in ("completed", "incomplete")
    with oai.responses.stream(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # cut by max_output_tokens, OpenAI ends with response.incomplete (the SDK's get_final_response wants completed)
    assert events[-1].type == f"response.{r.status}"
    final = events[-1].response
    assert "".join(deltas) == chat_text == final.output_text
    assert final.usage.input_tokens == r.usage.input_tokens


def test_responses_forced_function_call(oai, grammar):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    r = oai.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="required", max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    check_weather_args(json.loads(calls[0].arguments))
    follow = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": QUESTION},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
        tools=tools,
        max_output_tokens=8,
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0


# ---------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_messages_create_stream_and_count_tokens(claude, chat_text):
    kw = dict(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=12)
    msg = claude.messages.create(**kw)
    assert msg.content[0].text == chat_text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == chat_text == final.content[0].text
    count = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=kw["messages"])
    assert count.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: served from the prompt cache


def test_anthropic_stop_sequence(claude, chat_text):
    stop = chat_text[3:6]
    if not stop.strip():
        pytest.skip(f"the greedy answer {chat_text!r} has no usable stop sequence")
    msg = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        system=SYSTEM,
        max_tokens=12,
        stop_sequences=[stop],
    )
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert chat_text.startswith(msg.content[0].text) and stop not in msg.content[0].text


def test_anthropic_forced_tool_use(claude, grammar):
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
    msg = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=80,
    )
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and msg.stop_reason == "tool_use"
    check_weather_args(use.input)
    with claude.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=80,
    ) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]


# ---------------------------------------------------------------------------
# OpenAI Agents SDK


def test_openai_agents_runs_a_function_tool(server, grammar):
    # openai-agents (the test extra) imports as `agents`
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            agent = Agent(
                name="weather",
                instructions=SYSTEM,
                tools=[get_weather],
                model=model,
                # forced on the first turn; the SDK resets it to auto once a tool ran
                model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60),
            )
            return await Runner.run(agent, QUESTION, max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(calls[0][0], str)
    kinds = [type(i).__name__ for i in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds
    assert isinstance(result.final_output, str)
