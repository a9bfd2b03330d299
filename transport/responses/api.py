"""OpenAI Responses: ``POST /v1/responses``.

The input items (after the stored conversation of ``previous_response_id``,
transport/responses/store.py) become template messages and a ``ToolSetup``
(transport/responses/schema.py) and run the one road every chat route runs
(transport/turn/road.py). Output: a ``message`` item with one ``output_text``
part for the text, then one ``function_call`` item per call (with
``namespace`` for a call to a namespaced tool) or ``custom_tool_call`` (with
``input``) for a custom tool. ``store: true`` keeps the whole conversation
under the response's id. Streaming sends
the typed events in OpenAI's order — ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, (for text)
``response.content_part.added`` / ``response.output_text.delta``… /
``response.output_text.done`` / ``response.content_part.done``, (for a call)
``response.function_call_arguments.delta``… / ``.done`` (a custom tool's
call: ``response.custom_tool_call_input.delta`` / ``.done``), then
``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it short), each with a
``sequence_number``. Errors use OpenAI's shape.
"""

from __future__ import annotations

import json
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ember.api import Completion
from engine.errors import EngineError
from engine.types import Delta, SamplingParams
from transport.responses.schema import CUSTOM_INPUT, ResponsesRequest
from transport.responses.store import ResponseNotFound, ResponseStore, stored_id
from transport.turn import cache_miss, chat_turn, road
from transport.turn.decode import decode_request
from transport.turn.reasoning import OutputSplitter, Reasoning
from transport.turn.road import Admitted, ChatRoute, Opened, Turn
from transport.turn.tool_calls import CallArgs, CallEnd, CallSplitter, CallStart, Event, Text
from transport.wire.errors import ApiError, from_engine_error
from transport.wire.sse import Renderer

