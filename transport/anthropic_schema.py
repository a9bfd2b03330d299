"""Anthropic Messages request and response bodies as msgspec Structs.

Decoded strictly like the OpenAI ones: an unknown field (``thinking``, an
``image`` block, a server tool) is a 400 naming it, not a silent no-op.
``cache_control`` is accepted and ignored: Ember's prompt cache needs no
breakpoints, every prefix it has computed is reusable, and ``usage`` reports
what it served (``cache_read_input_tokens``). ``metadata`` and
``service_tier`` do not change the output and are ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.types import SamplingParams
from transport.tools import ToolChoice, ToolSetup, check_tool


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TextBlock(_Strict, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Strict, kw_only=True, tag_field="type", tag="thinking"):
    """A reasoning model's earlier thinking, sent back (transport/reasoning.py)."""

    thinking: str
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class RedactedThinkingBlock(_Strict, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(_Strict, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Strict, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceBody(_Strict, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict, kw_only=True):
    user_id: str | None = None


class _Prompt(_Strict, kw_only=True):
    """What both ``/v1/messages`` and ``/v1/messages/count_tokens`` read."""

    model: str | None = None
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceBody | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "adaptive" | "disabled", ...}

    def thinking_choice(self) -> bool | None:
        """``thinking.type`` as the template's reasoning switch (None: its default)."""
        kind = (self.thinking or {}).get("type")
        return False if kind == "disabled" else True if kind in ("enabled", "adaptive") else None

    def check(self) -> Any:
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        if self.messages[0].role != "user":
            raise InvalidRequest("the first message must be from the user", "messages[0].role")
        if self.messages[-1].role != "user":
            raise InvalidRequest(
                "the last message must be from the user (prefilling the assistant turn is not supported)",
                f"messages[{len(self.messages) - 1}].role",
            )
        c = self.tool_choice
        if c is not None and c.type == "tool" and not c.name:
            raise InvalidRequest("tool_choice of type tool needs a name", "tool_choice.name")
        if c is not None and c.type != "tool" and c.name is not None:
            raise InvalidRequest("only tool_choice of type tool takes a name", "tool_choice.name")
        return self

    def tool_setup(self) -> ToolSetup:
        tools = [
            check_tool(t.name, t.description, t.input_schema, f"tools[{i}]", "input_schema")
            for i, t in enumerate(self.tools or [])
        ]
        c = self.tool_choice
        mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[c.type] if c else "auto"
        parallel = not (c is not None and c.disable_parallel_tool_use)
        return ToolSetup.of(tools, ToolChoice(mode=mode, name=c.name if c else None), parallel, "tool_choice")

    def template_messages(self) -> list[dict[str, Any]]:
        """OpenAI-style messages for the chat template: tool_use blocks become an
        assistant's ``tool_calls`` and tool_result blocks ``tool`` messages,
        each checked to answer an earlier tool_use."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        uses: set[str] = set()
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text = ""
            thought = ""
            calls = []
            for j, b in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if isinstance(b, TextBlock):
                    text += b.text
                elif isinstance(b, ThinkingBlock | RedactedThinkingBlock):
                    if m.role != "assistant":
                        raise InvalidRequest("thinking blocks belong to assistant messages", f"{where}.type")
                    # the template renders it or drops it (Qwen3 drops it before the last user turn)
                    thought += b.thinking if isinstance(b, ThinkingBlock) else ""
                elif isinstance(b, ToolUseBlock):
                    if m.role != "assistant":
                        raise InvalidRequest("tool_use blocks belong to assistant messages", f"{where}.type")
                    uses.add(b.id)
                    calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
                else:
                    if m.role != "user":
                        raise InvalidRequest("tool_result blocks belong to user messages", f"{where}.type")
                    if b.tool_use_id not in uses:
                        raise InvalidRequest(
                            f"tool_use_id {b.tool_use_id!r} matches no earlier tool_use block", f"{where}.tool_use_id"
                        )
                    content = b.text()
                    if b.is_error:
                        content = f"Error: {content}"
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            if m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if thought:
                    msg["reasoning_content"] = thought
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
            elif text or not any(isinstance(b, ToolResultBlock) for b in m.content):
                out.append({"role": "user", "content": text})
        return out


class MessagesRequest(_Prompt, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None

    def param_names(self) -> dict[str, str]:
        """The engine's names for fields this API spells differently (the ranges
        are the engine's, ``engine.limits``, checked once for every API)."""
        return {"stop": "stop_sequences", "constraint": "tool_choice"}

    def sampling_params(self, vocab_size: int) -> SamplingParams:
        d = SamplingParams()
        top_k = d.top_k if self.top_k is None else self.top_k
        return SamplingParams(
            max_tokens=self.max_tokens,
            # unset: greedy, Ember's default on every route (Anthropic's own is 1.0)
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=0 if top_k >= vocab_size else top_k,
            stop=list(self.stop_sequences or []),
        )


class CountTokensRequest(_Prompt, kw_only=True):
    pass


# ---------------------------------------------------------------------------
# Responses.


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextOut(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ToolUseOut(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class ThinkingOut(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


class MessageBody(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class ErrorInfo(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    error: ErrorInfo


def tool_input(arguments: str) -> Any:
    """A call's arguments as the tool_use ``input`` object (a truncated call: {})."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
