"""Function tools, shared by the three chat APIs (Chat Completions, Anthropic
Messages, OpenAI Responses): the checked tool list, the tool choice, and the
grammar that forces a call.

Each API decodes its own spelling of tools into ``Tool`` and of the choice into
``ToolChoice``; from there the prompt (the model's chat template with
``tools=``), the constraint and the parsing of calls (transport/turn/tool_calls.py)
are the same code.

A forced call (``required``, a named function, Anthropic's ``any``/``tool``) is
a Lark grammar for llguidance in the template's own call format, with each
function's ``parameters`` schema inlined as ``%json``. The JSON is pinned to
``json.dumps``'s separators, which is how a chat template's ``tojson`` renders
the call back into the next turn's prompt: the model's call and its re-rendering
are the same text, so the prompt cache keeps matching (docs/agent-api.md).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from engine.closed_schema import close_objects
from engine.errors import InvalidRequest
from engine.types import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_TOOLS = 128

# The separators a template's `tojson` (json.dumps) writes; whitespace is not free.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = {}
    strict: bool = False  # the schema must compile: calls are to follow it (``ToolSetup.of`` checks)
    param: str = "tools"  # where the tool sits in the request, for a 400 about its schema
    schema_field: str = "parameters"
    hidden: bool = False  # offered (callable, parsed) but not rendered: Anthropic's ``defer_loading``

    def as_template_tool(self) -> dict[str, Any]:
        """OpenAI's shape, which chat templates (and mlx-lm) read."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class ToolChoice(msgspec.Struct, frozen=True, kw_only=True):
    """``none``: no tools are offered or parsed; ``auto``: the model may call;
    ``required``: it must call one (or more, if parallel); ``named``: it must
    call ``name``."""

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None


