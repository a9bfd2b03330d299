"""Tool calls written as plain JSON, end to end: a live ``ember serve`` with the
scripted model (engine/fake/scripted.py) answering the way
Qwen2.5-Coder-1.5B-Instruct really does — a ```` ```json ```` fenced object after a
sentence, a fenced list, a bare object — on the three chat routes, streamed and
not, judged by the official ``openai`` and ``anthropic`` SDKs: a ``tool_calls``
entry, a ``tool_use`` block, a ``function_call`` item, each with the parsed
arguments. A fenced JSON answer that is not a call comes back as text, byte
for byte; a call that does not parse comes back as text and is counted in
``/stats`` and ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live_server import ember_serve

pytestmark = pytest.mark.slow  # one live server for the module

MODEL = "scripted"
ARGS = {"city": "Paris", "days": 3}
OSLO = {"city": "Oslo", "days": 1}
FENCE = "I will check the weather.\n```json\n" + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n```"
LIST = (
    "```\n"
    + json.dumps([{"name": "get_weather", "arguments": ARGS}, {"name": "get_weather", "arguments": OSLO}])
    + "\n```"
)
BARE = json.dumps({"name": "get_weather", "arguments": ARGS})
ASKED_JSON = 'Here you go:\n```json\n{"name": "Paris", "arguments": ["not", "a", "call"]}\n```'
BROKEN = '```json\n{"name": "get_weather", "arguments": {"city": }}\n```'

SCRIPT = {
    "rules": [
        {"last_user": "FENCE", "text": FENCE},
        {"last_user": "LIST", "text": LIST},
        {"last_user": "BARE", "text": BARE},
        {"last_user": "ASKED_JSON", "text": ASKED_JSON},
        {"last_user": "BROKEN", "text": BROKEN},
    ],
    "default": "OK.",
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("script") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    with ember_serve("--model", f"scripted:{path}") as (_, url):
        yield url


@pytest.fixture(scope="module")
def oai(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(oai: openai.OpenAI, cue: str, stream: bool, **kw: Any) -> Any:
    """The assistant message and finish reason, streamed (the SDK's accumulator) or not."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": cue}], tools=CHAT_TOOLS, max_tokens=200, **kw)
    if stream:
        with oai.chat.completions.stream(**args) as s:
            final = s.get_final_completion()
    else:
        final = oai.chat.completions.create(**args)
    return final.choices[0].message, final.choices[0].finish_reason


def messages(claude: anthropic.Anthropic, cue: str, stream: bool) -> anthropic.types.Message:
    args = dict(model=MODEL, messages=[{"role": "user", "content": cue}], tools=ANTHROPIC_TOOLS, max_tokens=200)
    if stream:
        with claude.messages.stream(**args) as s:
            return s.get_final_message()
    return claude.messages.create(**args)


def responses(oai: openai.OpenAI, cue: str, stream: bool) -> Any:
    args = dict(model=MODEL, input=cue, tools=RESPONSES_TOOLS, max_output_tokens=200)
    if stream:
        with oai.responses.stream(**args) as s:
            return s.get_final_response()
    return oai.responses.create(**args)


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])


@STREAM
def test_chat_reads_a_fenced_call_after_a_sentence(oai, stream):
    msg, finish = chat(oai, "FENCE", stream)
    assert finish == "tool_calls"
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == ARGS
    assert msg.content == "I will check the weather.\n"


@STREAM
def test_chat_reads_a_fenced_list_as_parallel_calls_and_keeps_one_when_not_parallel(oai, stream):
    msg, finish = chat(oai, "LIST", stream)
    assert finish == "tool_calls"
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [ARGS, OSLO]
    assert len({c.id for c in msg.tool_calls}) == 2
    msg, finish = chat(oai, "LIST", stream, parallel_tool_calls=False)
    assert finish == "tool_calls" and [json.loads(c.function.arguments) for c in msg.tool_calls] == [ARGS]


@STREAM
def test_chat_reads_a_bare_reply_object(oai, stream):
    msg, finish = chat(oai, "BARE", stream)
    assert finish == "tool_calls" and not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_weather", ARGS)]


@STREAM
def test_anthropic_reads_a_fenced_call_as_tool_use(claude, stream):
    msg = messages(claude, "FENCE", stream)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "I will check the weather.\n"
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == ARGS and use.id.startswith("toolu_")


@STREAM
def test_anthropic_reads_a_fenced_list(claude, stream):
    msg = messages(claude, "LIST", stream)
    assert msg.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == [
        ("get_weather", ARGS),
        ("get_weather", OSLO),
    ]


@STREAM
def test_responses_reads_a_fenced_call_as_a_function_call_item(oai, stream):
    r = responses(oai, "FENCE", stream)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    assert r.output_text == "I will check the weather.\n"


@STREAM
def test_responses_reads_a_bare_reply_object(oai, stream):
    r = responses(oai, "BARE", stream)
    assert [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"] == [("get_weather", ARGS)]


@STREAM
def test_fenced_json_that_is_not_a_call_is_text_byte_for_byte_on_every_route(oai, claude, stream):
    msg, finish = chat(oai, "ASKED_JSON", stream)
    assert (msg.content, msg.tool_calls, finish) == (ASKED_JSON, None, "stop")
    m = messages(claude, "ASKED_JSON", stream)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ASKED_JSON
    assert m.stop_reason == "end_turn"
    r = responses(oai, "ASKED_JSON", stream)
    assert r.output_text == ASKED_JSON and not [o for o in r.output if o.type == "function_call"]


def _counts(server: str) -> tuple[dict[str, Any], str]:
    stats = httpx.get(f"{server}/stats", timeout=30).json()["tool_calls"]
    return stats, httpx.get(f"{server}/metrics", timeout=30).text


def _n(stats: dict[str, Any], kind: str, route: str, form: str) -> int:
    return stats[kind].get(route, {}).get(form, 0)


def test_a_call_that_does_not_parse_is_text_and_counted_never_an_error(server, oai, claude):
    before, _ = _counts(server)
    for stream in (False, True):
        msg, finish = chat(oai, "BROKEN", stream)
        assert (msg.content, msg.tool_calls, finish) == (BROKEN, None, "stop")
        m = messages(claude, "BROKEN", stream)
        assert m.content[0].text == BROKEN and m.stop_reason == "end_turn"
        assert responses(oai, "BROKEN", stream).output_text == BROKEN
    chat(oai, "FENCE", False)
    after, metrics = _counts(server)
    for route in ("chat", "messages", "responses"):
        assert _n(after, "parse_failures", route, "fence") - _n(before, "parse_failures", route, "fence") == 2
    assert _n(after, "calls", "chat", "fence") - _n(before, "calls", "chat", "fence") == 1
    failures = _n(after, "parse_failures", "chat", "fence")
    assert f'ember_tool_call_parse_failures_total{{form="fence",route="chat"}} {float(failures)}' in metrics
    assert 'ember_tool_calls_total{form="fence",route="chat"}' in metrics
