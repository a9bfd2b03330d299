"""Engine deltas rendered as OpenAI chat / text completion bodies and chunks.

A renderer serves one request and all its ``n`` choices: ``rids`` lists the
rows in choice order (a delta's ``rid`` is its choice). ``token_bytes`` turns
token ids into their bytes for logprobs (``Engine.token_bytes``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from ember.api import Completion
from engine.errors import EngineError
from engine.types import Delta, TokenLogprob, Usage
from transport.openai.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatTokenLogprob,
    ChoiceLogprobs,
    ChunkDelta,
    FunctionCallDelta,
    FunctionCallOut,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    UsageBody,
)
from transport.turn.choices import merge_usage
from transport.turn.reasoning import OutputSplitter, Reasoning
from transport.turn.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Text
from transport.wire.errors import error_body, from_engine_error
from transport.wire.sse import event

_encode = msgspec.json.Encoder().encode


class _Base:
    prefix = ""

    def __init__(
        self,
        model: str,
        include_usage: bool = False,
        *,
        rids: list[int] | None = None,
        token_bytes: Callable[[list[int]], list[bytes]] | None = None,
    ):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.index = {rid: i for i, rid in enumerate(rids or [])}
        self.n = max(1, len(self.index))
        self.token_bytes = token_bytes
        self._usages: list[Usage | None] = []
        self._offset = [0] * self.n  # text completions: chars of each choice's text so far

    def error(self, exc: EngineError) -> list[bytes]:
        return [event(error_body(from_engine_error(exc)))]

    def _finished(self, d: Delta) -> Usage | None:
        """Note a choice's end; the merged usage once every choice has ended."""
        self._usages.append(d.usage)
        return merge_usage(self._usages) if len(self._usages) == self.n else None

    def _chat_logprobs(self, lps: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
        if lps is None:
            return None
        ids = [t.token_id for t in lps] + [i for t in lps for i, _ in t.top]
        raw = dict(zip(ids, self.token_bytes(ids))) if self.token_bytes else {}

        def entry(tid: int) -> tuple[str, list[int] | None]:
            b = raw.get(tid)
            return (b.decode("utf-8", "replace"), list(b)) if b is not None else (str(tid), None)

        content = []
        for t in lps:
            token, b = entry(t.token_id)
            top = [_top(entry(i), lp) for i, lp in t.top]
            content.append(ChatTokenLogprob(token=token, logprob=t.logprob, bytes=b, top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def _text_logprobs(self, lps: list[TokenLogprob] | None, choice: int) -> TextLogprobs | None:
        if lps is None:
            return None
        ids = [t.token_id for t in lps] + [i for t in lps for i, _ in t.top]
        raw = dict(zip(ids, self.token_bytes(ids))) if self.token_bytes else {}
        text = {i: raw[i].decode("utf-8", "replace") if i in raw else str(i) for i in ids}
        offsets = []
        for t in lps:
            offsets.append(self._offset[choice])
            self._offset[choice] += len(text[t.token_id])
        top = [{text[i]: lp for i, lp in t.top} for t in lps] if any(t.top for t in lps) else None
        return TextLogprobs(
            tokens=[text[t.token_id] for t in lps],
            token_logprobs=[t.logprob for t in lps],
            top_logprobs=top,
            text_offset=offsets,
        )


def _top(entry: tuple[str, list[int] | None], lp: float) -> TopLogprob:
    return TopLogprob(token=entry[0], logprob=lp, bytes=entry[1])


def _completions(c: Completion | list[Completion]) -> list[Completion]:
    return c if isinstance(c, list) else [c]


class ChatRenderer(_Base):
    """With ``splitter`` (a factory, one splitter per choice), tool calls in the
    text become ``tool_calls`` (streamed as OpenAI does) and a stop after a call
    finishes as ``tool_calls``."""

    prefix = "chatcmpl"

    def __init__(
        self, *args: Any, splitter: Callable[[], CallSplitter | OutputSplitter | None] | None = None, **kw: Any
    ):
        super().__init__(*args, **kw)
        self.splitters = [splitter() for _ in range(self.n)] if splitter is not None else [None] * self.n

    def _content_deltas(self, i: int, text: str, final: bool) -> list[ChunkDelta]:
        splitter = self.splitters[i]
        if splitter is None:
            return [ChunkDelta(content=text)] if text else []
        out = []
        for e in splitter.feed(text) + (splitter.finish() if final else []):
            if isinstance(e, Text):
                out.append(ChunkDelta(content=e.text))
            elif isinstance(e, Reasoning):
                out.append(ChunkDelta(reasoning_content=e.text))
            elif isinstance(e, CallStart):
                fn = FunctionCallDelta(name=e.name, arguments="")
                out.append(ChunkDelta(tool_calls=[ToolCallDelta(index=e.index, id=e.id, type="function", function=fn)]))
            elif isinstance(e, CallArgs):
                out.append(
                    ChunkDelta(tool_calls=[ToolCallDelta(index=e.index, function=FunctionCallDelta(arguments=e.text))])
                )
            # CallEnd: its pieces already went out
        return out

    def finish_reason(self, i: int, reason: str | None) -> str | None:
        splitter = self.splitters[i]
        if reason == "stop" and splitter is not None and splitter.made_calls:
            return "tool_calls"
        return reason

    def message(self, i: int, c: Completion) -> AssistantMessage:
        splitter = self.splitters[i]
        if splitter is None:
            return AssistantMessage(content=c.text)
        events = splitter.feed(c.text) + splitter.finish()
        text = "".join(e.text for e in events if isinstance(e, Text))
        thought = "".join(e.text for e in events if isinstance(e, Reasoning))
        calls = [
            ToolCallOut(id=e.id, function=FunctionCallOut(name=e.name, arguments=e.arguments))
            for e in events
            if isinstance(e, CallEnd)
        ]
        return AssistantMessage(
            content=(text or None) if calls else text,
            tool_calls=calls or msgspec.UNSET,
            reasoning_content=thought or msgspec.UNSET,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageBody | None = None) -> bytes:
        return event(
            _encode(
                ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
            )
        )

    def start(self) -> list[bytes]:
        # Sent at once, before the prefill: the client sees the stream open.
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))])
            for i in range(self.n)
        ]

    def delta(self, d: Delta) -> list[bytes]:
        out = []
        i = self.index.get(d.rid, 0)
        deltas = self._content_deltas(i, d.text, d.finish_reason is not None)
        if d.logprobs and not deltas:  # the text is held back (a possible call marker): the logprobs are not
            deltas = [ChunkDelta(content="")]
        lps = self._chat_logprobs(d.logprobs)
        for k, delta in enumerate(deltas):
            out.append(self._chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lps if k == 0 else None)]))
        if d.finish_reason is not None:
            reason = self.finish_reason(i, d.finish_reason)
            out.append(self._chunk([ChatChunkChoice(index=i, delta=ChunkDelta(), finish_reason=reason)]))
            usage = self._finished(d)
            if self.include_usage and usage is not None:
                out.append(self._chunk([], UsageBody.of(usage)))
        return out

    def body(self, c: Completion | list[Completion]) -> bytes:
        cs = _completions(c)
        usage = merge_usage([x.usage for x in cs])
        return _encode(
            ChatCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatChoice(
                        index=i,
                        message=self.message(i, x),
                        finish_reason=self.finish_reason(i, x.finish_reason),
                        logprobs=self._chat_logprobs(x.logprobs),
                    )
                    for i, x in enumerate(cs)
                ],
                usage=UsageBody.of(usage) if usage is not None else None,
            )
        )


