"""Tool calls cut out of a model's streamed text, as API-neutral events.

The model writes calls inside its template's markers (``<tool_call>`` …
``</tool_call>`` for Hermes/Qwen); mlx-lm's tool parser for that template
turns one call's text into ``{"name", "arguments"}``. ``CallSplitter`` sits
between the engine's text deltas and a renderer: text outside markers comes
out as ``Text``; a call comes out as ``CallStart`` (id, name), ``CallArgs``
pieces and ``CallEnd``. The markup itself never comes out as text, and a prefix
of a start marker is held back until it is known not to be one.

For the JSON form (``{"name": "f", "arguments": {...}}``) the arguments stream
as the model writes them — the raw text, so what a client sends back is what
the model emitted and the next turn's prompt renders the same tokens. For other
formats a call is parsed whole at its end marker and sent in one piece.

When the request offers tools, the text outside the markers also goes through
``FencedCalls`` (transport/turn/fenced_calls.py): calls a model writes as JSON in a
```` ```json ```` fence or as its whole reply, as Qwen2.5-Coder does, come out as
the same events. ``count(form, kind)`` is told of each call (``kind`` "calls")
and each call-like output that did not parse ("parse_failures"); ``form`` is
"markers", "fence" or "bare".
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec

from engine.tool_markup import ToolMarkup
from transport.turn.fenced_calls import FencedCalls, Found, Malformed, Piece, offered_names
from transport.turn.tools import new_call_id

log = logging.getLogger("ember.tools")

_JSON_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_OUTER_CLOSE = re.compile(r"\s*\}\s*$")


class Text(msgspec.Struct, frozen=True):
    text: str


class CallStart(msgspec.Struct, frozen=True):
    index: int
    id: str
    name: str


class CallArgs(msgspec.Struct, frozen=True):
    index: int
    text: str


class CallEnd(msgspec.Struct, frozen=True):
    index: int
    id: str
    name: str
    arguments: str  # the whole JSON text, equal to the CallArgs pieces joined


class Reasoning(msgspec.Struct, frozen=True):
    """A reasoning model's thinking (transport/turn/reasoning.py), never part of the answer."""

    text: str


