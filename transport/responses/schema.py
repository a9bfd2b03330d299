"""OpenAI Responses request bodies as msgspec Structs (``POST /v1/responses``).

Every field the current clients send (Codex CLI 0.171, the OpenAI Agents SDK,
instructor, LangChain, litellm, pydantic-ai; the complete list is the
``openai`` SDK's ``ResponseCreateParams``) is honoured, accepted as a counted
no-op where that is the right meaning for a local server, or a 400 that says
what to change where ignoring it would change what the client relies on
(``background: true``, ``conversation``, a stored ``prompt``). The table is in
docs/agent-api.md; ``envelope_notes`` lists what a request counted.

Tools: ``function``; ``namespace`` (Codex's group of function tools,
flattened to ``NS__NAME`` function tools for the template, mapped back to
``name`` + ``namespace`` on output); ``custom`` (freeform: a tool taking one
string, rendered as a function with a single ``input`` argument and answered
as a ``custom_tool_call``); hosted tools that cannot run here (``web_search``,
``file_search``, ``code_interpreter``…) are left out of the prompt and
counted as dropped; forcing one is a 400.

Input items: messages (``input_text`` / ``output_text`` parts),
``function_call`` / ``function_call_output``, ``custom_tool_call`` /
``custom_tool_call_output``, and ``reasoning`` items (accepted and not
re-rendered: a template drops earlier turns' reasoning anyway, and the
summary is not what the model wrote).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.types import Constraint, SamplingParams
from transport.turn.tools import Tool, ToolChoice, ToolSetup, check_schema, check_tool, template_arguments


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _Loose(msgspec.Struct, kw_only=True):
    pass


class ContentPart(_Strict, kw_only=True):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # Codex marks assistant messages "commentary" / "final_answer"

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict, kw_only=True):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class CustomToolCallItem(_Strict, kw_only=True):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Loose, kw_only=True):
    """Accepted as sent (``summary``, ``content``, ``encrypted_content``…); not rendered."""

    type: Literal["reasoning"]


_ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}

# Tools the platform runs on its side: nothing here can run them, so they are
# left out of the prompt (counted ``dropped``); forcing one is a 400.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

# Codex's namespaced tools become one function tool each, named NS + SEP + NAME.
NAMESPACE_SEP = "__"

# ``include`` values: each names output Ember never produces (a hosted tool's
# results, encrypted reasoning) and so is a no-op, except logprobs, which a
# client that asks for them reads.
_INCLUDE_NOOP = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class Reasoning(_Strict, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None


class TextFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict, kw_only=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ToolKind(msgspec.Struct, frozen=True, kw_only=True):
    """Where a flattened tool came from, to spell its calls as the client expects."""

    kind: Literal["function", "custom"] = "function"
    name: str = ""
    namespace: str | None = None


# The one argument a custom (freeform) tool's call carries in the template.
CUSTOM_INPUT = "input"


def _custom_parameters(fmt: Any, param: str) -> tuple[dict[str, Any], str]:
    """A custom tool as a function taking one string; its grammar, if any, is
    told to the model in the description (text), not enforced."""
    note = ""
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
            raise InvalidRequest("a custom tool's format is {type: text} or {type: grammar, ...}", f"{param}.format")
        if fmt["type"] == "grammar":
            syntax, definition = fmt.get("syntax"), fmt.get("definition")
            if not isinstance(definition, str) or syntax not in ("lark", "regex"):
                raise InvalidRequest(
                    "a grammar format needs syntax (lark or regex) and a definition", f"{param}.format"
                )
            note = f"\n\nThe input must follow this {syntax} grammar:\n{definition}"
    schema = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "the tool's input, as free text"}},
        "required": [CUSTOM_INPUT],
    }
    return schema, note


class ResponsesRequest(_Strict, kw_only=True, dict=True):
    model: str | None = None
    keep_alive: float | str | None = None  # Ollama's: seconds or "5m"; negative: never unload (ember/registry.py)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # the response store (transport/responses/store.py)
    previous_response_id: str | None = None
    store: bool | None = None
    # honoured elsewhere or checked in ``check``
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = None
    # the prompt cache's session key (SamplingParams.cache_session; engine.kv.prompt_cache)
    prompt_cache_key: str | None = None
    # counted no-ops: nothing a local server does changes with them (docs/agent-api.md)
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    context_management: list[dict[str, Any]] | None = None
    # refused with a reason: ignoring them would change what the client relies on
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    def check(self) -> ResponsesRequest:
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequest("input must not be empty", "input")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequest("input must not be empty", "input")
        if self.background:
            raise InvalidRequest(
                "background responses are not supported: this server answers while the request is open "
                "(send background: false, or stream)",
                "background",
            )
        if self.conversation is not None:
            raise InvalidRequest(
                "conversation objects are not supported: send the conversation as input items, "
                "or chain turns with previous_response_id and store: true",
                "conversation",
            )
        if self.prompt is not None:
            raise InvalidRequest(
                "stored prompt templates are not supported here: send the prompt as instructions and input",
                "prompt",
            )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20", "top_logprobs")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise InvalidRequest("max_tool_calls must be at least 1", "max_tool_calls")
        for i, value in enumerate(self.include or []):
            if value == "message.output_text.logprobs":
                raise InvalidRequest(
                    "output logprobs are not returned on /v1/responses; use /v1/chat/completions with logprobs",
                    f"include[{i}]",
                )
            if value not in _INCLUDE_NOOP:
                raise InvalidRequest(f"unknown include value {value!r}", f"include[{i}]")
        self._items = [self._item(i, raw) for i, raw in enumerate(self.input)] if isinstance(self.input, list) else []
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema is None:
                raise InvalidRequest("a json_schema format needs a schema", "text.format.schema")
            check_schema(fmt.schema, "text.format.schema")
        self._kinds: dict[str, ToolKind] = {}
        self._dropped: list[str] = []
        self._tools = self._flatten_tools()
        return self

    @staticmethod
    def _item(i: int, raw: dict[str, Any]) -> Any:
        kind = raw.get("type", "message")
        cls = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise InvalidRequest(f"input items of type {kind!r} are not supported", f"input[{i}].type")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            message = str(exc)
            at = message.rsplit("- at `$", 1)
            param = f"input[{i}]" + (at[1].rstrip("`") if len(at) == 2 else "")
            raise InvalidRequest(message, param) from None

    # ---- tools -------------------------------------------------------------
    def _flatten_tools(self) -> list[Tool]:
        out: list[Tool] = []
        for i, raw in enumerate(self.tools or []):
            param = f"tools[{i}]"
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind in HOSTED_TOOLS:
                self._dropped.append(str(kind))
            elif kind == "namespace":
                ns = raw.get("name")
                if not isinstance(ns, str) or not ns:
                    raise InvalidRequest("a namespace needs a name", f"{param}.name")
                inner = raw.get("tools")
                if not isinstance(inner, list):
                    raise InvalidRequest("a namespace's tools must be a list", f"{param}.tools")
                for j, sub in enumerate(inner):
                    out.append(self._one_tool(sub, f"{param}.tools[{j}]", ns))
            elif kind in ("function", "custom"):
                out.append(self._one_tool(raw, param, None))
            else:
                raise InvalidRequest(f"tools of type {kind!r} are not supported", f"{param}.type")
        return out

    def _one_tool(self, raw: Any, param: str, ns: str | None) -> Tool:
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("function", "custom"):
            raise InvalidRequest(f"a namespace holds function or custom tools, not {kind!r}", f"{param}.type")
        allowed = {"type", "name", "description", "parameters", "strict", "format", "defer_loading"}
        allowed |= {"allowed_callers", "output_schema", "async"}
        extra = sorted(set(raw) - allowed)
        if extra:
            raise InvalidRequest(f"unknown tool field {extra[0]!r}", f"{param}.{extra[0]}")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("a tool needs a name", f"{param}.name")
        flat = f"{ns}{NAMESPACE_SEP}{name}" if ns else name
        description = raw.get("description")
        if kind == "custom":
            parameters, note = _custom_parameters(raw.get("format"), param)
            description = ((description or "") + note) or None
            tool = check_tool(flat, description, parameters, param)
        else:
            tool = check_tool(flat, description, raw.get("parameters"), param, strict=bool(raw.get("strict")))
        self._kinds[flat] = ToolKind(kind=kind, name=name, namespace=ns)
        return tool

    def tool_kind(self, flat: str) -> ToolKind:
        """How a call to the flattened tool ``flat`` goes back to the client."""
        return self._kinds.get(flat) or ToolKind(name=flat)

    def _choice(self) -> tuple[ToolChoice, list[Tool]]:
        c = self.tool_choice
        tools = self._tools
        if c is None or isinstance(c, str):
            return ToolChoice(mode=c or "auto"), tools
        kind = c.get("type")
        if kind in ("function", "custom"):
            name = c.get("name")
            if not isinstance(name, str):
                raise InvalidRequest("a named tool_choice needs a name", "tool_choice.name")
            ns = c.get("namespace")
            return ToolChoice(mode="named", name=f"{ns}{NAMESPACE_SEP}{name}" if ns else name), tools
        if kind == "allowed_tools":
            mode = c.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise InvalidRequest("allowed_tools mode is auto or required", "tool_choice.mode")
            names = set()
            for t in c.get("tools") or []:
                if isinstance(t, dict) and t.get("type") in HOSTED_TOOLS:
                    continue
                if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                    raise InvalidRequest("allowed_tools lists tools by type and name", "tool_choice.tools")
                ns = t.get("namespace")
                names.add(f"{ns}{NAMESPACE_SEP}{t['name']}" if ns else t["name"])
            return ToolChoice(mode=mode), [t for t in tools if t.name in names]
        if kind in HOSTED_TOOLS:
            raise InvalidRequest(
                f"tool_choice forces the hosted tool {kind!r}, which cannot run on this server", "tool_choice"
            )
        raise InvalidRequest(f"unknown tool_choice type {kind!r}", "tool_choice.type")

    def tool_setup(self) -> ToolSetup:
        choice, tools = self._choice()
        return ToolSetup.of(tools, choice, self.parallel_tool_calls, "tool_choice")

    # ---- what the request counts ------------------------------------------
    def envelope_notes(self) -> list[tuple[str, str]]:
        """(field, action) for docs/agent-api.md's counter: every accepted no-op,
        honoured envelope field and dropped hosted tool in this request."""
        notes: list[tuple[str, str]] = []
        if self.prompt_cache_key is not None:
            notes.append(("prompt_cache_key", "honoured"))
        for name in (
            "prompt_cache_retention",
            "prompt_cache_options",
            "client_metadata",
            "metadata",
            "user",
            "safety_identifier",
            "service_tier",
            "stream_options",
            "max_tool_calls",
            "context_management",
            "top_logprobs",
        ):
            if getattr(self, name) is not None:
                notes.append((name, "ignored"))
        if self.include is not None:
            notes.append(("include", "ignored"))
        if self.reasoning is not None and self.thinking_choice() is None:  # an effort is counted where it acts
            notes.append(("reasoning", "ignored"))
        if self.truncation == "auto":
            notes.append(("truncation", "ignored"))
        if self.text is not None and self.text.verbosity is not None:
            notes.append(("text.verbosity", "ignored"))
        if any(isinstance(item, ReasoningItem) for item in self._items):
            notes.append(("input.reasoning", "ignored"))
        if self.store is not None:
            notes.append(("store", "honoured"))
        if self.previous_response_id is not None:
            notes.append(("previous_response_id", "honoured"))
        if self._kinds and any(k.namespace for k in self._kinds.values()):
            notes.append(("tools.namespace", "honoured"))
        if any(k.kind == "custom" for k in self._kinds.values()):
            notes.append(("tools.custom", "honoured"))
        notes += [(f"tools.{kind}", "dropped") for kind in self._dropped]
        return notes

    def thinking_choice(self) -> bool | None:
        """Whether the client asked for reasoning: ``reasoning.effort`` ``none``
        turns it off (False), any other effort on (True); None: not said. For the
        chat template's ``enable_thinking`` (transport/turn/reasoning.py)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        return False if effort == "none" else None  # other efforts: the template's default

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint(kind="json_object")
        return Constraint(kind="json_schema", source=json.dumps(fmt.schema))

    def template_messages(self, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """OpenAI chat-style messages for the template: consecutive function_call
        items join one assistant turn; each function_call_output must answer one.
        ``history``: the stored items of ``previous_response_id``'s chain
        (their input, then their output), rendered before this request's input
        exactly as they would be if the client had sent them."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items: list[tuple[str, Any]] = []
        for j, raw in enumerate(history or []):
            items.append((f"previous_response_id (item {j})", self._item(j, raw)))
        if isinstance(self.input, str):
            items.append(("input", MessageItem(role="user", content=self.input)))
        else:
            items += [(f"input[{i}]", item) for i, item in enumerate(self._items)]
        calls: set[str] = set()
        for where, item in items:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
                name = f"{item.namespace}{NAMESPACE_SEP}{item.name}" if item.namespace else item.name
                if isinstance(item, CustomToolCallItem):
                    args: Any = {CUSTOM_INPUT: item.input}
                else:
                    args = template_arguments(item.arguments)
                call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": args}}
                calls.add(item.call_id)
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # the text the model wrote before its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in calls:
                    raise InvalidRequest(
                        f"call_id {item.call_id!r} matches no earlier function_call item", f"{where}.call_id"
                    )
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            # ReasoningItem: not rendered (module docstring)
        return out

    def param_names(self) -> dict[str, str]:
        """The engine's names for fields this API spells differently (the ranges
        are the engine's, ``engine.limits``, checked once for every API; a forced
        tool call's constraint is reported on ``tool_choice`` by the road)."""
        return {"max_tokens": "max_output_tokens", "constraint": "text.format"}

    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    def sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """``max_tokens``: the output limit resolved against the context (transport.wire.limits)."""
        d = SamplingParams()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            cache_session=self.prompt_cache_key,
        )
