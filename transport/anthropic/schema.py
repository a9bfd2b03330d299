"""Anthropic Messages request and response bodies as msgspec Structs.

Decoded strictly like the OpenAI ones: a misspelt field is a 400 naming it.
Every field the current clients send (the anthropic SDK's
``MessageCreateParams``, Claude Code's requests) is honoured or accepted as a
counted no-op (``note_envelope``; the table is docs/agent-api.md):

* honoured: ``system`` messages anywhere in ``messages`` (rendered where they
  stand, or as a ``<system-reminder>`` in the neighbouring user turn where the
  template refuses a non-leading system message), ``output_config.format``
  (a JSON schema the grammar engine holds the answer to), ``tools[].strict``
  (the schema must compile), ``tools[].defer_loading`` (callable, not
  rendered), ``max_tokens`` (clamped to the context left), ``thinking``
  (``thinking_choice()``, for the template's thinking switch),
  ``metadata.user_id`` (the prompt cache's session key, as ``prompt_cache_key``
  is on OpenAI's routes: Claude Code puts its session id in it);
* counted no-ops: ``cache_control`` (on any block, tool or the request: Ember's
  prompt cache needs no breakpoints, every prefix it has computed is reusable,
  and ``usage`` reports what it served), ``service_tier``,
  ``context_management``, ``output_config.effort``, ``container``,
  ``inference_geo``, ``speed``, ``diagnostics``, ``user_profile_id``,
  ``workspace_id``, and earlier ``thinking`` blocks (left out of the prompt);
* a 400: ``image``/``document`` blocks (a text-only model cannot read them),
  MCP servers (Ember cannot reach them), an assistant prefill.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.types import Constraint, SamplingParams
from transport.turn.canonical import strip_volatile
from transport.turn.tools import Tool, ToolChoice, ToolSetup, check_tool, compile_schema

Note = Callable[[str, str], None]  # (field, action), for the envelope counter


# Anthropic's tool_choice types -> Ember's ToolChoice modes
_CHOICE_MODES: dict[str, Literal["none", "auto", "required", "named"]] = {
    "auto": "auto",
    "any": "required",
    "tool": "named",
    "none": "none",
}


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Loose(msgspec.Struct, kw_only=True):
    pass


class TextBlock(_Strict, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ImageBlock(_Loose, kw_only=True, tag_field="type", tag="image"):
    """Refused where it appears: a text-only model cannot read it."""


class DocumentBlock(_Loose, kw_only=True, tag_field="type", tag="document"):
    """Refused where it appears (a PDF or other file: send its text as a text block)."""


class ToolReferenceBlock(_Strict, kw_only=True, tag_field="type", tag="tool_reference"):
    """In a tool result: loads a deferred tool (``defer_loading``) by name."""

    tool_name: str
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Strict, kw_only=True, tag_field="type", tag="thinking"):
    """A reasoning model's earlier thinking, sent back (transport/turn/reasoning.py)."""

    thinking: str
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class RedactedThinkingBlock(_Strict, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str


class ToolUseBlock(_Strict, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


ResultPart = TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock


class ToolResultBlock(_Strict, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: str | None = None


Block = TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock


class ThinkingConfig(_Strict, kw_only=True):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Strict, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Strict, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Message(_Strict, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    output_config: OutputConfig | None = None  # Claude Code sets it on its system messages (effort): counted no-op


class ToolDef(_Strict, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    # accepted and counted, no effect here
    allowed_callers: list[Any] | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[Any] | None = None


class ToolChoiceBody(_Strict, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict, kw_only=True):
    user_id: str | None = None


# Top-level fields accepted as counted no-ops when set (docs/agent-api.md).
_IGNORED = (
    "service_tier",
    "context_management",
    "cache_control",
    "container",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
)
_TEMPLATE_ERROR = ("the chat template",)  # how chat_turn / the tokenizer word a template's refusal


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content if isinstance(b, TextBlock))


def reminder(text: str) -> str:
    """A system message as a template that refuses non-leading ones reads it."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


class _Prompt(_Strict, kw_only=True):
    """Both ``/v1/messages`` and ``/v1/messages/count_tokens``: count_tokens
    counts any request messages accepts, so they read the same fields."""

    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or "5m"; negative: never unload (ember/registry.py)
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceBody | None = None
    max_tokens: int | None = None  # unset or above the room: what the context leaves (transport.wire.limits)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[Any] | None = None
    # the prompt cache's session key: ``metadata.user_id`` (``cache_session``)
    metadata: Metadata | None = None
    # counted no-ops (_IGNORED)
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def check(self) -> Any:
        if not self.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        first = next((i for i, m in enumerate(self.messages) if m.role != "system"), None)
        if first is None:
            raise InvalidRequest("messages needs a user message, not only system ones", "messages")
        if self.messages[first].role != "user":
            raise InvalidRequest("the first non-system message must be from the user", f"messages[{first}].role")
        if self.messages[-1].role == "assistant":
            raise InvalidRequest(
                "the last message is from the assistant: prefilling the assistant turn is not supported; "
                "end with a user message",
                f"messages[{len(self.messages) - 1}].role",
            )
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                where = f"messages[{i}].content[{j}]"
                if m.role == "system" and not isinstance(b, TextBlock):
                    raise InvalidRequest("a system message holds text blocks only", f"{where}.type")
                _refuse_media(b, where)
                if isinstance(b, ToolResultBlock) and not isinstance(b.content, str):
                    for k, part in enumerate(b.content):
                        _refuse_media(part, f"{where}.content[{k}]")
        c = self.tool_choice
        if c is not None and c.type == "tool" and not c.name:
            raise InvalidRequest("tool_choice of type tool needs a name", "tool_choice.name")
        if c is not None and c.type != "tool" and c.name is not None:
            raise InvalidRequest("only tool_choice of type tool takes a name", "tool_choice.name")
        if self.mcp_servers:
            raise InvalidRequest(
                "Ember cannot connect to MCP servers; run them in the client and send their tools in tools",
                "mcp_servers",
            )
        t = self.thinking
        if t is not None and t.type != "enabled" and t.budget_tokens is not None:
            raise InvalidRequest("budget_tokens belongs to thinking of type enabled", "thinking.budget_tokens")
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            compile_schema(fmt.schema, "output_config.format.schema", "output_config.format")
        return self

    # ---- what Ember does with the envelope --------------------------------
    def thinking_choice(self) -> bool | None:
        """The template's thinking switch: False for ``disabled``, True for
        ``enabled``/``adaptive``, None when the request does not say."""
        if self.thinking is None:
            return None
        return self.thinking.type != "disabled"

    def note_envelope(self, note: Note) -> None:
        """Count the envelope fields this request set (``EnvelopeCounter``)."""
        for name in _IGNORED:
            if getattr(self, name) is not None:
                note(name, "ignored")
        if self.metadata is not None:
            note(
                "metadata.user_id" if self.cache_session() else "metadata",
                "honoured" if self.cache_session() else "ignored",
            )
        if self.mcp_servers is not None:
            note("mcp_servers", "ignored")  # only an empty list gets here
        if self.output_config is not None:
            if self.output_config.effort is not None:
                note("output_config.effort", "ignored")
            if self.output_config.format is not None:
                note("output_config.format", "honoured")
        once: set[tuple[str, str]] = set()  # per-block fields: counted once a request
        if any(isinstance(b, TextBlock) and b.cache_control for b in self.system or [] if not isinstance(b, str)):
            once.add(("system[].cache_control", "ignored"))
        for m in self.messages:
            if m.role == "system":
                once.add(("messages[].role=system", "honoured"))
            if m.output_config is not None:
                once.add(("messages[].output_config", "ignored"))
            for b in m.content if isinstance(m.content, list) else []:
                if getattr(b, "cache_control", None):
                    once.add(("messages[].content[].cache_control", "ignored"))
                if isinstance(b, (ThinkingBlock, RedactedThinkingBlock)):
                    once.add(
                        ("messages[].content[].type=thinking", "honoured")
                    )  # to the template, which keeps or drops it
        for t in self.tools or []:
            for key in ("cache_control", "allowed_callers", "eager_input_streaming", "input_examples"):
                if t.get(key) is not None:
                    once.add((f"tools[].{key}", "ignored"))
            if t.get("strict"):
                once.add(("tools[].strict", "honoured"))
            if t.get("defer_loading"):
                once.add(("tools[].defer_loading", "honoured"))
        for field, action in sorted(once):
            note(field, action)

    def constraint(self) -> Constraint | None:
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return Constraint(kind="json_schema", source=json.dumps(fmt.schema))

    # ---- tools -------------------------------------------------------------
    def tool_defs(self) -> list[ToolDef]:
        out = []
        for i, raw in enumerate(self.tools or []):
            if not isinstance(raw, dict):
                raise InvalidRequest("a tool must be an object", f"tools[{i}]")
            kind = raw.get("type")
            if kind not in (None, "custom"):
                raise InvalidRequest(
                    f"the server tool {kind!r} runs on Anthropic's servers, not here; "
                    "define it as a client tool (name, description, input_schema)",
                    f"tools[{i}].type",
                )
            try:
                out.append(msgspec.convert(raw, ToolDef))
            except msgspec.ValidationError as exc:
                raise InvalidRequest(f"{exc}", f"tools[{i}]") from None
        return out

    def tool_setup(self) -> ToolSetup:
        tools: list[Tool] = [
            check_tool(
                t.name,
                t.description,
                t.input_schema,
                f"tools[{i}]",
                "input_schema",
                strict=bool(t.strict),
                hidden=bool(t.defer_loading),
            )
            for i, t in enumerate(self.tool_defs())
        ]
        c = self.tool_choice
        mode = _CHOICE_MODES[c.type] if c else "auto"
        parallel = not (c is not None and c.disable_parallel_tool_use)
        return ToolSetup.of(tools, ToolChoice(mode=mode, name=c.name if c else None), parallel, "tool_choice")

    # ---- the prompt --------------------------------------------------------
    def system_text(self, note: Note | None = None) -> str:
        """The leading system prompt, volatile head lines taken out (transport/turn/canonical.py)."""
        if not self.system:
            return ""
        blocks = [self.system] if isinstance(self.system, str) else [b.text for b in self.system]
        out = []
        for text in blocks:
            kept, prefix = strip_volatile(text)
            if prefix is not None and note is not None:
                note(prefix.rstrip(":"), "canonicalised")
            if kept:
                out.append(kept)
        return "".join(out)

    @property
    def inner_system(self) -> bool:
        """Whether a system message stands after the conversation began."""
        first = next(i for i, m in enumerate(self.messages) if m.role != "system")
        return bool(self.system) and first > 0 or any(m.role == "system" for m in self.messages[first:])

    def template_messages(self, tools: ToolSetup | None = None, *, reminders: bool = False) -> list[dict[str, Any]]:
        """OpenAI-style messages for the chat template: tool_use blocks become
        an assistant's ``tool_calls`` and tool_result blocks ``tool`` messages,
        each checked to answer an earlier tool_use. A system message in
        ``messages`` stays where it stands; with ``reminders`` (a template that
        refuses a non-leading system message) it becomes a ``<system-reminder>``
        appended to the user or tool message before it (or a user message of its
        own), so the history stays append-only."""
        out: list[dict[str, Any]] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        known = {t.name: t for t in (tools.tools if tools is not None else [])}
        uses: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "system":
                text = _text(m.content)
                if not reminders or not out:
                    out.append({"role": "system", "content": text})
                elif out[-1]["role"] in ("user", "tool"):
                    out[-1]["content"] = (out[-1]["content"] + "\n\n" if out[-1]["content"] else "") + reminder(text)
                else:
                    out.append({"role": "user", "content": reminder(text)})
                continue
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
                elif isinstance(b, ToolResultBlock):
                    if m.role != "user":
                        raise InvalidRequest("tool_result blocks belong to user messages", f"{where}.type")
                    if b.tool_use_id not in uses:
                        raise InvalidRequest(
                            f"tool_use_id {b.tool_use_id!r} matches no earlier tool_use block", f"{where}.tool_use_id"
                        )
                    content = _result_text(b, known, where)
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

    def cache_session(self) -> str | None:
        """The prompt cache's session key: ``metadata.user_id``, Anthropic's one
        per-request identifier. Claude Code's (a JSON string holding its
        ``session_id``) changes with each session, and a plain user id keeps
        that user's recent prefixes: either way what comes back soon is kept."""
        return self.metadata.user_id if self.metadata is not None and self.metadata.user_id else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """``max_tokens``: the output limit resolved against the context (transport.wire.limits)."""
        d = SamplingParams()
        top_k = d.top_k if self.top_k is None else self.top_k
        return SamplingParams(
            max_tokens=max_tokens,
            # unset: greedy, Ember's default on every route (Anthropic's own is 1.0)
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=0 if top_k >= vocab_size else top_k,
            stop=list(self.stop_sequences or []),
            constraint=self.constraint(),
            cache_session=self.cache_session(),
        )

    def param_names(self) -> dict[str, str]:
        """The engine's names for fields this API spells differently (the ranges
        are the engine's, ``engine.limits``, checked once for every API)."""
        return {"stop": "stop_sequences", "constraint": "output_config.format" if self.constraint() else "tool_choice"}


def _refuse_media(block: Any, where: str) -> None:
    if isinstance(block, ImageBlock):
        raise InvalidRequest("image blocks need a vision model; this model reads text only", f"{where}.type")
    if isinstance(block, DocumentBlock):
        raise InvalidRequest(
            "document blocks are not read here; send the document's text as a text block", f"{where}.type"
        )


def _result_text(b: ToolResultBlock, known: dict[str, Tool], where: str) -> str:
    """A tool result as the template reads it; a ``tool_reference`` (Claude
    Code's ToolSearch loading a deferred tool) becomes that tool's definition,
    in place, so the history stays append-only."""
    if isinstance(b.content, str):
        return b.content
    parts = []
    for k, part in enumerate(b.content):
        if isinstance(part, TextBlock):
            parts.append(part.text)
        elif isinstance(part, ToolReferenceBlock):
            tool = known.get(part.tool_name)
            if tool is None:
                raise InvalidRequest(
                    f"tool_reference names {part.tool_name!r}, which is not in tools", f"{where}.content[{k}]"
                )
            parts.append(json.dumps(tool.as_template_tool()))
    return "\n".join(parts) if any(isinstance(p, ToolReferenceBlock) for p in b.content) else "".join(parts)


def template_error(exc: InvalidRequest) -> bool:
    """Whether the chat template refused the messages (not a check of Ember's)."""
    return str(exc).startswith(_TEMPLATE_ERROR)


class MessagesRequest(_Prompt, kw_only=True):
    pass


class CountTokensRequest(_Prompt, kw_only=True):
    pass


# ---------------------------------------------------------------------------
# Responses.


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    # Ember's extension, in the spirit of Anthropic's ``cache_miss_reason``:
    # where the prompt left the closest cached sequence (transport/turn/cache_miss.py)
    cache_miss: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


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
