"""Whose fault a failed task is: the model's choice, or Ember's, read from what crossed the wire.

Ember's faults (any one in a session is counted, pass or fail, and makes the harness exit non-zero):

- ``HTTP <status>``: a non-2xx answer to any request;
- ``truncated stream``: the server closed a stream before its API's end event;
- ``error in stream``: an error event (Anthropic ``error``, Responses ``response.failed``) mid-stream;
- ``upstream error``: the proxy could not reach Ember or lost it mid-answer;
- ``malformed call``: a tool call without a name, or whose arguments are not a JSON object;
- ``call not parsed``: an answer with no tool call whose text holds a JSON object naming a tool the
  request offered (the model called it; Ember sent it back as text);
- ``cache lost``: a finished turn that continues an earlier finished turn of the same conversation
  (same system, tools and first message, a longer prompt) found less than half of that earlier prompt
  in the cache.

Otherwise a failed task is the model's: no tool call at all, or calls that did not do the task (the
judge's detail says what the file system showed). A session stopped at its time cap with a clean wire
is counted apart (``time cap``): on a slow machine the first prefill of a client's system prompt can
outlast the cap, and that says nothing about the model's choices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bench.agent_tasks.wire import Exchange, ToolCall

CACHE_KEPT_MIN = 0.5  # of the earlier turn's prompt that a continuation must find cached


def named_tool_in_text(text: str, offered: list[str]) -> str | None:
    """The offered tool a JSON object in ``text`` names ({"name": ..., "arguments": ...}), if any."""
    dec = json.JSONDecoder()
    names = set(offered)
    i = text.find("{")
    while i != -1:
        try:
            obj, _ = dec.raw_decode(text, i)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            fn = obj.get("function")
            name = obj.get("name") or (fn.get("name") if isinstance(fn, dict) else None)
            if isinstance(name, str) and name in names:
                return name
        i = text.find("{", i + 1)
    return None


def ember_faults(exchanges: list[Exchange]) -> list[str]:
    faults: list[str] = []
    earlier: dict[str, Exchange] = {}
    for ex in exchanges:
        where = f"{ex.method} {ex.path}"
        if ex.status is not None and not 200 <= ex.status < 300:
            faults.append(f"HTTP {ex.status} {where}: {ex.error_body[:120]}")
            continue
        if ex.ended == "truncated":
            faults.append(f"truncated stream {where}")
        elif ex.ended == "error_event":
            faults.append(f"error in stream {where}: {ex.error_body[:120]}")
        elif ex.ended == "upstream_error":
            faults.append(f"upstream error {where}: {ex.error_body[:120]}")
        for call in ex.tool_calls:
            if not call.well_formed():
                faults.append(f"malformed call {call.name!r}: {call.arguments[:80]!r}")
        if ex.is_turn and not ex.tool_calls and ex.ended in ("complete", "body"):
            named = named_tool_in_text(ex.text, ex.tools_offered)
            if named:
                faults.append(f"call not parsed: text names {named!r}")
        # only a finished answer's usage is final: an Anthropic stream's message_start goes out before
        # the prefix lookup (cache_read 0), and one the client left never sent its message_delta
        if ex.is_turn and ex.prompt_tokens is not None and ex.ended in ("complete", "body"):
            before = earlier.get(ex.lineage)
            if before is not None and before.prompt_tokens and ex.prompt_tokens > before.prompt_tokens:
                cached = ex.cached_tokens or 0
                if cached < CACHE_KEPT_MIN * before.prompt_tokens:
                    faults.append(f"cache lost: {cached} of {ex.prompt_tokens} cached after a {before.prompt_tokens}")
            earlier[ex.lineage] = ex
    return faults


@dataclass
class Session:
    """One client on one task: the verdict, whose fault a failure is, and the session's numbers."""

    client: str
    model: str
    task: str
    passed: bool
    detail: str  # the judge's
    exit_code: int | None
    timed_out: bool
    wall_s: float
    exchanges: list[Exchange] = field(default_factory=list)
    ember: list[str] = field(default_factory=list)
    output_tail: str = ""

    @property
    def turns(self) -> int:
        return sum(1 for ex in self.exchanges if ex.is_turn)

    @property
    def tool_calls(self) -> int:
        """Tool calls that reached the client whole (2xx, the answer finished)."""
        return sum(
            len(ex.tool_calls)
            for ex in self.exchanges
            if ex.is_turn and ex.status is not None and 200 <= ex.status < 300 and ex.ended in ("complete", "body")
        )

    @property
    def prompt_tokens(self) -> int:
        return sum(ex.prompt_tokens or 0 for ex in self.exchanges if ex.is_turn)

    @property
    def cached_tokens(self) -> int:
        return sum(ex.cached_tokens or 0 for ex in self.exchanges if ex.is_turn)

    @property
    def abandoned(self) -> int:
        """Streams the client hung up on and then asked again (a retry): not a fault on the wire, but
        what a client does when it waits too long (Codex: no event for its idle timeout, 300 s)."""
        turns = [ex for ex in self.exchanges if ex.is_turn]
        return sum(
            1
            for i, ex in enumerate(turns)
            if ex.ended == "client_gone" and any(later.t_start >= (ex.t_end or 0) for later in turns[i + 1 :])
        )

    @property
    def finished_turns(self) -> int:
        return sum(1 for ex in self.exchanges if ex.is_turn and ex.ended in ("complete", "body"))

    @property
    def outcome(self) -> str:
        """pass, or whose the failure is: ``ember`` (any fault on the wire), ``time cap`` (the session
        ran out of time with the wire clean: too slow to say what the model would have done), ``model``."""
        if self.passed:
            return "pass"
        if self.ember:
            return "ember"
        return "time cap" if self.timed_out else "model"

    @property
    def reason(self) -> str:
        """Why a failure that is not Ember's failed ("" otherwise)."""
        if self.outcome == "time cap":
            retried = f", the client gave up on {self.abandoned} and retried" if self.abandoned else ""
            return (
                f"time cap: {self.finished_turns} of {self.turns} turns finished{retried}, "
                f"{self.tool_calls} calls ({self.detail})"
            )
        if self.outcome != "model":
            return ""
        if self.tool_calls == 0:
            return f"no tool call ({self.detail})"
        return f"{self.tool_calls} calls, wrong result: {self.detail}"


def session_from_dict(d: dict[str, Any]) -> Session:
    """A session saved by ``--json`` (``dataclasses.asdict``), to attribute again."""
    exchanges = [Exchange(**{**e, "tool_calls": [ToolCall(**c) for c in e["tool_calls"]]}) for e in d["exchanges"]]
    return Session(**{**d, "exchanges": exchanges})


def judge_session(session: Session) -> Session:
    session.ember = ember_faults(session.exchanges)
    return session
