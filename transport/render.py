"""Engine deltas rendered as OpenAI chat / text completion bodies and chunks."""

from __future__ import annotations

import time
import uuid

import msgspec

from engine.api import Completion
from engine.errors import EngineError
from engine.types import Delta
from transport.errors import error_body, from_engine_error
from transport.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChunkDelta,
    FunctionCallDelta,
    FunctionCallOut,
    TextChoice,
    TextCompletion,
    ToolCallDelta,
    ToolCallOut,
    UsageBody,
)
from transport.sse import event
from transport.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Text

_encode = msgspec.json.Encoder().encode


class _Base:
    prefix = ""

    def __init__(self, model: str, include_usage: bool = False):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def error(self, exc: EngineError) -> list[bytes]:
        return [event(error_body(from_engine_error(exc)))]


class ChatRenderer(_Base):
    """With a ``CallSplitter``, tool calls in the text become ``tool_calls``
    (streamed as OpenAI does) and a stop after a call finishes as ``tool_calls``."""

    prefix = "chatcmpl"

    def __init__(self, model: str, include_usage: bool = False, splitter: CallSplitter | None = None):
        super().__init__(model, include_usage)
        self.splitter = splitter

    def _content_chunks(self, text: str, final: bool) -> list[bytes]:
        if self.splitter is None:
            return [self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(content=text))])] if text else []
        events = self.splitter.feed(text) + (self.splitter.finish() if final else [])
        out = []
        for e in events:
            if isinstance(e, Text):
                delta = ChunkDelta(content=e.text)
            elif isinstance(e, CallStart):
                fn = FunctionCallDelta(name=e.name, arguments="")
                delta = ChunkDelta(tool_calls=[ToolCallDelta(index=e.index, id=e.id, type="function", function=fn)])
            elif isinstance(e, CallArgs):
                delta = ChunkDelta(tool_calls=[ToolCallDelta(index=e.index, function=FunctionCallDelta(arguments=e.text))])
            else:
                continue  # CallEnd: the pieces already went out
            out.append(self._chunk([ChatChunkChoice(index=0, delta=delta)]))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.splitter is not None and self.splitter.made_calls:
            return "tool_calls"
        return reason

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageBody | None = None) -> bytes:
        return event(_encode(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)))

    def start(self) -> list[bytes]:
        # Sent at once, before the prefill: the client sees the stream open.
        return [self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))])]

    def delta(self, d: Delta) -> list[bytes]:
        out = self._content_chunks(d.text, d.finish_reason is not None)
        if d.finish_reason is not None:
            reason = self.finish_reason(d.finish_reason)
            out.append(self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(), finish_reason=reason)]))
            if self.include_usage and d.usage is not None:
                out.append(self._chunk([], UsageBody.of(d.usage)))
        return out

    def message(self, c: Completion) -> AssistantMessage:
        if self.splitter is None:
            return AssistantMessage(content=c.text)
        events = self.splitter.feed(c.text) + self.splitter.finish()
        text = "".join(e.text for e in events if isinstance(e, Text))
        calls = [
            ToolCallOut(id=e.id, function=FunctionCallOut(name=e.name, arguments=e.arguments))
            for e in events
            if isinstance(e, CallEnd)
        ]
        return AssistantMessage(content=(text or None) if calls else text, tool_calls=calls or msgspec.UNSET)

    def body(self, c: Completion) -> bytes:
        message = self.message(c)
        return _encode(
            ChatCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[ChatChoice(index=0, message=message, finish_reason=self.finish_reason(c.finish_reason))],
                usage=UsageBody.of(c.usage) if c.usage is not None else None,
            )
        )


class CompletionRenderer(_Base):
    prefix = "cmpl"

    def _chunk(self, choices: list[TextChoice], usage: UsageBody | None = None) -> bytes:
        return event(_encode(TextCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)))

    def start(self) -> list[bytes]:
        return []

    def delta(self, d: Delta) -> list[bytes]:
        out = []
        if d.text or d.finish_reason is not None:
            out.append(self._chunk([TextChoice(index=0, text=d.text, finish_reason=d.finish_reason)]))
        if d.finish_reason is not None and self.include_usage and d.usage is not None:
            out.append(self._chunk([], UsageBody.of(d.usage)))
        return out

    def body(self, c: Completion) -> bytes:
        return _encode(
            TextCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[TextChoice(index=0, text=c.text, finish_reason=c.finish_reason)],
                usage=UsageBody.of(c.usage) if c.usage is not None else None,
            )
        )
