"""Tool calls a model writes as plain JSON, outside its template's markers.

Qwen2.5-Coder-1.5B-Instruct's chat template documents
``<tool_call>{json}</tool_call>``, yet asked with tools the model answers with a
fenced object instead::

    ```json
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```

— sometimes in a bare ```` ``` ```` fence, sometimes a JSON list of such objects
(parallel calls), sometimes after a sentence, sometimes with no fence at all.
``FencedCalls`` reads the text ``CallSplitter`` found outside the markers and
gives it back as ``str`` pieces, ``Found`` calls, or ``Malformed`` text (a call
that did not parse: it stays text, and is counted).

What is a call (``read_calls``): JSON that is an object with a string ``name``
naming a tool the request offered and ``arguments`` (an object, or a string
holding one; ``parameters`` is read the same way), the same inside OpenAI's
tool-call wrapper ``{"type": "function", "function": {...}}`` (a schema under
``parameters`` is a definition written back, not a call), or a non-empty list
of such objects. Anything else stays text, byte for byte: JSON a user asked for, a name
not offered, a fence in another language.

Where: a fence opened at a line start by ```` ``` ```` or ```` ```json ```` and closed by a
line-start ```` ``` ```` (the output's end closes it too); or a line (the reply's
first, or one after prose) that starts as a call does, with the name first:
``{"name": "<offered>"`` or ``[{"name": …``. Such a line holds one call, a list,
or calls one after another (``{…}\n{…}``: the 0.5B's answer to Claude Code);
what follows them is read again as text, and a last call cut short by the
output limit stays counted text.

Streaming: text streams as it comes, except what may still open a fence (a
line-start tail like ``"``"`` or ``"```js"``), a candidate fence (held until it
closes, then decided; one whose content does not start with ``{`` or ``[`` —
code — is let go at once), a line start that may still open a bare call, and
a line that starts like a bare call (held to the reply's end).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

log = logging.getLogger("ember.tools")

Form = Literal["fence", "bare"]

# a call's start, for text that is not JSON: name first, or inside OpenAI's tool-call wrapper
_HEAD = re.compile(r'^\s*\[?\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*"function"\s*:\s*\{\s*)?"name"\s*:\s*"([^"\\]*)"')
_WRAPPER = ("{", '"type"', ":", '"function"', ",", '"function"', ":", "{")  # what bare_head reads before "name"
_CLOSE = re.compile(r"(?:^|\n)[ \t]*```")
_LEAD = re.compile(r"\S")
_FENCE = "```"
_INFOS = ("", "json")  # the info strings of a fence that may hold a call


class ParsedCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # a JSON object's text


class Found(msgspec.Struct, frozen=True):
    calls: tuple[ParsedCall, ...]
    form: Form
    text: str  # what the model wrote, fences included


class Malformed(msgspec.Struct, frozen=True):
    """Text that names an offered tool as a call does but does not parse as one."""

    text: str
    form: Form
    reason: str


Piece = str | Found | Malformed


class MalformedCall(ValueError):
    """``read_calls``: the text is meant as a call (it names an offered tool) but is not one."""


def offered_names(tools: Any) -> frozenset[str]:
    """The function names of a request's tools, in the template's shape (``{"function": {"name"}}``)."""
    names = set()
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def read_calls(text: str, names: frozenset[str]) -> tuple[ParsedCall, ...] | None:
    """The calls ``text`` holds, None when it is not a call; ``MalformedCall``
    when it names an offered tool but does not parse."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        head = _HEAD.match(text)
        if head is not None and head.group(1) in names:
            raise MalformedCall(f"not JSON: {exc}") from None
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, names) for v in items]
    if calls and all(c is not None for c in calls):
        return tuple(c for c in calls if c is not None)
    if any(c is not None for c in calls):
        raise MalformedCall("a list of calls and other values")
    return None


def read_call_run(text: str, names: frozenset[str]) -> tuple[tuple[ParsedCall, ...], int] | None:
    """Calls written one after another (``{...}\n{...}``, a comma between
    allowed): the calls of the longest run of whole call objects at the start
    of ``text`` and where that run ends; None when the first value is not a
    call. What follows the run (a call cut by the output limit, prose) is the
    caller's to keep as text. Qwen2.5-Coder-0.5B answered Claude Code with
    such a run of ``Edit`` calls, the last one cut by ``max_tokens``."""
    dec = json.JSONDecoder()
    calls: list[ParsedCall] = []
    i = end = len(text) - len(text.lstrip())
    while i < len(text):
        try:
            value, j = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        try:
            call = _call(value, names) if isinstance(value, dict) else None
        except MalformedCall:
            call = None
        if call is None:
            break
        calls.append(call)
        end = j
        i = j + len(text[j:]) - len(text[j:].lstrip())
        if text.startswith(",", i):
            i += 1
            i += len(text[i:]) - len(text[i:].lstrip())
    return (tuple(calls), end) if calls else None


