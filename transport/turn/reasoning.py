"""Reasoning models: the ``<think>…</think>`` section cut out of the answer.

A model whose tokenizer has thinking markers (mlx-lm's ``TokenizerWrapper``
``has_thinking`` / ``think_start`` / ``think_end``: ``<think>``/``</think>``
for Qwen3 and DeepSeek-R1, exposed as ``MLXTokenizer.reasoning_markup``)
writes its reasoning between them. ``OutputSplitter`` sits where the
``CallSplitter`` sits and gives the same events plus ``Reasoning``: text
between the markers never reaches the answer, and text after the end marker
goes through the tool-call splitter, so calls after ``</think>`` still parse.

Like mlx_lm.server, the output starts inside the reasoning when the prompt
itself ends in an open ``<think>`` (a template whose generation prompt opens
it, DeepSeek-R1 style). The whitespace a template puts around the reasoning
(``<think>\\n…\\n</think>\\n\\n``) is trimmed, the way Qwen3's template trims
it when it renders the reasoning back, so the text a client sends back
re-renders as the model wrote it.

Turning reasoning off goes through the template: ``template_kwargs(False)`` is
``{"enable_thinking": False}`` (mlx-lm maps it to a template's own variable).
"""

from __future__ import annotations

import hashlib
from typing import Any

from engine.tool_markup import ReasoningMarkup
from transport.turn.tool_calls import CallSplitter, Event, Reasoning, Text, _held_prefix

__all__ = ["OutputSplitter", "Reasoning", "ReasoningMarkup", "markup_of", "signature", "starts_inside"]


def markup_of(tokenizer: Any) -> ReasoningMarkup | None:
    return tokenizer.reasoning_markup


def starts_inside(prompt_text: str | None, markup: ReasoningMarkup) -> bool:
    """The prompt ends in an open reasoning section (its last start marker is after its last end marker)."""
    if not prompt_text:
        return False
    return prompt_text.rfind(markup.start) > prompt_text.rfind(markup.end)


def template_kwargs(thinking: bool | None) -> dict[str, Any] | None:
    """A request's thinking choice as chat-template variables (None: the template's default)."""
    return None if thinking is None else {"enable_thinking": thinking}


def signature(text: str) -> str:
    """Anthropic's ``signature`` for a thinking block: a digest of the text (there is nothing to verify locally)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class OutputSplitter:
    """Reasoning, text and tool calls out of a reasoning model's text deltas.
    ``calls`` is the tool-call splitter for the answer (None: no tools)."""

    def __init__(self, markup: ReasoningMarkup, calls: CallSplitter | None, *, inside: bool = False):
        self.m = markup
        self.call_splitter = calls
        self.reasoning = ""  # all of it, for bodies and token counts
        self._inside = inside
        self._seen_end = False
        self._lead = True  # at the start of a section: its leading whitespace is the template's
        self._ws = ""  # reasoning whitespace held back: it may be the template's before the end marker
        self._buf = ""

    @property
    def made_calls(self) -> bool:
        return self.call_splitter is not None and self.call_splitter.made_calls

    @property
    def calls(self) -> list[Any]:
        return self.call_splitter.calls if self.call_splitter is not None else []

    @property
    def dropped_chars(self) -> int:
        return self.call_splitter.dropped_chars if self.call_splitter is not None else 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._buf:
            marker = self.m.end if self._inside else self.m.start
            if not self._inside and self._seen_end:  # one reasoning section; after it all is the answer
                self._answer(self._buf, out)
                self._buf = ""
                break
            i = self._buf.find(marker)
            if i < 0:
                keep = _held_prefix(self._buf, marker)
                self._piece(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            self._piece(self._buf[:i], out)
            self._buf = self._buf[i + len(marker) :]
            if self._inside:
                self._ws = ""  # the whitespace before </think> is the template's
                self._seen_end = True
            self._inside = not self._inside
            self._lead = True
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        if rest:
            self._piece(rest, out)
        if self._inside and self._ws:
            self._emit_reasoning(self._ws, out)
            self._ws = ""
        if self.call_splitter is not None:
            out += self.call_splitter.finish()
        return out

    def _piece(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        if self._inside:
            body = self._ws + text
            stripped = body.rstrip()
            self._ws = body[len(stripped) :]
            if stripped:
                self._emit_reasoning(stripped, out)
        else:
            self._answer(text, out)

    def _emit_reasoning(self, text: str, out: list[Event]) -> None:
        self.reasoning += text
        out.append(Reasoning(text))

    def _answer(self, text: str, out: list[Event]) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        if self.call_splitter is None:
            out.append(Text(text))
        else:
            out += self.call_splitter.feed(text)