_encode = msgspec.json.Encoder().encode


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesRenderer:
    done = b""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(
        self,
        model: str,
        req: ResponsesRequest,
        splitter: CallSplitter | OutputSplitter | None,
        on_done: Callable[[str, list[dict[str, Any]]], None] | None = None,
    ):
        self.on_done = on_done  # (response id, output items) once the answer is whole: the store
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
            "previous_response_id": req.previous_response_id,
            "store": bool(req.store),
            "background": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": self._text(fmt),
            "tool_choice": choice if choice is not None else "auto",
            "tools": req.tools or [],
            "truncation": req.truncation or "disabled",
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning is not None else None,
            "prompt_cache_key": req.prompt_cache_key,
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "max_tool_calls": req.max_tool_calls,
            "top_logprobs": req.top_logprobs,
            "user": req.user,
            "metadata": req.metadata or {},
            "usage": self._usage(usage) if usage is not None else None,
        }

    def _text(self, fmt: Any) -> dict[str, Any]:
        text: dict[str, Any] = {"format": msgspec.to_builtins(fmt) if fmt is not None else {"type": "text"}}
        if self.req.text is not None and self.req.text.verbosity is not None:
            text["verbosity"] = self.req.text.verbosity
        return text

    @staticmethod
    def _usage(u: Any) -> dict[str, Any]:
        miss = {"cache_miss": cache_miss.body(u.cache_miss)} if u.cache_miss is not None else {}
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens,
            **miss,
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
            kind = self.req.tool_kind(e.name)
            if kind.kind == "custom":
                item = {"id": _id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": e.id}
                item.update({"name": kind.name, "input": ""})
            else:
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": e.id}
                item.update({"name": kind.name, "arguments": ""})
            if kind.namespace is not None:
                item["namespace"] = kind.namespace
            self._calls[e.index] = item
            self.output.append(item)
            out.append(("response.output_item.added", {"output_index": len(self.output) - 1, "item": _copy(item)}))
        elif isinstance(e, CallArgs):
            item = self._calls[e.index]
            if item["type"] == "custom_tool_call":
                return  # its arguments are {"input": ...}: the input goes out whole at the end
            item["arguments"] += e.text
            out.append(
                (
                    "response.function_call_arguments.delta",
                    {"item_id": item["id"], "output_index": self.output.index(item), "delta": e.text},
                )
            )
        elif isinstance(e, CallEnd):
            item = self._calls[e.index]
            item["status"] = "completed"
            idx = self.output.index(item)
            if item["type"] == "custom_tool_call":
                item["input"] = custom_input(e.arguments)
                ref = {"item_id": item["id"], "output_index": idx}
                out.append(("response.custom_tool_call_input.delta", {**ref, "delta": item["input"]}))
                out.append(("response.custom_tool_call_input.done", {**ref, "input": item["input"]}))
                out.append(("response.output_item.done", {"output_index": idx, "item": _copy(item)}))
                return
            item["arguments"] = e.arguments
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
        self._finished()
        return _encode(self.response(self._status(c.finish_reason), c.usage, c.finish_reason))

    def _finished(self) -> None:
        if self.on_done is not None:
            self.on_done(self.id, self.output)

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
            self._finished()
            status = self._status(d.finish_reason)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            events.append((kind, {"response": self.response(status, d.usage, d.finish_reason)}))
        return [self._sse(k, p) for k, p in events]

    def error(self, exc: EngineError) -> list[bytes]:
        err = from_engine_error(exc)
        return [self._sse("error", {"code": err.code, "message": err.message, "param": err.param})]


def custom_input(arguments: str) -> str:
    """A custom tool's input from the call the model wrote (``{"input": "..."}``);
    arguments of another shape go back as the model wrote them."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event (the item keeps changing after it is sent)."""
    return msgspec.json.decode(_encode(obj))


_STORES: weakref.WeakKeyDictionary[Any, ResponseStore] = weakref.WeakKeyDictionary()


def response_store(host: Any) -> ResponseStore:
    """The server's stored responses (one per ``ServerState``)."""
    store = _STORES.get(host)
    if store is None:
        store = _STORES[host] = ResponseStore()
    return store


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


class Responses(ChatRoute):
    """The door onto the one road (transport/turn/road.py)."""

    name = "responses"

    def decode(self, body: bytes, host: Any) -> ResponsesRequest:
        return decode_request(body, ResponsesRequest)

    def turn(self, o: Opened) -> Turn:
        """The stored conversation of ``previous_response_id``, then the input items."""
        req: ResponsesRequest = o.req
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            try:  # another key's response is not found either: stored responses are scoped like the caches
                history = response_store(o.host).get(stored_id(o.ns, req.previous_response_id))
            except ResponseNotFound:
                raise ApiError(
                    400,
                    f"previous response {req.previous_response_id!r} is not stored here (unknown, evicted, or from "
                    "before a restart): resend the whole conversation as input items",
                    param="previous_response_id",
                    code="previous_response_not_found",
                ) from None
        for field, action in req.envelope_notes():
            o.note(field, action)
        setup = req.tool_setup()
        return Turn(
            messages=req.template_messages(history),
            tools=setup,
            thinking=req.thinking_choice(),
            thinking_field="reasoning",
            param="input",
            state=history,
        )

    def sampling_params(self, o: Opened, turn: Turn, limit: int) -> SamplingParams:
        """``text.format``'s constraint — none when a forced tool call constrains the
        output: the output is then the call, and a text format has nothing to shape
        (instructor's RESPONSES_TOOLS sends both)."""
        params = o.req.sampling_params(limit, o.engine.info.vocab_size)
        constraint = None if turn.tools.forced else o.req.constraint()
        return chat_turn.with_constraint(o.engine, params, constraint, "text.format")

    def encoder(self, a: Admitted) -> Renderer:
        o = a.opened
        req: ResponsesRequest = o.req
        on_done = None
        if req.store:
            store, ns = response_store(o.host), o.ns
            conversation = a.turn.state + _input_items(req)

            def on_done(rid: str, output: list[dict[str, Any]]) -> None:
                store.put(stored_id(ns, rid), conversation + [_copy(item) for item in output])

        return ResponsesRenderer(o.model, req, a.splitter(), on_done)


RESPONSES = Responses()


async def responses(request: Request, host: Any) -> Response:
    return await road.run_turn(request, host, RESPONSES)


def routes(endpoint: Any) -> list[Route]:
    """``endpoint`` is the OpenAI routes' wrapper (errors in OpenAI's shape)."""
    return [Route("/v1/responses", endpoint("responses", responses), methods=["POST"])]