def _unwrap(value: Any) -> Any:
    """``{"type": "function", "function": {"name", "arguments"}}``, OpenAI's
    tool-call shape, read as the call inside it: Qwen2.5-Coder-1.5B wrote its
    calls to Codex so, in ``<tools>`` tags, the values under ``parameters``."""
    if isinstance(value, dict) and "name" not in value and value.get("type", "function") == "function":
        inner = value.get("function")
        if isinstance(inner, dict):
            return inner
    return value


def _schema(args: Any) -> bool:
    """A tool's parameter schema (a definition echoed back), not arguments."""
    return isinstance(args, dict) and args.get("type") == "object" and isinstance(args.get("properties"), dict)


def _call(value: Any, names: frozenset[str]) -> ParsedCall | None:
    value = _unwrap(value)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    name = value["name"]
    key = "arguments" if "arguments" in value else "parameters" if "parameters" in value else None
    if key is None:
        raise MalformedCall(f"a call of {name!r} without arguments")
    args = value[key]
    if _schema(args):
        return None  # the tool's definition written back: text
    if isinstance(args, dict):
        # json.dumps's separators are how the template's tojson writes the call back
        return ParsedCall(name=name, arguments=json.dumps(args, ensure_ascii=False))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return ParsedCall(name=name, arguments=args)
    raise MalformedCall(f"the arguments of {name!r} are not a JSON object")


def bare_head(text: str, names: frozenset[str]) -> bool | None:
    """Whether ``text`` starts as a bare call of an offered tool (name first);
    None while it cannot tell yet."""
    s = text.lstrip()
    if s.startswith("["):
        s = s[1:].lstrip()
    wrapped = s
    for token in _WRAPPER:  # OpenAI's wrapper first, if that is how it starts (_unwrap)
        if not wrapped.startswith(token):
            if token.startswith(wrapped):
                return None
            break
        wrapped = wrapped[len(token) :].lstrip()
    else:
        s = "{" + wrapped
    for token in ("{", '"name"', ":"):
        if not s.startswith(token):
            return None if token.startswith(s) else False
        s = s[len(token) :].lstrip()
    if not s:
        return None
    if s[0] != '"':
        return False
    s = s[1:]
    end = s.find('"')
    if end < 0:
        return None if any(n.startswith(s) for n in names) else False
    return s[:end] in names


