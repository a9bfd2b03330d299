"""The agent SDKs people write their own programs with, against live
``ember serve`` servers (one per model for the module, a few tokens a call):
the OpenAI Agents SDK (both model classes, streamed and not), LangChain OpenAI
(``bind_tools(strict=True)``, ``with_structured_output`` in every method),
instructor (every OpenAI chat and Responses mode), pydantic-ai (a tool and
structured output through its OpenAI provider) and litellm (the ``openai/``
provider with tools).

Two models, each for the paths it can drive:

* ``tiny`` (random weights) where the grammar decides the answer: forced tool
  calls, ``strict`` tools, JSON schemas. It never stops on its own, so a forced
  call must end by the grammar's own end (a named choice is one call).
* ``scripted`` (engine/fake/scripted.py: its replies given per turn, emitted
  through the real tokenizer, chat template and tool parser) where the client
  needs a model that answers and stops: a final answer after a tool result,
  JSON asked for in prose or markdown, a tool called with ``auto`` choice.

Oracles: each library's own parsing and validation (a pydantic object back),
the schema (``jsonschema``). Every mode must come back parsed: a 400, a
length cut-off or a validation failure fails the test."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import ember_serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,  # 24 SDK round trips against two live servers
    # the libraries' own warnings (instructor's deprecated modes, litellm's pydantic
    # TypedDicts under pydantic 2.14) are theirs, not Ember's: shown, not raised
    pytest.mark.filterwarnings("default"),
]

MODEL = "tiny"
SCRIPTED = "scripted"
QUESTION = "What is the weather in Paris?"


# bounded, so a grammar-constrained answer is short (an unbounded integer lets
# the random-weight tiny model write digits until the token limit)
Days = Annotated[int, Field(ge=1, le=7)]
LIMIT = 80  # output tokens per call: room for a forced call's markup and arguments


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: Days


def get_weather(city: Literal["Paris", "Oslo"], days: Days) -> str:
    """Weather forecast for a city."""
    return f"sunny in {city} for {days} days"


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_SCHEMA},
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with ember_serve("--model", MODEL) as (_, url):
        yield f"{url}/v1"


ANSWER = {"city": "Paris", "days": 3}


def _call(name: str, arguments: dict) -> dict:
    return {"name": name, "arguments": arguments}


# Which tool a rule calls is told by the tool list the template renders
# (each SDK names its tool itself); the first rule that matches answers.
SCRIPT = {
    "rules": [
        # pydantic-ai: the weather tool first, then its output tool with the answer
        {"prompt": '"name": "final_result"', "tool_results": 0, "tool_calls": [_call("weather", ANSWER)]},
        {"prompt": '"name": "final_result"', "min_tool_results": 1, "tool_calls": [_call("final_result", ANSWER)]},
        # instructor's tool modes: the response model is the tool
        {"prompt": '"name": "Forecast"', "tool_results": 0, "tool_calls": [_call("Forecast", ANSWER)]},
        # the Agents SDK, LangChain: the weather tool, then an answer quoting its result
        {"prompt": '"name": "weather"', "tool_results": 0, "tool_calls": [_call("weather", ANSWER)]},
        {"prompt": '"name": "get_weather"', "tool_results": 0, "tool_calls": [_call("get_weather", ANSWER)]},
        {"tools": True, "min_tool_results": 1, "text": "It is {{tool_result}}."},
    ],
    # JSON asked for in the system prompt (instructor JSON, MD_JSON), json_object (LangChain
    # json_mode), written compactly as Ember's json_object grammar has it (engine/mlx/grammar.py)
    "default": json.dumps(ANSWER, separators=(",", ":")),
}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    with ember_serve("--model", f"scripted:{path}") as (_, url):
        yield f"{url}/v1"


def _async_client(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def _sync_client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


# ---------------------------------------------------------------------------
# OpenAI Agents SDK


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_openai_agents_function_tool(scripted, model_class, streamed):
    import agents
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def weather(city: Literal["Paris", "Oslo"], days: Days) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"sunny in {city}"

    async def run() -> object:
        client = _async_client(scripted)
        try:
            model = getattr(agents, model_class)(model=SCRIPTED, openai_client=client)
            agent = Agent(
                name="weather",
                instructions="You are terse.",
                tools=[weather],
                model=model,
                # forced on the first turn; the SDK resets it to auto once the tool ran
                model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=LIMIT),
            )
            if not streamed:
                return await Runner.run(agent, QUESTION, max_turns=3)
            result = Runner.run_streamed(agent, QUESTION, max_turns=3)
            kinds = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in kinds and "run_item_stream_event" in kinds, kinds
            return result
        finally:
            await client.close()

    result = asyncio.run(run())
    assert calls == [("Paris", 3)], calls
    kinds = [type(i).__name__ for i in result.new_items]  # type: ignore[attr-defined]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds, kinds
    assert result.final_output == "It is sunny in Paris.", result.final_output  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# LangChain OpenAI


def _lc(server: str, model: str = MODEL, **kw: object):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model, base_url=server, api_key="unused", max_retries=0, timeout=120, **kw)


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_openai_bind_tools_strict(server, scripted, responses):
    from langchain_core.tools import tool

    lc_tool = tool(get_weather)
    # auto choice: the model decides to call (the scripted one does), strict still holds
    auto = _lc(scripted, SCRIPTED, max_tokens=LIMIT, use_responses_api=responses).bind_tools([lc_tool], strict=True)
    out = auto.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", ANSWER)], out
    # forced: the grammar writes the call (tiny)
    forced = _lc(server, max_tokens=LIMIT, use_responses_api=responses).bind_tools(
        [lc_tool], strict=True, tool_choice="get_weather"
    )
    out = forced.invoke(QUESTION)
    assert out.tool_calls and out.tool_calls[0]["name"] == "get_weather", out
    jsonschema.validate(out.tool_calls[0]["args"], lc_tool.tool_call_schema.model_json_schema())


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_openai_with_structured_output(request, method):
    # json_mode asks for JSON in words (json_object): a model must write the keys
    # itself, which only the scripted one does; the other two are the grammar's
    scripted = method == "json_mode"
    url = request.getfixturevalue("scripted" if scripted else "server")
    llm = _lc(url, SCRIPTED if scripted else MODEL, max_tokens=LIMIT)
    structured = llm.with_structured_output(Forecast, method=method, include_raw=True)
    out = structured.invoke("Paris, 3 days. Answer in JSON with keys city and days.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], Forecast)
    if scripted:
        assert out["parsed"].model_dump() == ANSWER


# ---------------------------------------------------------------------------
# instructor

# modes whose output the grammar constrains: a Forecast must come back
CONSTRAINED = ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA", "RESPONSES_TOOLS", "RESPONSES_TOOLS_WITH_INBUILT_TOOLS"]
# modes a model must answer well without a schema grammar (json_object, prompt-only JSON,
# markdown JSON, tools with auto choice): the scripted model
UNCONSTRAINED = ["JSON", "JSON_O1", "MD_JSON", "PARALLEL_TOOLS", "FUNCTIONS"]


@pytest.mark.parametrize("mode", CONSTRAINED + UNCONSTRAINED)
def test_instructor_mode(request, mode):
    from collections.abc import Iterable

    import instructor

    scripted = mode in UNCONSTRAINED
    client = _sync_client(request.getfixturevalue("scripted" if scripted else "server"))
    name = SCRIPTED if scripted else MODEL
    mode_ = instructor.Mode[mode]
    responses = mode.startswith("RESPONSES")
    patched = instructor.from_openai(client, mode=mode_)
    model: object = Iterable[Forecast] if mode == "PARALLEL_TOOLS" else Forecast
    messages = [{"role": "user", "content": "Paris, 3 days."}]
    limit = {"max_output_tokens": LIMIT} if responses else {"max_tokens": LIMIT}
    # max_retries=0: the first answer must parse (a retry would hide a bad one)
    if responses:
        out = patched.responses.create(model=name, input=messages, response_model=model, max_retries=0, **limit)
    else:
        out = patched.chat.completions.create(
            model=name, messages=messages, response_model=model, max_retries=0, **limit
        )
    items = list(out) if mode == "PARALLEL_TOOLS" else [out]  # type: ignore[call-overload]
    assert items and all(isinstance(i, Forecast) for i in items), items
    if scripted:
        assert [i.model_dump() for i in items] == [ANSWER], items


# ---------------------------------------------------------------------------
# pydantic-ai


@pytest.mark.parametrize("model_class", ["OpenAIChatModel", "OpenAIResponsesModel"])
def test_pydantic_ai_structured_output(server, model_class):
    import pydantic_ai.models.openai as pm
    from pydantic_ai import Agent
    from pydantic_ai.providers.openai import OpenAIProvider

    model = getattr(pm, model_class)(MODEL, provider=OpenAIProvider(base_url=server, api_key="unused"))
    agent = Agent(model, output_type=Forecast, model_settings={"max_tokens": LIMIT})
    result = agent.run_sync("Paris, 3 days.")
    assert isinstance(result.output, Forecast)


def test_pydantic_ai_calls_tools(server):
    """A function tool next to the structured output: pydantic-ai sends both as
    tools with tool_choice required (its output is a tool call too); every call
    the grammar forces runs, and the run ends with the validated Forecast."""
    import pydantic_ai.models.openai as pm
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    def weather(city: Literal["Paris", "Oslo"], days: Days) -> str:
        """Weather forecast for a city."""
        return f"sunny in {city}"

    model = pm.OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server, api_key="unused"))
    agent = Agent(model, tools=[weather], output_type=Forecast, model_settings={"max_tokens": LIMIT})
    result = agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, Forecast)
    parts = [p for m in result.all_messages() for p in m.parts]
    assert any(isinstance(p, ToolCallPart) for p in parts), parts


# ---------------------------------------------------------------------------
# litellm


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_litellm_openai_provider_tools(server, stream):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
    import litellm

    kw = {
        "model": f"openai/{MODEL}",
        "api_base": server,
        "api_key": "unused",
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": LIMIT,
        "num_retries": 0,
    }
    if stream:
        chunks = list(litellm.completion(stream=True, **kw))
        message = litellm.stream_chunk_builder(chunks).choices[0].message
    else:
        message = litellm.completion(**kw).choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
