"""Anthropic Messages: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The request becomes OpenAI-style template messages and a ``ToolSetup``
(transport/anthropic/schema.py), then runs the one road every chat route
runs (transport/turn/road.py); the output is rendered as a Message, or streamed as
Anthropic's events: ``message_start``, ``ping``, per content block
``content_block_start`` / ``content_block_delta`` (``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop
reason, usage) and ``message_stop``. Errors use Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``, as a body or an ``error``
event. ``anthropic-version`` and ``x-api-key`` headers are accepted (the server
itself has no keys).

``usage.input_tokens`` is what the prompt cache did not serve, as Anthropic
counts it: ``input_tokens + cache_read_input_tokens`` is the whole prompt.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api import Completion
from engine.errors import EngineError, InvalidRequest
from engine.types import Delta
from transport.anthropic.schema import (
    CountTokensRequest,
    ErrorBody,
    ErrorInfo,
    MessageBody,
    MessagesRequest,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    Usage,
    template_error,
    tool_input,
)
from transport.turn import cache_miss, road
from transport.turn.chat_turn import matched_stop
from transport.turn.decode import decode_request
from transport.turn.reasoning import OutputSplitter, Reasoning, signature
from transport.turn.road import Admitted, ChatRoute, Opened, Turn
from transport.turn.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Event, Text
from transport.wire.errors import ApiError, from_engine_error
from transport.wire.request_io import count_answer
from transport.wire.sse import Renderer

_encode = msgspec.json.Encoder().encode

# Anthropic's error types by status (529 "overloaded" is theirs; Ember says 503/429).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_bytes(e: ApiError) -> bytes:
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return _encode(ErrorBody(ErrorInfo(type=_ERROR_TYPES.get(e.status, "api_error"), message=message)))


def _endpoint(
    route: str, handler: Callable[[Request, Any], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """Errors in Anthropic's shape; every answer counted by status, like the OpenAI routes."""

    async def endpoint(request: Request) -> Response:
        host = request.app.state.ember
        try:
            response = await handler(request, host)
        except (ApiError, EngineError) as exc:
            err = exc if isinstance(exc, ApiError) else from_engine_error(exc)
            response = Response(error_bytes(err), err.status, headers=err.headers, media_type="application/json")
        except ClientDisconnect:
            response = Response(status_code=400)
        count_answer(request, host, route, response)
        return response

    return endpoint


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


