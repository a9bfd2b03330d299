"""OpenAI Responses: ``POST /v1/responses``, stateless.

The input items become template messages and a ``ToolSetup``
(transport/responses_schema.py) and run like a chat completion
(transport/chat_turn.py). Output: a ``message`` item with one ``output_text``
part for the text, then one ``function_call`` item per call. Streaming sends
the typed events in OpenAI's order — ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, (for text)
``response.content_part.added`` / ``response.output_text.delta``… /
``response.output_text.done`` / ``response.content_part.done``, (for a call)
``response.function_call_arguments.delta``… / ``.done``, then
``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short), each with a
``sequence_number``. Errors use OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api import Completion
from engine.errors import EngineError
from engine.types import Delta
from transport import chat_turn
from transport.errors import from_engine_error
from transport.limits import output_limit
from transport.metrics import TokenTimer
from transport.openai_schema import decode_request
from transport.reasoning import OutputSplitter, Reasoning
from transport.responses_schema import ResponsesRequest
from transport.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Event, Text

_encode = msgspec.json.Encoder().encode


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesRenderer:
    done = b""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, model: str, req: ResponsesRequest, splitter: CallSplitter | OutputSplitter | None):
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.req = req
        self.splitter = splitter
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items, as they are so far
        self._text_item: dict[str, Any] | None = None  # the open message item
        self._reasoning_item: dict[str, Any] | None = None  # the open reasoning item
        self._calls: dict[int, dict[str, Any]] = {}  # call index → its function_call item

    # ---- the response object ----------------------------------------------
    def response(self, status: str, usage: Any = None, finish: str | None = None) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self.output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
            "tools": [msgspec.to_builtins(t) for t in req.tools or []],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": self._usage(usage) if usage is not None else None,
        }

    @staticmethod
    def _usage(u: Any) -> dict[str, Any]:
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
        }

    def _status(self, finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    # ---- events → items ----------------------------------------------------
    def _events(self, text: str, final: bool) -> list[Event]:
        if self.splitter is None:
            return [Text(text)] if text else []
        return self.splitter.feed(text) + (self.splitter.finish() if final else [])

    def _apply(self, e: Event, out: list[tuple[str, dict[str, Any]]]) -> None:
        """Update the items by one event; ``out`` gets the stream events it makes."""
        if isinstance(e, Reasoning):
            self._reason(e.text, out)
            return
        self._close_reasoning(out)
        if isinstance(e, Text):
            item = self._text_item
            if item is None:
                item = {
                    "id": _id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                self._text_item = item
                self.output.append(item)
                idx = len(self.output) - 1
                out.append(("response.output_item.added", {"output_index": idx, "item": _copy(item)}))
                item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(
                    (
                        "response.content_part.added",
                        {"item_id": item["id"], "output_index": idx, "content_index": 0, "part": part},
                    )
                )
            item["content"][0]["text"] += e.text
            out.append(
                (
                    "response.output_text.delta",
                    {
                        "item_id": item["id"],
                        "output_index": self.output.index(item),
                        "content_index": 0,
                        "delta": e.text,
                        "logprobs": [],
                    },
                )
            )
        elif isinstance(e, CallStart):
            self._close_text(out)
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": e.id,
                "name": e.name,
                "arguments": "",
            }
            self._calls[e.index] = item
            self.output.append(item)
            out.append(("response.output_item.added", {"output_index": len(self.output) - 1, "item": _copy(item)}))
        elif isinstance(e, CallArgs):
            item = self._calls[e.index]
            item["arguments"] += e.text
            out.append(
                (
                    "response.function_call_arguments.delta",
                    {"item_id": item["id"], "output_index": self.output.index(item), "delta": e.text},
                )
            )
        elif isinstance(e, CallEnd):
            item = self._calls[e.index]
            item["arguments"] = e.arguments
            item["status"] = "completed"
            idx = self.output.index(item)
            out.append(
                (
                    "response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": idx, "name": item["name"], "arguments": e.arguments},
                )
            )
            out.append(("response.output_item.done", {"output_index": idx, "item": _copy(item)}))

    def _reason(self, text: str, out: list[tuple[str, dict[str, Any]]]) -> None:
        """A ``reasoning`` item with one ``reasoning_text`` part (openai.types.responses)."""
        item = self._reasoning_item
        if item is None:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            self._reasoning_item = item
            self.output.append(item)
            out.append(("response.output_item.added", {"output_index": len(self.output) - 1, "item": _copy(item)}))
            item["content"].append({"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += text
        out.append(
            (
                "response.reasoning_text.delta",
                {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0, "delta": text},
            )
        )

    def _close_reasoning(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        item, self._reasoning_item = self._reasoning_item, None
        if item is None:
            return
        idx = self.output.index(item)
        item["status"] = "completed"
        text = item["content"][0]["text"]
        out.append(
            (
                "response.reasoning_text.done",
                {"item_id": item["id"], "output_index": idx, "content_index": 0, "text": text},
            )
        )
        out.append(("response.output_item.done", {"output_index": idx, "item": _copy(item)}))

    def _close_text(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        self._close_reasoning(out)
        item, self._text_item = self._text_item, None
        if item is None:
            return
        idx = self.output.index(item)
        part = item["content"][0]
        item["status"] = "completed"
        out.append(
            (
                "response.output_text.done",
                {"item_id": item["id"], "output_index": idx, "content_index": 0, "text": part["text"], "logprobs": []},
            )
        )
        out.append(
            (
                "response.content_part.done",
                {"item_id": item["id"], "output_index": idx, "content_index": 0, "part": _copy(part)},
            )
        )
        out.append(("response.output_item.done", {"output_index": idx, "item": _copy(item)}))

    def _sse(self, kind: str, payload: dict[str, Any]) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    # ---- non-streaming -----------------------------------------------------
    def body(self, c: Completion) -> bytes:
        scratch: list[tuple[str, dict[str, Any]]] = []
        for e in self._events(c.text, True):
            self._apply(e, scratch)
        self._close_text(scratch)
        return _encode(self.response(self._status(c.finish_reason), c.usage, c.finish_reason))

    # ---- streaming ---------------------------------------------------------
    def start(self) -> list[bytes]:
        snapshot = self.response("in_progress")
        return [
            self._sse("response.created", {"response": snapshot}),
            self._sse("response.in_progress", {"response": snapshot}),
        ]

    def delta(self, d: Delta) -> list[bytes]:
        final = d.finish_reason is not None
        events: list[tuple[str, dict[str, Any]]] = []
        for e in self._events(d.text, final):
            self._apply(e, events)
        if final:
            self._close_text(events)
            status = self._status(d.finish_reason)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            events.append((kind, {"response": self.response(status, d.usage, d.finish_reason)}))
        return [self._sse(k, p) for k, p in events]

    def error(self, exc: EngineError) -> list[bytes]:
        err = from_engine_error(exc)
        return [self._sse("error", {"code": err.code, "message": err.message, "param": err.param})]


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event (the item keeps changing after it is sent)."""
    return msgspec.json.decode(_encode(obj))


