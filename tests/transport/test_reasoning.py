"""Reasoning models (transport/turn/reasoning.py): the ``<think>`` section streams as
``reasoning_content`` (chat), ``thinking`` blocks (Anthropic) and ``reasoning``
items (Responses), never inside the answer, and tool calls after ``</think>``
still parse.

Renderer tests fabricate the model's text by hand and judge every chunk, event
and body with the official SDKs' pydantic types and stream accumulators. The
end-to-end tests serve a random-weight tiny Qwen3 (mlx-lm's own model class,
sims/tiny_archs.py) whose tokenizer has ``<think>``/``</think>`` and whose
template opens the reasoning in the generation prompt (DeepSeek-R1 /
Qwen3-Thinking style) unless ``enable_thinking`` is false: the output starts
inside the reasoning, so what the random model writes is reasoning; with
thinking turned off on each route, it is the answer."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import anthropic.types
import httpx
import openai.types.chat
import openai.types.responses
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai.lib.streaming.responses._responses import ResponseStreamState

from ember import EngineConfig
from engine.tool_markup import ReasoningMarkup
from tests.transport.test_agent_render import (
    ARGS_1,
    MARKUP,
    STEPS,
    TOK,
    _responses_request,
    completion,
    deltas,
    sse_payloads,
)
from transport.anthropic.api import MessagesRenderer
from transport.openai.render import ChatRenderer
from transport.responses.api import ResponsesRenderer
from transport.server.http import build_app
from transport.turn.reasoning import OutputSplitter, Reasoning
from transport.turn.tool_calls import CallEnd, CallSplitter, Text

THINK = ReasoningMarkup(start="<think>", end="</think>")
THOUGHT = "The user wants weather.\nCall get_weather."
MODEL_TEXT = (
    f"<think>\n{THOUGHT}\n</think>\n\nLet me check.<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {ARGS_1}}}\n</tool_call>'
)
ANTHROPIC_EVENT = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
RESPONSE_EVENT = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)


def splitter(prefix: str = "call_") -> OutputSplitter:
    return OutputSplitter(THINK, CallSplitter(MARKUP, id_prefix=prefix))


@pytest.mark.parametrize("step", STEPS)
def test_reasoning_text_and_calls_do_not_depend_on_chunking(step):
    s = splitter()
    events = [e for d in deltas(MODEL_TEXT, step) for e in s.feed(d.text)] + s.finish()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == THOUGHT
    assert "".join(e.text for e in events if isinstance(e, Text)) == "Let me check."
    assert [(e.name, e.arguments) for e in events if isinstance(e, CallEnd)] == [("get_weather", ARGS_1)]
    # a prompt that opened the reasoning: the output starts inside it; a second <think> is answer text
    s = OutputSplitter(THINK, None, inside=True)
    events = [e for d in deltas("hmm</think>ok <think>", step) for e in s.feed(d.text)] + s.finish()
    assert "".join(e.text for e in events if isinstance(e, Reasoning)) == "hmm"
    assert "".join(e.text for e in events if isinstance(e, Text)) == "ok <think>"


@pytest.mark.parametrize("step", STEPS)
def test_chat_stream_and_body_carry_reasoning_content(step):
    r = ChatRenderer("m", splitter=splitter)
    payloads = sse_payloads(r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)])
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(p) for p in payloads]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (THOUGHT, "Let me check.")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    body = openai.types.chat.ChatCompletion.model_validate_json(
        ChatRenderer("m", splitter=splitter).body(completion(MODEL_TEXT))
    )
    msg = body.choices[0].message
    assert msg.model_extra["reasoning_content"] == THOUGHT and msg.content == "Let me check."
    assert json.loads(msg.tool_calls[0].function.arguments) == json.loads(ARGS_1)


@pytest.mark.parametrize("step", STEPS)
def test_anthropic_thinking_blocks(step):
    r = MessagesRenderer("m", 30, splitter("toolu_"), TOK, [])
    snapshot, bufs = None, {}
    for p in sse_payloads(r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)]):
        if p["type"] != "ping":
            snapshot = accumulate_event(
                event=ANTHROPIC_EVENT.validate_python(p), current_snapshot=snapshot, json_bufs=bufs
            )
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == THOUGHT and snapshot.content[0].signature
    assert snapshot.content[1].text == "Let me check." and snapshot.stop_reason == "tool_use"
    msg = anthropic.types.Message.model_validate_json(
        MessagesRenderer("m", 30, splitter("toolu_"), TOK, []).body(completion(MODEL_TEXT))
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == THOUGHT and msg.content[0].signature == snapshot.content[0].signature


@pytest.mark.parametrize("step", STEPS)
def test_responses_reasoning_items(step):
    r = ResponsesRenderer("m", _responses_request(), splitter())
    payloads = sse_payloads(r.start() + [b for d in deltas(MODEL_TEXT, step) for b in r.delta(d)])
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for p in payloads:
        state.handle_event(RESPONSE_EVENT.validate_python(p))
    assert "response.reasoning_text.delta" in {p["type"] for p in payloads}
    final = openai.types.responses.Response.model_validate(payloads[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == "Let me check."
    body = openai.types.responses.Response.model_validate_json(
        ResponsesRenderer("m", _responses_request(), splitter()).body(completion(MODEL_TEXT))
    )
    assert [o.type for o in body.output] == ["reasoning", "message", "function_call"]


# ---------------------------------------------------------------------------
# A tiny random-weight Qwen3 with a thinking template, end to end.

THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the real MLX backend runs in threads


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> pathlib.Path:
    from tokenizers import AddedToken, Tokenizer

    from sims.tiny_archs import VOCAB, build

    out = build("qwen3", tmp_path_factory.mktemp("qwen3think") / "qwen3", vocab_size=VOCAB + 8)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out


@pytest.fixture
async def served(thinking_model) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = build_app(EngineConfig(backend="mlx", model=str(thinking_model)))
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember", timeout=120) as c:
            yield app, c


Q = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.mark.anyio
async def test_reasoning_and_its_switch_on_all_three_routes(served):
    app, client = served
    assert app.state.ember.engine.tokenizer.reasoning_markup == THINK  # mlx-lm's has_thinking / think_start / think_end
    r = await client.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] == "", msg
    on_tokens = r.json()["usage"]["prompt_tokens"]
    for off in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = await client.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8, **off})
        msg = r.json()["choices"][0]["message"]
        assert "reasoning_content" not in msg and msg["content"], msg
        assert r.json()["usage"]["prompt_tokens"] > on_tokens  # the template wrote the empty <think></think>
    r = await client.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    assert streamed and not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])

    body = {"messages": Q, "max_tokens": 8}
    msg = anthropic.types.Message.model_validate((await client.post("/v1/messages", json=body)).json())
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].signature
    off = {**body, "thinking": {"type": "disabled"}}
    msg = anthropic.types.Message.model_validate((await client.post("/v1/messages", json=off)).json())
    assert [b.type for b in msg.content] == ["text"]

    body = {"input": "Why is the sky blue?", "max_output_tokens": 8}
    resp = openai.types.responses.Response.model_validate((await client.post("/v1/responses", json=body)).json())
    assert [o.type for o in resp.output] == ["reasoning"]
    off = {**body, "reasoning": {"effort": "none"}}
    resp = openai.types.responses.Response.model_validate((await client.post("/v1/responses", json=off)).json())
    assert [o.type for o in resp.output] == ["message"] and resp.output_text

    stats = (await client.get("/stats")).json()["envelope"]
    assert stats["chat"]["chat_template_kwargs:honoured"] == 1 and stats["chat"]["reasoning_effort:honoured"] == 1
    assert stats["messages"]["thinking:honoured"] == 1 and stats["responses"]["reasoning:honoured"] == 1


@pytest.mark.anyio
async def test_an_unknown_template_variable_is_a_400(served):
    _, client = served
    r = await client.post("/v1/chat/completions", json={"messages": Q, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tools", r.text
    r = await client.post("/v1/chat/completions", json={"messages": Q, "chat_template_kwargs": {"enable_thinking": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking", r.text


@pytest.mark.anyio
async def test_reasoning_sent_back_renders_append_only(served):
    """The answer's reasoning, sent back as ``reasoning_content``, renders as the model wrote it
    (this template keeps it): the next turn's cache covers the whole previous turn."""
    app, client = served
    r = await client.post("/v1/chat/completions", json={"messages": Q, "max_tokens": 8})
    first = r.json()
    msg = first["choices"][0]["message"]
    history = [*Q, {"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning_content"]}]
    r = await client.post(
        "/v1/chat/completions", json={"messages": [*history, {"role": "user", "content": "More?"}], "max_tokens": 1}
    )
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]


@pytest.mark.anyio
async def test_anthropic_thinking_sent_back_renders_like_chat_reasoning(served):
    """Claude Code sends the thinking blocks it got back in the assistant turn: they reach the template
    as ``reasoning_content``, the same prompt the chat route renders."""
    _, client = served
    thinking = {"type": "thinking", "thinking": "Rayleigh.", "signature": "abc"}
    assistant = {"role": "assistant", "content": [thinking, {"type": "text", "text": "Scattering."}]}
    body = {"messages": [*Q, assistant, {"role": "user", "content": "More?"}]}
    anthropic_count = (await client.post("/v1/messages/count_tokens", json=body)).json()["input_tokens"]
    chat = [*Q, {"role": "assistant", "content": "Scattering.", "reasoning_content": "Rayleigh."}, body["messages"][2]]
    r = await client.post("/v1/chat/completions", json={"messages": chat, "max_tokens": 1})
    assert anthropic_count == r.json()["usage"]["prompt_tokens"]
    plain = [*Q, {"role": "assistant", "content": "Scattering."}, body["messages"][2]]
    r = await client.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 1})
    assert anthropic_count > r.json()["usage"]["prompt_tokens"]  # the reasoning was rendered, not dropped