class MessagesRenderer:
    """One request's deltas as a Message body or Anthropic's stream events."""

    done = b""  # Anthropic's stream ends with message_stop, no [DONE]

    def __init__(
        self,
        model: str,
        prompt_tokens: int,
        splitter: CallSplitter | OutputSplitter | None,
        tokenizer: Any,
        stops: list[str],
    ):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.splitter = splitter
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = ""
        self.token_ids: list[int] = []
        self._index = -1
        self._open: str | None = None  # "thinking", "text" or "tool_use"
        self._thinking = ""  # the open thinking block's text, for its signature

    # ---- shared ------------------------------------------------------------
    def _events(self, text: str, final: bool) -> list[Event]:
        if self.splitter is None:
            return [Text(text)] if text else []
        return self.splitter.feed(text) + (self.splitter.finish() if final else [])

    def stop_reason(self, finish: str | None) -> tuple[str | None, str | None]:
        if finish == "length":
            return "max_tokens", None
        if self.splitter is not None and self.splitter.made_calls:
            return "tool_use", None
        stop = matched_stop(self.text, self.token_ids, self.stops, self.tokenizer)
        return ("stop_sequence", stop) if stop is not None else ("end_turn", None)

    def usage(self, u: Any) -> Usage:
        if u is None:
            return Usage(input_tokens=self.prompt_tokens, output_tokens=len(self.token_ids))
        return Usage(
            input_tokens=u.prompt_tokens - u.cached_tokens,
            output_tokens=u.completion_tokens,
            cache_read_input_tokens=u.cached_tokens,
            cache_miss=cache_miss.body(u.cache_miss) if u.cache_miss is not None else msgspec.UNSET,
        )

    # ---- non-streaming -----------------------------------------------------
    def body(self, c: Completion) -> bytes:
        self.text, self.token_ids = c.text, c.token_ids
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        for e in self._events(c.text, True):
            if isinstance(e, Reasoning):
                if content and isinstance(content[-1], ThinkingOut):
                    content[-1].thinking += e.text
                else:
                    content.append(ThinkingOut(thinking=e.text, signature=""))
            elif isinstance(e, Text):
                if content and isinstance(content[-1], TextOut):
                    content[-1].text += e.text
                else:
                    content.append(TextOut(text=e.text))
            elif isinstance(e, CallEnd):
                content.append(ToolUseOut(id=e.id, name=e.name, input=tool_input(e.arguments)))
        for block in content:
            if isinstance(block, ThinkingOut):
                block.signature = signature(block.thinking)
        reason, stop = self.stop_reason(c.finish_reason)
        return _encode(
            MessageBody(
                id=self.id,
                model=self.model,
                content=content,
                stop_reason=reason,
                stop_sequence=stop,
                usage=self.usage(c.usage),
            )
        )

    # ---- streaming ---------------------------------------------------------
    def start(self) -> list[bytes]:
        message = msgspec.to_builtins(
            MessageBody(
                id=self.id,
                model=self.model,
                content=[],
                stop_reason=None,
                stop_sequence=None,
                usage=Usage(input_tokens=self.prompt_tokens, output_tokens=0),
            )
        )
        return [_sse("message_start", {"type": "message_start", "message": message}), _sse("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # a thinking block ends with its signature, as Anthropic's do
            out.append(self._delta({"type": "signature_delta", "signature": signature(self._thinking)}))
            self._thinking = ""
        self._open = None
        return out + [_sse("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + [
            _sse("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        ]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def delta(self, d: Delta) -> list[bytes]:
        self.text += d.text
        self.token_ids += d.token_ids
        final = d.finish_reason is not None
        out: list[bytes] = []
        for e in self._events(d.text, final):
            if isinstance(e, Reasoning):
                if self._open != "thinking":
                    out += self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self._thinking += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Text):
                if self._open != "text":
                    out += self._open_block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                out += self._open_block("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            elif isinstance(e, CallArgs):
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
            elif isinstance(e, CallEnd):
                out += self._close()
        if final:
            out += self._close()
            reason, stop = self.stop_reason(d.finish_reason)
            usage = msgspec.to_builtins(self.usage(d.usage))
            out.append(
                _sse(
                    "message_delta",
                    {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop}, "usage": usage},
                )
            )
            out.append(_sse("message_stop", {"type": "message_stop"}))
        return out

    def error(self, exc: EngineError) -> list[bytes]:
        return [b"event: error\ndata: " + error_bytes(from_engine_error(exc)) + b"\n\n"]


# ---------------------------------------------------------------------------
# Routes: the door onto the one road (transport/turn/road.py).


class Messages(ChatRoute):
    name = "messages"
    call_id_prefix = "toolu_"
    request_type: type = MessagesRequest

    def decode(self, body: bytes, host: Any) -> MessagesRequest | CountTokensRequest:
        return decode_request(body, self.request_type)

    def turn(self, o: Opened) -> Turn:
        """System messages where they stand, or — for a template that refuses a
        non-leading system message — as reminders in the neighbouring user turn
        (``template_messages(reminders=True)``); ``thinking`` as the template's
        reasoning switch."""
        req = o.req
        setup = req.tool_setup()
        req.system_text(o.note)  # counts the volatile head lines taken out
        req.note_envelope(o.note)

        def retry(exc: InvalidRequest) -> list[dict[str, Any]] | None:
            if not (req.inner_system and template_error(exc)):
                return None
            return req.template_messages(setup, reminders=True)

        return Turn(
            messages=req.template_messages(setup),
            tools=setup,
            thinking=req.thinking_choice(),
            thinking_field="thinking",
            retry=retry,
            retry_note=("messages[].role=system", "canonicalised"),  # rendered as a <system-reminder>
        )

    def encoder(self, a: Admitted) -> Renderer:
        o = a.opened
        return MessagesRenderer(o.model, len(a.prompt), a.splitter(), o.engine.tokenizer, a.params.stop)


class CountTokens(Messages):
    """``count_tokens``: the prompt ``/v1/messages`` would run, counted."""

    request_type = CountTokensRequest


MESSAGES = Messages()
COUNT_TOKENS = CountTokens()


async def messages(request: Request, host: Any) -> Response:
    return await road.run_turn(request, host, MESSAGES)


async def count_tokens(request: Request, host: Any) -> Response:
    prompt = await road.count_prompt(request, host, COUNT_TOKENS)
    return Response(_encode({"input_tokens": len(prompt)}), media_type="application/json")


def routes() -> list[Route]:
    return [
        Route("/v1/messages", _endpoint("messages", messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _endpoint("messages_count_tokens", count_tokens), methods=["POST"]),
    ]
