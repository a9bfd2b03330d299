"""JSON schemas as a grammar enforces them: an object writes only the
properties it lists, unless it says otherwise.

JSON Schema lets an object carry properties it does not list
(``additionalProperties`` defaults to true). Almost no client means that when
it asks for structured output or forces a tool call: pydantic (instructor,
LangChain, pydantic-ai, the Agents SDK without ``strict``) emits object
schemas with ``properties`` and no ``additionalProperties``. Taken literally, a
grammar lets a small model add invented keys until ``max_tokens`` and the
answer never closes (measured: instructor's TOOLS mode on the random-weight
``tiny`` model wrote ``"license": "x00", "share": …`` to the limit). So an
object that lists properties and says nothing about others is closed, as
xgrammar's default ``strict_mode`` (vLLM's default backend) does.

Left open, where closing would change the meaning: an object that says
``additionalProperties``, ``patternProperties`` or ``unevaluatedProperties``
itself, and the members of an ``allOf`` (each names only part of the
properties, so closing one would refuse the others').
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# keywords whose value is one schema / a list of schemas / a map of schemas
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects admit only their listed properties
    (see the module doc for what stays open); anything not a schema is returned as is."""
    return _close(schema, in_all_of=False)


def _close(node: Any, *, in_all_of: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key], in_all_of=False)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, in_all_of=False) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, in_all_of=True) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, in_all_of=False) for name, s in out[key].items()}
    composed = in_all_of or "allOf" in out or "$ref" in out
    if isinstance(out.get("properties"), dict) and not composed and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
