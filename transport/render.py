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
    TextChoice,
    TextCompletion,
    UsageBody,
)
from transport.sse import event

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
    prefix = "chatcmpl"

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageBody | None = None) -> bytes:
        return event(_encode(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)))

    def start(self) -> list[bytes]:
        # Sent at once, before the prefill: the client sees the stream open.
        return [self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))])]

    def delta(self, d: Delta) -> list[bytes]:
        out = []
        if d.text:
            out.append(self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(content=d.text))]))
        if d.finish_reason is not None:
            out.append(self._chunk([ChatChunkChoice(index=0, delta=ChunkDelta(), finish_reason=d.finish_reason)]))
            if self.include_usage and d.usage is not None:
                out.append(self._chunk([], UsageBody.of(d.usage)))
        return out

    def body(self, c: Completion) -> bytes:
        return _encode(
            ChatCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[ChatChoice(index=0, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason)],
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