class FencedCalls:
    """Feed the text outside the template's markers, get ``Piece``s. The modes:
    ``text``; ``other`` (inside a fence that cannot hold a call: its close is
    not an opener); ``fence`` (a candidate fence, held); ``bare`` (a line
    starts as a bare call: held to the end)."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self._buf = ""
        self._mode: Literal["text", "other", "fence", "bare"] = "text"
        self._line_start = True
        self._open = 0  # in "fence": the opener's length, where the content starts in _buf
        self._searched = 0  # in "fence": where in the content the search for its close resumes
        self._maybe_bare = True  # nothing but whitespace has been read yet

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._step(out):
            pass
        return _joined(out)

    def flush(self) -> list[Piece]:
        """A call in the template's markers starts here: what is held is text."""
        if self._mode == "fence":
            self._mode = "other"  # the marker is inside it: its close is not an opener
        elif self._mode == "bare":
            self._mode = "text"
        self._maybe_bare = False
        self._line_start = True
        buf, self._buf = self._buf, ""
        return [buf] if buf else []

    def finish(self) -> list[Piece]:
        """The end of the output: a held fence or bare reply is decided as it stands."""
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        if self._mode == "fence":
            return self._decide(buf[self._open :], buf, "fence")
        if (self._mode == "bare" or self._maybe_bare) and buf.strip():
            return self._decide(buf.strip(), buf, "bare")
        return [buf]

    def discard(self) -> int:
        """Drop what is held (``parallel_tool_calls: false`` after the first call); its length."""
        n, self._buf = len(self._buf), ""
        return n

    # ---- inside ---------------------------------------------------------
    def _step(self, out: list[Piece]) -> bool:
        """Decide what it can at the head of the buffer; True to go on."""
        if self._mode == "bare":
            return False
        if self._maybe_bare:
            head = bare_head(self._buf, self.names)
            if head is None:
                return False
            if head:
                self._mode = "bare"
                return False
            self._maybe_bare = False
        if self._mode == "fence":
            return self._in_fence(out)
        return self._line(out)

    def _line(self, out: list[Piece]) -> bool:
        buf = self._buf
        if self._line_start:
            body = buf.lstrip(" \t")
            if _FENCE.startswith(body):  # "", "`" or "``": it may still open (or close) a fence
                return False
            if body.startswith(_FENCE):
                indent = len(buf) - len(body)
                if self._mode == "other":  # its close
                    self._mode = "text"
                    self._take(indent + len(_FENCE), out, line_end=False)
                    return True
                nl = body.find("\n")
                info = (body[len(_FENCE) :] if nl < 0 else body[len(_FENCE) : nl]).strip().lower()
                if nl < 0 and any(i.startswith(info) for i in _INFOS):
                    return False  # the info string is not known yet
                if info in _INFOS:
                    self._mode, self._open, self._searched = "fence", indent + nl + 1, 0
                    return True
                self._mode = "other"  # another language's fence streams
            elif self._mode == "text":
                head = bare_head(body, self.names)
                if head is None:
                    return False  # it may still open a call: held
                if head:
                    self._mode = "bare"  # a call after a line of prose: held to the end
                    return False
        nl = buf.find("\n")
        if nl < 0:
            self._take(len(buf), out, line_end=False)
            return False
        self._take(nl + 1, out, line_end=True)
        return True

    def _take(self, n: int, out: list[Piece], *, line_end: bool) -> None:
        out.append(self._buf[:n])
        self._buf = self._buf[n:]
        self._line_start = line_end

    def _in_fence(self, out: list[Piece]) -> bool:
        content = self._buf[self._open :]
        lead = _LEAD.search(content)
        if lead is not None and lead.group() not in "{[":  # code, not JSON: it streams as text
            self._mode = "other"
            self._take(self._open, out, line_end=True)
            return True
        close = _CLOSE.search(content, self._searched)
        if close is None:
            # a long held fence is searched once, not again from its start at every delta
            self._searched = max(content.rfind("\n"), 0)
            return False
        end = self._open + close.end()
        fenced, self._buf = self._buf[:end], self._buf[end:]
        self._mode, self._line_start = "text", False
        out.extend(self._decide(content[: close.start()], fenced, "fence"))
        return True

    def _decide(self, body: str, text: str, form: Form) -> list[Piece]:
        try:
            calls = read_calls(body, self.names)
        except MalformedCall as exc:
            run = self._run(body, text, form)
            if run is not None:
                return run
            log.warning("[tools] a %s tool call that does not parse kept as text: %s", form, exc)
            return [Malformed(text=text, form=form, reason=str(exc))]
        return [text if calls is None else Found(calls=calls, form=form, text=text)]

    def _run(self, body: str, text: str, form: Form) -> list[Piece] | None:
        """Whole calls one after another, then the rest: the calls, and the rest
        read again (text, or one more call cut short by the output limit: counted
        text). In a fence the rest must be nothing or that cut call."""
        run = read_call_run(body, self.names)
        if run is None:
            return None
        calls, end = run
        tail = body[end:].lstrip(", \t\r\n")
        if not tail:  # a closed fence's closer is not in body
            return [Found(calls=calls, form=form, text=text)]
        cut = text.index(body.lstrip()) + end - (len(body) - len(body.lstrip()))
        head = _HEAD.match(tail)
        if head is not None and head.group(1) in self.names:
            log.warning("[tools] %d %s tool calls, then one cut short kept as text", len(calls), form)
            rest: list[Piece] = [Malformed(text=text[cut:], form=form, reason="a call cut short after whole calls")]
        elif form == "fence":
            return None
        else:
            again = FencedCalls(self.names)
            again._maybe_bare = again._line_start = False  # the rest goes on the call's line
            rest = again.feed(text[cut:]) + again.finish()
        return [Found(calls=calls, form=form, text=text[:cut]), *rest]


def _joined(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces as one."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        elif not (isinstance(p, str) and not p):
            out.append(p)
    return out