class CompletionRenderer(_Base):
    prefix = "cmpl"

    def _chunk(self, choices: list[TextChoice], usage: UsageBody | None = None) -> bytes:
        return event(
            _encode(TextCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage))
        )

    def start(self) -> list[bytes]:
        return []

    def delta(self, d: Delta) -> list[bytes]:
        out = []
        i = self.index.get(d.rid, 0)
        if d.text or d.logprobs or d.finish_reason is not None:
            lps = self._text_logprobs(d.logprobs, i)
            out.append(self._chunk([TextChoice(index=i, text=d.text, finish_reason=d.finish_reason, logprobs=lps)]))
        if d.finish_reason is not None:
            usage = self._finished(d)
            if self.include_usage and usage is not None:
                out.append(self._chunk([], UsageBody.of(usage)))
        return out

    def body(self, c: Completion | list[Completion]) -> bytes:
        cs = _completions(c)
        usage = merge_usage([x.usage for x in cs])
        return _encode(
            TextCompletion(
                id=self.id,
                created=self.created,
                model=self.model,
                choices=[
                    TextChoice(
                        index=i, text=x.text, finish_reason=x.finish_reason, logprobs=self._text_logprobs(x.logprobs, i)
                    )
                    for i, x in enumerate(cs)
                ],
                usage=UsageBody.of(usage) if usage is not None else None,
            )
        )
