"""OpenAI Responses request bodies as msgspec Structs (``POST /v1/responses``).

Stateless: nothing is stored, so ``store`` is accepted and treated as false and
``previous_response_id`` is a 400 (send the whole conversation as ``input``
items instead). Only function tools exist here; a hosted tool type
(``web_search``, ``file_search``…), ``reasoning`` or an unknown field is a 400
naming it. Input items: messages (``input_text`` / ``output_text`` parts),
``function_call`` and ``function_call_output``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from engine.errors import InvalidRequest
from engine.types import Constraint, SamplingParams
from transport.tools import ToolChoice, ToolSetup, check_schema, check_tool, template_arguments


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ContentPart(_Strict, kw_only=True):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


_ITEM_TYPES: dict[str, type] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(_Strict, kw_only=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(_Strict, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict, kw_only=True, dict=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    # accepted and ignored: they do not change what is generated
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}

    def thinking_choice(self) -> bool | None:
        """``reasoning.effort: "none"`` turns the template's reasoning off (None: its default)."""
        return False if (self.reasoning or {}).get("effort") == "none" else None

    def check(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "previous_response_id is not supported: this server keeps no responses (store is always false); "
                "send the whole conversation as input items",
                "previous_response_id",
            )
        if isinstance(self.input, str) and not self.input:
            raise InvalidRequest("input must not be empty", "input")
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequest("input must not be empty", "input")
        self._items = [self._item(i, raw) for i, raw in enumerate(self.input)] if isinstance(self.input, list) else []
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema is None:
                raise InvalidRequest("a json_schema format needs a schema", "text.format.schema")
            check_schema(fmt.schema, "text.format.schema")
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

    def tool_setup(self) -> ToolSetup:
        tools = [check_tool(t.name, t.description, t.parameters, f"tools[{i}]") for i, t in enumerate(self.tools or [])]
        c = self.tool_choice
        choice = ToolChoice(mode="named", name=c.name) if isinstance(c, NamedFunction) else ToolChoice(mode=c or "auto")
        return ToolSetup.of(tools, choice, self.parallel_tool_calls, "tool_choice")

    def constraint(self) -> Constraint | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint(kind="json_object")
        return Constraint(kind="json_schema", source=json.dumps(fmt.schema))

    def template_messages(self) -> list[dict[str, Any]]:
        """OpenAI chat-style messages for the template: consecutive function_call
        items join one assistant turn; each function_call_output must answer one."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        calls: set[str] = set()
        for i, item in enumerate(self._items):
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                args = template_arguments(item.arguments)
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
                calls.add(item.call_id)
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # the text the model wrote before its calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                if item.call_id not in calls:
                    raise InvalidRequest(
                        f"call_id {item.call_id!r} matches no earlier function_call item", f"input[{i}].call_id"
                    )
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def param_names(self, forced_tool: bool) -> dict[str, str]:
        """The engine's names for fields this API spells differently (the ranges
        are the engine's, ``engine.limits``, checked once for every API)."""
        return {"max_tokens": "max_output_tokens", "constraint": "tool_choice" if forced_tool else "text.format"}

    def sampling_params(self, default_max_tokens: int, vocab_size: int) -> SamplingParams:
        d = SamplingParams()
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_output_tokens is None else self.max_output_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
        )
