"""Tools on any model: one generic format for chat templates without tool support.

A template that cannot render ``tools`` (SmolLM2-135M-Instruct, the README's
default model) would otherwise refuse every request that offers a tool. For such
a template Ember rewrites the conversation before it reaches the template, in
the Hermes/Qwen2.5 form (which llama.cpp and others also use for models
without their own format), and parses calls back with the same markers:

- the tool list goes into the system prompt: the text of ``SYSTEM_TOOLS`` with
  each tool as one ``json.dumps`` line, appended to the leading system message
  (or, without one, as a system message put first). It depends only on the
  tools, so it is the same on every turn and the prefix stays cached;
- the model writes a call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  (``MARKUP``: the same markers and JSON form as the Hermes templates, so the
  streaming ``CallSplitter``, ``parallel_tool_calls`` and the forced-call
  grammar of transport/turn/tools.py work unchanged);
- an earlier assistant call is rendered back as that same text after the
  assistant's content, and tool results as ``<tool_response>\\n…\\n</tool_response>``
  in one user turn per run of consecutive results. Nothing already rendered is
  rewritten by a later turn: the history is append-only.

A template with its own tool format keeps it (``applies`` is false for it).
"""

from __future__ import annotations

import json
from typing import Any

from engine.tool_markup import ToolMarkup

START = "<tool_call>"
END = "</tool_call>"

SYSTEM_TOOLS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _parse_call(text: str, tools: Any = None) -> Any:
    """One call's JSON between the markers (used when it is not streamed)."""
    value = json.loads(text.strip())
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a tool call is a JSON object with a name")
    return {"name": value["name"], "arguments": value.get("arguments", {})}


MARKUP = ToolMarkup(start=START, end=END, parser=_parse_call, json_form=True)


def applies(native: ToolMarkup | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """The generic format is used when the template has no tool format and the
    request offers tools or its history carries calls or results."""
    if native is not None:
        return False
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def tools_text(tools: list[dict[str, Any]]) -> str:
    return SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict[str, Any]) -> str:
    """A call as the model writes it (and as the forced-call grammar pins it)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'{START}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": {args_text}}}\n{END}'


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation with tools, calls and results written as plain text,
    for a template that only renders roles and string contents."""
    out: list[dict[str, Any]] = []
    rest = list(messages)
    if tools:
        block = tools_text(tools)
        if rest and rest[0].get("role") == "system":
            first = rest.pop(0)
            content = first.get("content") or ""
            out.append({**first, "content": f"{content}\n\n{block}" if content else block})
        else:
            out.append({"role": "system", "content": block})
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for m in rest:
        role = m.get("role")
        if role == "tool":
            results.append(f"<tool_response>\n{m.get('content') or ''}\n</tool_response>")
            continue
        flush()
        if role == "assistant" and m.get("tool_calls"):
            content = m.get("content") or ""
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            sep = "\n" if content and not content.endswith("\n") else ""
            clean = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**clean, "content": content + sep + calls})
        else:
            out.append(m)
    flush()
    return out