def check_tool(
    name: Any,
    description: Any,
    parameters: Any,
    param: str,
    schema_field: str = "parameters",
    *,
    strict: bool = False,
    hidden: bool = False,
) -> Tool:
    """One tool definition, checked for what rendering it needs; ``param`` is
    where it sits in the request, ``schema_field`` what this API calls its
    schema. The grammar engine compiles the schema only when a request enforces
    it (a forced call, ``strict``): ``ToolSetup.of``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest("a tool name must be 1-64 letters, digits, '_', '-', '.' or ':'", f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest("a tool description must be a string", f"{param}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_structure(parameters, f"{param}.{schema_field}")
    if parameters.get("type", "object") != "object":
        raise InvalidRequest("a tool's parameters must be a JSON schema of type object", f"{param}.{schema_field}")
    return Tool(
        name=name,
        description=description,
        parameters=parameters,
        strict=bool(strict),
        param=param,
        schema_field=schema_field,
        hidden=hidden,
    )


def check_structure(schema: Any, param: str) -> None:
    """What rendering a schema needs: an object whose structural keywords
    (``type``, ``properties``, ``required``, ``items``) have the right shapes.
    Other keywords (``propertyNames``, ``$defs``, 2020-12's ``prefixItems``…)
    are rendered as they are; whether the grammar engine can compile them
    matters only where a request enforces the schema (``compile_schema``)."""
    if not isinstance(schema, dict):
        raise InvalidRequest("a JSON schema must be an object", param)
    kind = schema.get("type")
    types = {"object", "array", "string", "number", "integer", "boolean", "null"}
    if kind is not None and not (
        (isinstance(kind, str) and kind in types)
        or (isinstance(kind, list) and kind and all(isinstance(k, str) and k in types for k in kind))
    ):
        raise InvalidRequest(f"unknown JSON schema type {kind!r}", f"{param}.type")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise InvalidRequest("properties must be an object", f"{param}.properties")
        for key, sub in props.items():
            if not isinstance(sub, (dict, bool)):
                raise InvalidRequest("a property's schema must be an object", f"{param}.properties.{key}")
            if isinstance(sub, dict):
                check_structure(sub, f"{param}.properties.{key}")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise InvalidRequest("required must be a list of property names", f"{param}.required")
    items = schema.get("items")
    if isinstance(items, dict):
        check_structure(items, f"{param}.items")
    elif items is not None and not isinstance(items, bool):
        raise InvalidRequest("items must be a schema", f"{param}.items")


def check_schema(schema: Any, param: str, why: str = "this format") -> None:
    """A schema the output is always held to (a response format): its shape,
    then the grammar engine's verdict."""
    check_structure(schema, param)
    compile_schema(schema, param, why)


def compile_schema(schema: dict[str, Any], param: str, why: str) -> None:
    """The grammar engine's verdict on a schema a request enforces (``why``:
    what enforces it); a schema it cannot compile is a 400 naming the keyword."""
    from llguidance import LLMatcher, grammar_from

    try:
        error = LLMatcher.validate_grammar(grammar_from("json_schema", json.dumps(schema)))
    except Exception as exc:  # a schema it cannot even parse
        error = str(exc)
    if error:
        raise InvalidRequest(f"the JSON schema cannot be compiled, which {why} needs: {error}", param)


def check_tools(tools: list[Tool], choice: ToolChoice, param_choice: str) -> None:
    """Names are unique; a named choice names one of them; forcing needs tools."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools", "tools")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise InvalidRequest(f"two tools are named {t.name!r}", f"tools[{i}].name")
        seen.add(t.name)
    if choice.mode == "named" and choice.name not in seen:
        raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools", param_choice)
    if choice.mode in ("required", "named") and not tools:
        raise InvalidRequest("tool_choice forces a tool call but no tools were given", param_choice)
    if choice.mode == "none":
        return
    forced = choice.mode in ("required", "named")
    for t in tools:
        enforced = forced and (choice.mode == "required" or t.name == choice.name)
        if enforced or t.strict:
            why = "a forced call" if enforced else "strict: true"
            compile_schema(t.parameters or {"type": "object"}, f"{t.param}.{t.schema_field}", why)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal escapes like JSON


def forced_call_grammar(tools: list[Tool], choice: ToolChoice, *, parallel: bool, start: str, end: str) -> Constraint:
    """A Lark grammar (llguidance's dialect) for output that is one call — or,
    with ``parallel``, one or more calls — in the Hermes/Qwen form mlx-lm's
    ``json_tools`` parser reads: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    chosen = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    rules = []
    alts = []
    for i, t in enumerate(chosen):
        head = f'{start}\n{{"name": {json.dumps(t.name)}, "arguments": '
        params = t.parameters or {"type": "object", "properties": {}}  # no parameters: the call writes {}
        schema = {**close_objects(params), "x-guidance": _JSON_STYLE}
        rules.append(f"call{i}: {_lark_string(head)} args{i} {_lark_string('}' + chr(10) + end)}")
        rules.append(f"args{i}: %json {json.dumps(schema)}")
        alts.append(f"call{i}")
    top = "call: " + " | ".join(alts)
    first = 'start: call ("\\n" call)*' if parallel else "start: call"
    return Constraint(kind="lark", source="\n".join([first, top, *rules]))


def template_arguments(text: str) -> Any:
    """A call's arguments as a chat template reads them: the object, or — for a
    call that max_tokens cut short, which agent frameworks send back as they got
    it — the text as the model wrote it (a template that `tojson`s it quotes it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def new_call_id(prefix: str = "call_") -> str:
    import uuid

    return prefix + uuid.uuid4().hex[:24]


class ToolSetup(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools, as every API's handler uses them."""

    tools: list[Tool] = []
    choice: ToolChoice = ToolChoice()
    parallel: bool = True
    param_choice: str = "tool_choice"

    @classmethod
    def of(cls, tools: list[Tool], choice: ToolChoice, parallel: bool | None, param_choice: str) -> ToolSetup:
        check_tools(tools, choice, param_choice)
        return cls(tools=tools, choice=choice, parallel=parallel is not False, param_choice=param_choice)

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice.mode in ("required", "named")

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.active:
            return None
        return [t.as_template_tool() for t in self.tools if not t.hidden] or None

    def check_markup(self, markup: Any) -> None:
        """The model must be able to write calls, and a forced call needs a grammar for its form."""
        if not self.active:
            return
        if markup is None:
            raise InvalidRequest("this model's chat template does not support tools", "tools")
        if self.forced and not markup.json_form:
            raise InvalidRequest(
                "forcing a tool call needs a template in the Hermes/Qwen <tool_call> JSON form", self.param_choice
            )

    def constraint(self, markup: Any) -> Constraint | None:
        if not self.forced:
            return None
        # A named choice is one call of that function (OpenAI's and vLLM's meaning):
        # left open, a model that does not stop on its own writes the call again
        # until max_tokens and the answer ends "length", which clients treat as failed.
        parallel = self.parallel and self.choice.mode != "named"
        return forced_call_grammar(self.tools, self.choice, parallel=parallel, start=markup.start, end=markup.end)
