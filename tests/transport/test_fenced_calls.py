"""Tool calls written as plain JSON (transport/turn/fenced_calls.py) through
``CallSplitter``: a ```` ```json ```` or ```` ``` ```` fence, a parallel list, the whole reply
as a bare object; what is not a call of an offered tool stays text byte for
byte; a call that does not parse stays text and is counted. Every text is also
fed split at every character boundary and in random pieces: the events are the
same as from one delta."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from engine.fake.tokenizer import ByteTokenizer
from transport.turn.fenced_calls import MalformedCall, ParsedCall, bare_head, offered_names, read_calls
from transport.turn.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Event, Text
from transport.wire.metrics import ToolCallCounter

MARKUP = ByteTokenizer().tool_markup
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
NAMES = offered_names(TOOLS)
WEATHER = {"city": "Paris"}

FENCED = 'I will check the weather.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
BARE_FENCE = '```\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```\n'
PARALLEL = (
    '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}},\n {"name": "now", "arguments": "{}"}]\n```'
)
BARE = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
BARE_LIST = '[{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Paris"}}]'
# Qwen2.5-Coder-0.5B's answer to Claude Code (CI): calls one per line, the last cut by max_tokens
RUN = '{"name": "now", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
CUT = '{"name": "get_weather", "arguments": {"ci'
PROSE_THEN_BARE = 'I will check.\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
PROSE_THEN_JSON = 'Here is the data:\n{"city": "Paris", "name": "get_weather"}\n'
FENCED_RUN = '```json\n{"name": "now", "arguments": {}},\n{"name": "now", "arguments": {}}\n```'
MARKERS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Qwen2.5-Coder-1.5B's call to Codex (2026-12-05): OpenAI's tool-call wrapper, the values under
# "parameters", the definition's other keys beside them, in <tools> tags
WRAPPED = (
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather.", '
    '"parameters": {"city": "Paris"}, "required": ["city"], "additionalProperties": false}}\n'
    "</tools>\n<output>\n"
)
# a tool's definition written back: a schema under "parameters" is not a call
DEFINITION = '{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}'

# not calls: text, byte for byte
ASKED_JSON = 'Here it is:\n```json\n{"city": "Paris", "name": "x"}\n```\nDone.'
NOT_OFFERED = '```json\n{"name": "delete_everything", "arguments": {}}\n```'
CODE = "Run:\n```python\nprint('```')\n```\nthen\n```\nls -la\n```\n"
JSON_ANSWER = '{"city": "Paris", "days": 3}'
LIST_ANSWER = '[{"name": "Ada"}, {"name": "Bob"}]'
BARE_THEN_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris"}} is how you would call it.'

# names an offered tool, does not parse: text, counted
BROKEN_JSON = '```json\n{"name": "get_weather", "arguments": {"city": }}\n```'
BROKEN_ARGS = '```json\n{"name": "get_weather", "arguments": "{city: Paris}"}\n```'
NO_ARGS = '```json\n{"name": "now"}\n```'
BROKEN_MARKERS = "Sure.<tool_call>\nnot json at all\n</tool_call>"


def norm(events: list[Event]) -> list[tuple[Any, ...]]:
    """Events independent of how the text was cut: text runs joined, a call's
    argument pieces joined; ids checked to match and left out."""
    out: list[tuple[Any, ...]] = []
    starts: dict[int, CallStart] = {}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, Text):
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + e.text)
            else:
                out.append(("text", e.text))
        elif isinstance(e, CallStart):
            starts[e.index] = e
            args[e.index] = ""
        elif isinstance(e, CallArgs):
            args[e.index] += e.text
        elif isinstance(e, CallEnd):
            assert starts[e.index].id == e.id and args[e.index] == e.arguments
            out.append(("call", e.index, e.name, e.arguments))
    return out


def split(text: str, pieces: list[str], **kw: Any) -> tuple[list[tuple[Any, ...]], list[tuple[str, str]], CallSplitter]:
    notes: list[tuple[str, str]] = []
    s = CallSplitter(MARKUP, kw.pop("tools", TOOLS), count=lambda form, kind: notes.append((form, kind)), **kw)
    events: list[Event] = []
    for p in pieces:
        events += s.feed(p)
    events += s.finish()
    assert "".join(pieces) == text
    return norm(events), notes, s


def whole(text: str, **kw: Any) -> tuple[list[tuple[Any, ...]], list[tuple[str, str]], CallSplitter]:
    return split(text, [text], **kw)


def call(index: int, name: str, arguments: dict[str, Any]) -> tuple[Any, ...]:
    return ("call", index, name, json.dumps(arguments))


ALL = [
    FENCED,
    BARE_FENCE,
    PARALLEL,
    BARE,
    BARE_LIST,
    MARKERS,
    ASKED_JSON,
    NOT_OFFERED,
    CODE,
    JSON_ANSWER,
    LIST_ANSWER,
    BARE_THEN_TEXT,
    RUN,
    RUN + CUT,
    FENCED_RUN,
    PROSE_THEN_BARE,
    PROSE_THEN_JSON,
    BROKEN_JSON,
    BROKEN_ARGS,
    NO_ARGS,
    BROKEN_MARKERS,
    WRAPPED,
    DEFINITION,
    f"Checking.\n{MARKERS}\n```json\n{PARALLEL[8:]}",  # markers, then a fenced list
]


@pytest.mark.parametrize("text", ALL, ids=range(len(ALL)))
def test_every_split_point_gives_the_events_of_one_delta(text):
    want = whole(text)
    for k in range(len(text) + 1):
        assert split(text, [text[:k], text[k:]])[:2] == want[:2], k
    assert split(text, list(text))[:2] == want[:2]  # one character a delta


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL), st.lists(st.integers(0, 200), max_size=12), st.booleans())
def test_any_chunking_gives_the_events_of_one_delta(text, cuts, single):
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert split(text, pieces, single=single)[:2] == whole(text, single=single)[:2]


def test_a_fenced_object_after_a_sentence_is_a_call():
    events, notes, s = whole(FENCED)
    assert events == [("text", "I will check the weather.\n"), call(0, "get_weather", WEATHER)]
    assert notes == [("fence", "calls")] and s.made_calls


def test_a_bare_fence_and_the_parameters_alias():
    events, notes, _ = whole(BARE_FENCE)
    assert events == [call(0, "get_weather", WEATHER)]  # the newline after the call is not content
    assert notes == [("fence", "calls")]


def test_a_fenced_list_is_parallel_calls_with_string_arguments_kept_as_written():
    events, notes, _ = whole(PARALLEL)
    assert events == [call(0, "get_weather", WEATHER), ("call", 1, "now", "{}")]
    assert notes == [("fence", "calls")] * 2


@pytest.mark.parametrize(
    "text,want",
    [
        (BARE, [call(0, "get_weather", WEATHER)]),
        (BARE_LIST, [call(0, "now", {}), call(1, "get_weather", WEATHER)]),
    ],
)
def test_a_whole_reply_that_is_a_bare_call(text, want):
    events, notes, _ = whole(text)
    assert events == want and notes == [("bare", "calls")] * len(want)


@pytest.mark.parametrize("text", [ASKED_JSON, NOT_OFFERED, CODE, JSON_ANSWER, LIST_ANSWER])
def test_what_is_not_a_call_of_an_offered_tool_stays_text_byte_for_byte(text):
    events, notes, s = whole(text)
    assert events == [("text", text)] and notes == [] and not s.made_calls


def test_a_bare_call_then_prose_is_the_call_and_the_prose():
    events, notes, s = whole(BARE_THEN_TEXT)
    assert events == [call(0, "get_weather", WEATHER), ("text", " is how you would call it.")] and s.made_calls
    assert notes == [("bare", "calls")]


def test_calls_one_after_another_are_parallel_calls():
    events, notes, s = whole(RUN)
    assert events == [call(0, "now", {}), call(1, "get_weather", WEATHER)] and s.made_calls
    assert notes == [("bare", "calls")] * 2
    events, notes, _ = whole(FENCED_RUN)  # a comma between them too
    assert events == [call(0, "now", {}), call(1, "now", {})] and notes == [("fence", "calls")] * 2


def test_whole_calls_then_one_cut_short_are_the_calls_and_counted_text():
    events, notes, s = whole(RUN + CUT)
    assert events == [call(0, "now", {}), call(1, "get_weather", WEATHER), ("text", "\n" + CUT)]  # as written
    assert notes == [("bare", "calls")] * 2 + [("bare", "parse_failures")] and s.made_calls


def test_a_bare_call_on_its_own_line_after_prose_is_a_call():
    events, notes, _ = whole(PROSE_THEN_BARE)
    assert events == [("text", "I will check.\n"), call(0, "get_weather", WEATHER)]
    assert notes == [("bare", "calls")]
    events, _, _ = whole(RUN + "Then:\n" + BARE.strip())  # what follows a run is read again
    assert [e[:3] for e in events] == [
        ("call", 0, "now"),
        ("call", 1, "get_weather"),
        ("text", "\nThen:\n"),
        ("call", 2, "get_weather"),
    ]


def test_a_call_in_openai_s_wrapper_is_the_call_inside_it():
    events, notes, s = whole(WRAPPED)
    assert events == [("text", "<tools>\n"), call(0, "get_weather", WEATHER), ("text", "\n</tools>\n<output>\n")]
    assert notes == [("bare", "calls")] and s.made_calls
    events, notes, _ = whole(DEFINITION)  # a schema where the arguments go: the definition, text as written
    assert events == [("text", DEFINITION)] and notes == []


def test_json_after_prose_that_is_not_a_call_stays_text():
    events, notes, s = whole(PROSE_THEN_JSON)
    assert events == [("text", PROSE_THEN_JSON)] and notes == [] and not s.made_calls


@pytest.mark.parametrize("text", [BROKEN_JSON, BROKEN_ARGS, NO_ARGS])
def test_a_fenced_call_that_does_not_parse_is_text_and_a_counted_failure(text):
    events, notes, s = whole(text)
    assert events == [("text", text)] and notes == [("fence", "parse_failures")] and not s.made_calls


def test_markers_that_do_not_parse_are_text_as_written_and_a_counted_failure():
    events, notes, s = whole(BROKEN_MARKERS)
    assert events == [("text", BROKEN_MARKERS)] and notes == [("markers", "parse_failures")]
    assert not s.made_calls


def test_markers_still_read_and_counted_and_a_call_inside_a_fence_is_the_markers_call():
    events, notes, _ = whole(MARKERS)
    assert events == [call(0, "get_weather", WEATHER)] and notes == [("markers", "calls")]
    fenced = f"```\n{MARKERS}\n```"
    events, notes, _ = whole(fenced)
    assert events == [("text", "```\n"), call(0, "get_weather", WEATHER), ("text", "\n```")]
    assert notes == [("markers", "calls")]


def test_markers_then_a_fenced_list_share_one_index_sequence():
    events, _, _ = whole(ALL[-1])
    assert [e[:3] for e in events] == [
        ("text", "Checking.\n"),
        ("call", 0, "get_weather"),
        ("call", 1, "get_weather"),
        ("call", 2, "now"),
    ]


def test_single_keeps_the_first_call_of_a_list_and_drops_the_rest():
    events, notes, s = whole(PARALLEL + "\nand more text", single=True)
    assert events == [call(0, "get_weather", WEATHER)] and notes == [("fence", "calls")]
    assert s.dropped_chars > 0
    events, _, s = whole(FENCED + "\n" + MARKERS, single=True)  # a fenced call, then one in markers
    assert [e[0] for e in events] == ["text", "call"] and s.dropped_chars >= len(MARKERS)


def test_without_tools_nothing_but_markers_is_read():
    for text in (FENCED, BARE, PARALLEL):
        events, notes, s = whole(text, tools=None)
        assert events == [("text", text)] and notes == [] and not s.made_calls


def test_text_before_a_fence_streams_and_the_fence_is_held_until_it_closes():
    s = CallSplitter(MARKUP, TOOLS)
    assert s.feed("Sure, let me look.\n```js") == [Text("Sure, let me look.\n")]
    assert s.feed('on\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n``') == []
    events = s.feed("`\n")
    assert [type(e) for e in events] == [CallStart, CallArgs, CallEnd]


def test_a_tick_at_a_delta_boundary_is_held_and_code_streams_before_its_fence_closes():
    s = CallSplitter(MARKUP, TOOLS)
    assert s.feed("a\n`") == [Text("a\n")]
    assert s.feed("``python\npri") == [Text("```python\npri")]  # another language: streams
    s = CallSplitter(MARKUP, TOOLS)
    assert s.feed("```\nls -la") == [Text("```\nls -la")]  # a bare fence holding code, not JSON: streams
    s = CallSplitter(MARKUP, TOOLS)
    assert s.feed(JSON_ANSWER[:6]) == [Text(JSON_ANSWER[:6])]  # a JSON answer, not a call: streams at once
    s = CallSplitter(MARKUP, TOOLS)
    assert s.feed(BARE[:-10]) == []  # it starts as a call of an offered tool: held to the end


def test_a_fence_left_open_at_the_end_is_decided_as_it_stands():
    events, notes, _ = whole(FENCED[: -len("```")])  # the model stopped before the closing fence
    assert events[-1] == call(0, "get_weather", WEATHER) and notes == [("fence", "calls")]
    cut = FENCED[: FENCED.index('"Paris"')]  # cut off (max tokens) inside the arguments
    events, notes, _ = whole(cut)
    assert events == [("text", cut)] and notes == [("fence", "parse_failures")]


def test_read_calls_and_bare_head():
    assert read_calls('{"name": "now", "arguments": {}}', NAMES) == (ParsedCall(name="now", arguments="{}"),)
    assert read_calls('{"name": "later", "arguments": {}}', NAMES) is None
    assert read_calls("[]", NAMES) is None and read_calls("3", NAMES) is None
    with pytest.raises(MalformedCall):
        read_calls('[{"name": "now", "arguments": {}}, {"x": 1}]', NAMES)
    with pytest.raises(MalformedCall):
        read_calls('{"name": "now", "arguments": [1]}', NAMES)
    assert bare_head('  [ {"name": "no', NAMES) is None  # "now" still possible
    assert bare_head('{"name": "nop', NAMES) is False
    assert bare_head('{"name": "now"', NAMES) is True
    assert bare_head('{"nam', NAMES) is None and bare_head('{"city"', NAMES) is False
    assert offered_names([{"name": "bare"}, {"function": {"name": "f"}}, "junk"]) == {"bare", "f"}
    wrapped = '{"type": "function", "function": {"name": "now", "arguments": {}}}'
    assert read_calls(wrapped, NAMES) == (ParsedCall(name="now", arguments="{}"),)
    assert bare_head(wrapped[:30], NAMES) is None and bare_head(wrapped, NAMES) is True
    assert bare_head('{"type": "object", "name": "now"', NAMES) is False
    with pytest.raises(MalformedCall):  # wrapped, names an offered tool, not JSON: counted
        read_calls('{"type": "function", "function": {"name": "now", "arguments": {x}}}', NAMES)


def test_the_counter_in_prometheus_and_stats():
    counter = ToolCallCounter()
    count = counter.for_route("chat")
    count("fence", "calls")
    count("fence", "calls")
    counter.for_route("messages")("markers", "parse_failures")
    assert counter.snapshot() == {"calls": {"chat": {"fence": 2}}, "parse_failures": {"messages": {"markers": 1}}}
    registry = CollectorRegistry()
    registry.register(counter)
    text = generate_latest(registry).decode()
    assert 'ember_tool_calls_total{form="fence",route="chat"} 2.0' in text
    assert 'ember_tool_call_parse_failures_total{form="markers",route="messages"} 1.0' in text
    with pytest.raises(ValueError):
        count("fence", "called")


def test_a_reasoning_model_s_fenced_call_after_its_thinking():
    from engine.tool_markup import ReasoningMarkup
    from transport.turn.reasoning import OutputSplitter, Reasoning

    text = "<think>\nThe user wants the weather.\n</think>\n\n" + FENCED
    for pieces in ([text], list(text)):
        s = OutputSplitter(ReasoningMarkup("<think>", "</think>"), CallSplitter(MARKUP, TOOLS))
        events = [e for p in pieces for e in s.feed(p)] + s.finish()
        assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "The user wants the weather."
        assert norm([e for e in events if not isinstance(e, Reasoning)]) == [
            ("text", "I will check the weather.\n"),
            call(0, "get_weather", WEATHER),
        ]


def test_a_long_fence_is_held_line_after_line_until_it_closes():
    s = CallSplitter(MARKUP, TOOLS)
    s.feed('```json\n{"name": "get_weather", "arguments": {"city": "')
    for _ in range(2000):
        assert s.feed("ab\n") == []  # held: still the fence
    events = norm(s.feed('"}}\n```') + s.finish())
    assert [e[0] for e in events] == ["text"]  # a raw newline inside a JSON string: not JSON, not a call


def test_a_streamed_markers_call_whose_arguments_are_not_json_goes_out_and_is_counted():
    text = '<tool_call>\n{"name": "now", "arguments": {"a": }}\n</tool_call>'
    events, notes, _ = whole(text)
    assert events == [("call", 0, "now", '{"a": }')]  # its name and arguments streamed before the end marker
    assert sorted(notes) == [("markers", "calls"), ("markers", "parse_failures")]