Event = Text | CallStart | CallArgs | CallEnd | Reasoning
Count = Callable[[str, str], None]  # (form, kind): a call read, or a call that did not parse


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class CallSplitter:
    """Feed text deltas, get events. ``single`` keeps only the first call
    (``parallel_tool_calls: false``); anything after it is dropped and counted.
    ``tools`` (the template's shape) are the ones the request offers: calls of
    them written as plain JSON are read too (``FencedCalls``)."""

    def __init__(
        self,
        markup: ToolMarkup,
        tools: Any = None,
        *,
        single: bool = False,
        id_prefix: str = "call_",
        count: Count | None = None,
    ):
        self.m = markup
        self.tools = tools
        self.single = single
        self.id_prefix = id_prefix
        self.count = count
        names = offered_names(tools)
        self._fences = FencedCalls(names) if names else None
        self.calls: list[CallEnd] = []
        self.dropped_chars = 0
        self._buf = ""  # text not yet decided on
        self._in_call = False
        self._body = ""  # the current call's text after the start marker
        self._streamed: CallStart | None = None  # set once the JSON head was read
        self._args_sent = 0
        self._args_at = 0
        self._ws_after_call = ""  # whitespace between calls is not content
        self._done = False

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[Event]:
        if self._done:
            self.dropped_chars += len(text)
            return []
        self._buf += text
        out: list[Event] = []
        while self._buf and not self._done:
            if self._in_call:
                if not self._feed_call(out):
                    break
            else:
                i = self._buf.find(self.m.start)
                if i < 0:
                    keep = _held_prefix(self._buf, self.m.start)
                    self._emit_text(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit_text(self._buf[:i], out)
                if self._done:  # a plain-JSON call was the one call (single)
                    self._buf = self._buf[i:]
                    break
                if self._fences is not None:
                    self._take(self._fences.flush(), out)
                self._buf = self._buf[i + len(self.m.start) :]
                self._in_call, self._body, self._streamed, self._args_sent = True, "", None, 0
        if self._done:
            self.dropped_chars += len(self._buf)
            self._buf = ""
        return out

    def finish(self) -> list[Event]:
        """End of output: a call cut short (max tokens) ends with what it has."""
        out: list[Event] = []
        if self._in_call and not self._done:
            self._body += self._buf
            self._buf = ""
            self._end_call(out, complete=False)
        elif self._buf and not self._done:
            self._emit_text(self._buf, out)
        self._buf = ""
        if self._fences is not None and not self._done:
            self._take(self._fences.finish(), out)
        return out

    # ---- inside ---------------------------------------------------------
    def _note(self, form: str, kind: str, n: int = 1) -> None:
        if self.count is not None:
            for _ in range(n):
                self.count(form, kind)

    def _emit_text(self, text: str, out: list[Event]) -> None:
        """Text outside the markers: through ``FencedCalls`` when tools are offered."""
        if self._fences is None:
            self._text_out(text, out)
        elif text:
            self._take(self._fences.feed(text), out)

    def _take(self, pieces: list[Piece], out: list[Event]) -> None:
        for p in pieces:
            if self._done:
                self.dropped_chars += len(p if isinstance(p, str) else p.text)
            elif isinstance(p, Found):
                self._found(p, out)
            elif isinstance(p, Malformed):
                self._note(p.form, "parse_failures")
                self._text_out(p.text, out)
            else:
                self._text_out(p, out)

    def _found(self, found: Found, out: list[Event]) -> None:
        """Calls written as plain JSON, sent whole (they were read whole)."""
        calls = found.calls[:1] if self.single else found.calls
        for c in calls:
            index = len(self.calls)
            start = CallStart(index=index, id=new_call_id(self.id_prefix), name=c.name)
            end = CallEnd(index=index, id=start.id, name=c.name, arguments=c.arguments)
            out += [start, CallArgs(index=index, text=c.arguments), end]
            self.calls.append(end)
        self._note(found.form, "calls", len(calls))
        if self.single:
            self._done = True
            self.dropped_chars += sum(len(c.arguments) for c in found.calls[1:])
            if self._fences is not None:
                self.dropped_chars += self._fences.discard()

    def _text_out(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.calls:  # after a call only real text counts; a newline between calls does not
            if not text.strip():
                self._ws_after_call += text
                return
            text, self._ws_after_call = self._ws_after_call + text, ""
        out.append(Text(text))

    def _feed_call(self, out: list[Event]) -> bool:
        """Consume call text; True if the call ended (the loop goes on)."""
        j = self._buf.find(self.m.end)
        if j >= 0:
            self._body += self._buf[:j]
            self._buf = self._buf[j + len(self.m.end) :]
            self._end_call(out, complete=True)
            return True
        keep = _held_prefix(self._buf, self.m.end)
        self._body += self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        self._stream_args(out)
        return False

    def _stream_args(self, out: list[Event]) -> None:
        if not self.m.json_form:
            return
        if self._streamed is None:
            head = _JSON_HEAD.match(self._body)
            if head is None:
                return
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return
            self._streamed = CallStart(index=len(self.calls), id=new_call_id(self.id_prefix), name=name)
            self._args_at = head.end()
            out.append(self._streamed)
        # Everything but a trailing "}" + whitespace, which may be the call object's own close.
        args = self._body[self._args_at :]
        close = _OUTER_CLOSE.search(args)
        safe = close.start() if close else len(args)
        if safe > self._args_sent:
            out.append(CallArgs(index=self._streamed.index, text=args[self._args_sent : safe]))
            self._args_sent = safe

    def _end_call(self, out: list[Event], *, complete: bool) -> None:
        self._in_call = False
        if self._streamed is None:
            self._stream_args(out)
        body, self._body = self._body, ""
        start = self._streamed
        if start is not None:
            args = body[self._args_at :]
            close = _OUTER_CLOSE.search(args) if complete else None
            args = args[: close.start()] if close else args
            if len(args) > self._args_sent:
                out.append(CallArgs(index=start.index, text=args[self._args_sent :]))
            end: CallEnd | None = CallEnd(index=start.index, id=start.id, name=start.name, arguments=args)
            if complete and not _is_json(args):  # streamed already: it goes out, and is counted
                log.warning("[tools] a tool call's arguments are not JSON: %.80r", args)
                self._note("markers", "parse_failures")
        elif not complete:  # cut off (max tokens) before even its name: there is no call to report
            log.info("[tools] a tool call cut off before its name was dropped chars=%d", len(body))
            self.dropped_chars += len(body)
            return
        else:
            end = self._parse_whole(body, out)
        if end is None:
            return
        out.append(end)
        self.calls.append(end)
        self._note("markers", "calls")
        if self.single:
            self._done = True
            self.dropped_chars += len(self._buf)
            self._buf = ""

    def _parse_whole(self, body: str, out: list[Event]) -> CallEnd | None:
        """A call in a format that is not streamed: mlx-lm's parser reads it whole."""
        try:
            parsed = self.m.parser(body, self.tools)
        except Exception as exc:  # the model wrote something that is not a call: keep it as text
            log.warning("[tools] unparsable tool call kept as text: %r", exc)
            self._note("markers", "parse_failures")
            # as written, markers included; not re-read as plain JSON (it was meant as this call)
            self._text_out(self.m.start + body + self.m.end, out)
            return None
        calls = parsed if isinstance(parsed, list) else [parsed]
        end = None
        for i, c in enumerate(calls):
            args = c.get("arguments", {})
            args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            index = len(self.calls) + i
            start = CallStart(index=index, id=new_call_id(self.id_prefix), name=str(c.get("name", "")))
            out += [start, CallArgs(index=index, text=args_text)]
            end = CallEnd(index=index, id=start.id, name=start.name, arguments=args_text)
            if i < len(calls) - 1:
                out.append(end)
                self.calls.append(end)
                self._note("markers", "calls")
        return end


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def markup_of(tokenizer: Any) -> ToolMarkup | None:
    """The tool-call markup of an engine tokenizer, None when its template has none."""
    return tokenizer.tool_markup