async def responses(request: Request, host: Any) -> Response:
    from transport.http import read_body

    engine = host.require_engine()
    timer = TokenTimer(host.metrics, engine.clock.now)
    req: ResponsesRequest = decode_request(await read_body(request, host.max_body_bytes), ResponsesRequest)
    model = host.check_model(req.model)
    setup = req.tool_setup()
    thinking = chat_turn.thinking_kwargs(host, engine, "responses", "reasoning", req.thinking_choice())
    prompt = await host.chat_prompt(engine, req.template_messages(), setup, param="input", template_kwargs=thinking)
    limit = output_limit(req.max_output_tokens, len(prompt), engine.info.context_length, host.default_max_tokens)
    params = msgspec.structs.replace(req.sampling_params(limit, engine.info.vocab_size), max_tokens=limit)
    params = chat_turn.with_constraint(engine, params, req.constraint(), "text.format")
    params = chat_turn.tool_params(engine, params, setup)
    stream = await chat_turn.submit(engine, prompt, params, req.param_names(setup.forced))
    renderer = ResponsesRenderer(model, req, chat_turn.splitter(engine, setup, prompt=prompt))
    return await chat_turn.respond(request, host, engine, prompt, stream, renderer, req.stream, timer)


def routes(endpoint: Any) -> list[Route]:
    """``endpoint`` is the OpenAI routes' wrapper (errors in OpenAI's shape)."""
    return [Route("/v1/responses", endpoint("responses", responses), methods=["POST"])]
