"""Tool calls cut out of streamed text, rendered for the three APIs, judged by
the official SDKs: every chunk / event / body validates against the SDK's own
pydantic types, and the SDK's own stream accumulators reassemble the same
message, calls and arguments from any chunking of the model's text.

The deltas are fabricated by hand (the way vLLM's scheduler tests fabricate
model output): the model text is fixed, the split points vary."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types
import openai.types.chat
import openai.types.responses
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState

from ember.api import Completion
from engine.fake.tokenizer import ByteTokenizer
from engine.types import Delta, Usage
from transport.anthropic.api import MessagesRenderer
from transport.openai.render import ChatRenderer
from transport.responses.api import ResponsesRenderer
from transport.responses.schema import ResponsesRequest
from transport.turn.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Text
from transport.turn.tools import Tool, ToolChoice, check_tool, forced_call_grammar

TOK = ByteTokenizer()
MARKUP = TOK.tool_markup
ARGS_1 = '{"city": "Paris", "when": {"day": 2, "tags": ["a}", "b"]}}'
ARGS_2 = "{}"
MODEL_TEXT = (
    "Let me check.<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {ARGS_1}}}\n'
    "</tool_call>\n<tool_call>\n"
    f'{{"name": "now", "arguments": {ARGS_2}}}\n'
    "</tool_call>"
)
USAGE = Usage(prompt_tokens=30, completion_tokens=len(MODEL_TEXT), cached_tokens=12)


def deltas(text: str, step: int, finish: str = "stop") -> list[Delta]:
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    out = [Delta(rid=1, text=p, token_ids=list(p.encode())) for p in pieces]
    out.append(Delta(rid=1, finish_reason=finish, usage=USAGE))
    return out


def completion(text: str, finish: str = "stop") -> Completion:
    c = Completion()
    for d in deltas(text, 10_000, finish):
        c.add(d)
    return c


def sse_payloads(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data and data[0] != "[DONE]":
            out.append(json.loads(data[0]))
    return out


STEPS = [1, 2, 5, 13, 10_000]


@pytest.mark.parametrize("step", STEPS)
def test_splitter_events_do_not_depend_on_chunking(step):
    s = CallSplitter(MARKUP)
    events = []
    for d in deltas(MODEL_TEXT, step):
        events += s.feed(d.text)
    events += s.finish()
    assert "".join(e.text for e in events if isinstance(e, Text)) == "Let me check."
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [e.name for e in starts] == ["get_weather", "now"]
    for i, want in enumerate([ARGS_1, ARGS_2]):
        assert "".join(e.text for e in events if isinstance(e, CallArgs) and e.index == i) == want
    assert [(e.name, e.arguments) for e in events if isinstance(e, CallEnd)] == [
        ("get_weather", ARGS_1),
        ("now", ARGS_2),
    ]
    if step < 5:  # the arguments really stream: several pieces before the end marker
        assert sum(isinstance(e, CallArgs) and e.index == 0 for e in events) > 3


def test_splitter_plain_text_and_a_lookalike_marker_pass_through():
    s = CallSplitter(MARKUP)
    text = "a <tool and <tool_cal but no call"
    out = [e for ch in text for e in s.feed(ch)] + s.finish()
    assert "".join(e.text for e in out) == text


def test_splitter_single_call_drops_the_rest_and_a_truncated_call_ends():
    s = CallSplitter(MARKUP, single=True)
    events = s.feed(MODEL_TEXT) + s.finish()
    assert [e.name for e in events if isinstance(e, CallEnd)] == ["get_weather"]
    assert s.dropped_chars > 0
    s = CallSplitter(MARKUP)
    cut = MODEL_TEXT[: MODEL_TEXT.index('"Paris"')]
    events = s.feed(cut) + s.finish()
    (end,) = [e for e in events if isinstance(e, CallEnd)]
    assert end.name == "get_weather" and end.arguments == '{"city": '
    s = CallSplitter(MARKUP)  # cut before the name: no call, and no markup as text either
    events = s.feed("ok" + MODEL_TEXT[13:30]) + s.finish()
    assert events == [Text("ok")] and s.dropped_chars > 0


def test_splitter_parses_other_formats_whole_with_the_parser():
    markup = type(MARKUP)(start="[CALL]", end="[/CALL]", parser=lambda t, tools: json.loads(t), json_form=False)
    s = CallSplitter(markup)
    events = s.feed('x[CALL]{"name": "f", "arguments": {"a": 1}}[/CALL]') + s.finish()
    assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, CallEnd)] == [("f", {"a": 1})]
    s = CallSplitter(markup)
    events = s.feed("x[CALL]not json[/CALL]") + s.finish()  # not a call: kept as text, nothing lost
    assert "".join(e.text for e in events if isinstance(e, Text)) == "x[CALL]not json[/CALL]"


@pytest.mark.parametrize("step", STEPS)
def test_chat_stream_reassembled_by_the_openai_sdk(step):
    r = ChatRenderer("m", include_usage=True, splitter=lambda: CallSplitter(MARKUP))
    chunks = r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)]
    state = ChatCompletionStreamState()
    for payload in sse_payloads(chunks):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(payload))
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", ARGS_1),
        ("now", ARGS_2),
    ]
    assert len({c.id for c in msg.tool_calls}) == 2
    assert final.choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(str(p) for p in sse_payloads(chunks))  # markup never leaks


def test_chat_body_validates_and_length_is_not_tool_calls():
    r = ChatRenderer("m", splitter=lambda: CallSplitter(MARKUP))
    body = openai.types.chat.ChatCompletion.model_validate_json(r.body(completion(MODEL_TEXT)))
    assert body.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in body.choices[0].message.tool_calls] == [json.loads(ARGS_1), {}]
    r = ChatRenderer("m", splitter=lambda: CallSplitter(MARKUP))
    body = openai.types.chat.ChatCompletion.model_validate_json(r.body(completion("just text", "length")))
    assert body.choices[0].message.content == "just text" and body.choices[0].message.tool_calls is None
    assert body.choices[0].finish_reason == "length"


ANTHROPIC_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


@pytest.mark.parametrize("step", STEPS)
def test_anthropic_stream_reassembled_by_the_anthropic_sdk(step):
    r = MessagesRenderer("m", 30, CallSplitter(MARKUP, id_prefix="toolu_"), TOK, [])
    chunks = r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)]
    names = [
        line[7:]
        for block in b"".join(chunks).decode().split("\n\n")
        for line in block.split("\n")
        if line.startswith("event: ")
    ]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    snapshot, bufs = None, {}
    for payload in sse_payloads(chunks):
        if payload["type"] == "ping":
            continue
        snapshot = accumulate_event(
            event=ANTHROPIC_EVENT.validate_python(payload), current_snapshot=snapshot, json_bufs=bufs
        )
    assert [b.type for b in snapshot.content] == ["text", "tool_use", "tool_use"]
    assert snapshot.content[0].text == "Let me check."
    assert [(b.name, b.input) for b in snapshot.content[1:]] == [("get_weather", json.loads(ARGS_1)), ("now", {})]
    assert snapshot.stop_reason == "tool_use"
    assert (snapshot.usage.input_tokens, snapshot.usage.cache_read_input_tokens) == (18, 12)


def test_anthropic_body_and_stop_sequence():
    r = MessagesRenderer("m", 30, CallSplitter(MARKUP), TOK, [])
    msg = anthropic.types.Message.model_validate_json(r.body(completion(MODEL_TEXT)))
    assert msg.stop_reason == "tool_use" and msg.content[1].input == json.loads(ARGS_1)
    # the engine cut the text before "STOP"; the tokens that spelled it were generated
    c = Completion()
    c.add(Delta(rid=1, text="hello ", token_ids=list(b"hello STOP")))
    c.add(Delta(rid=1, finish_reason="stop", usage=USAGE))
    msg = anthropic.types.Message.model_validate_json(MessagesRenderer("m", 30, None, TOK, ["END", "STOP"]).body(c))
    assert (msg.stop_reason, msg.stop_sequence, msg.content[0].text) == ("stop_sequence", "STOP", "hello ")
    msg = anthropic.types.Message.model_validate_json(
        MessagesRenderer("m", 30, None, TOK, ["END"]).body(completion("hi"))
    )
    assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)


RESPONSE_EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)


def _responses_request() -> ResponsesRequest:
    body = {
        "input": "weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    }
    import msgspec

    return msgspec.convert(body, ResponsesRequest).check()


@pytest.mark.parametrize("step", STEPS)
def test_responses_stream_reassembled_by_the_openai_sdk(step):
    r = ResponsesRenderer("m", _responses_request(), CallSplitter(MARKUP))
    chunks = r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)]
    payloads = sse_payloads(chunks)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for p in payloads:
        state.handle_event(RESPONSE_EVENT.validate_python(p))
    final = openai.types.responses.Response.model_validate(payloads[-1]["response"])
    assert payloads[-1]["type"] == "response.completed"
    assert final.output_text == "Let me check."
    calls = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert calls == [("get_weather", ARGS_1), ("now", ARGS_2)]
    assert final.usage.input_tokens_details.cached_tokens == 12


def test_responses_body_validates_and_length_is_incomplete():
    r = ResponsesRenderer("m", _responses_request(), CallSplitter(MARKUP))
    resp = openai.types.responses.Response.model_validate_json(r.body(completion(MODEL_TEXT)))
    assert resp.status == "completed" and [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    r = ResponsesRenderer("m", _responses_request(), None)
    resp = openai.types.responses.Response.model_validate_json(r.body(completion("abc", "length")))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "abc"


def test_forced_call_grammar_is_valid_lark_for_llguidance():
    import llguidance as llg

    tools = [
        check_tool(
            "get_weather",
            None,
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "t",
        ),
        check_tool("now", None, None, "t"),
    ]
    for choice, parallel in [(ToolChoice(mode="required"), True), (ToolChoice(mode="named", name="now"), False)]:
        g = forced_call_grammar(tools, choice, parallel=parallel, start="<tool_call>", end="</tool_call>")
        assert g.kind == "lark"
        assert llg.LLMatcher.validate_grammar(llg.grammar_from("lark", g.source)) == ""
    assert isinstance(tools[0], Tool)


def test_a_named_tool_choice_is_one_call_even_with_parallel_calls_allowed():
    """OpenAI's (and vLLM's) meaning of a named choice: one call of it. Left open
    to more, a model that does not stop on its own repeats the call until
    max_tokens (instructor's TOOLS mode then fails on "length")."""
    from types import SimpleNamespace

    from transport.turn.tools import ToolSetup

    tools = [check_tool("now", None, None, "t"), check_tool("later", None, None, "t")]
    markup = SimpleNamespace(start="<tool_call>", end="</tool_call>", json_form=True)
    named = ToolSetup.of(tools, ToolChoice(mode="named", name="now"), None, "tool_choice").constraint(markup)
    required = ToolSetup.of(tools, ToolChoice(mode="required"), None, "tool_choice").constraint(markup)
    assert named is not None and required is not None
    assert named.source.splitlines()[0] == "start: call"
    assert named.source.splitlines()[1] == "call: call0"  # only the named tool
    assert required.source.splitlines()[0] == 'start: call ("\\n" call)*'  # parallel calls stay open
