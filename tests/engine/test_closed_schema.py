"""engine/closed_schema.py: objects a grammar writes admit only their listed
properties, except where the schema says otherwise or closing would change it."""

from __future__ import annotations

import json

import jsonschema
import llguidance

from engine.closed_schema import close_objects

# pydantic's shape for a model with a nested model and a list of them
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "stops": {"type": "array", "items": {"$ref": "#/$defs/Stop"}},
        "extra": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
    },
    "required": ["city"],
    "$defs": {"Stop": {"type": "object", "properties": {"name": {"type": "string"}}}},
}


def test_listed_properties_close_the_object_at_every_depth():
    closed = close_objects(FORECAST)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Stop"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in FORECAST  # a copy: the request's schema is untouched
    ok = {"city": "Oslo", "stops": [{"name": "a"}], "extra": {"a": 1}}
    jsonschema.validate(ok, closed)
    for bad in ({**ok, "license": "x"}, {**ok, "stops": [{"name": "a", "x": 1}]}, {**ok, "extra": {"a": 1, "b": 2}}):
        try:
            jsonschema.validate(bad, closed)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"closed schema admitted {bad}")


def test_what_the_schema_says_or_composes_stays_open():
    said = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(said) == said
    pattern = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert "additionalProperties" not in close_objects(pattern)
    # allOf members each name part of the object: closing one would refuse the other's keys
    parts = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    closed = close_objects(parts)
    jsonschema.validate({"a": 1, "b": 2}, closed)
    assert all("additionalProperties" not in s for s in closed["allOf"])
    assert close_objects(True) is True and close_objects({"type": "object"}) == {"type": "object"}


def test_llguidance_compiles_the_closed_schema():
    grammar = llguidance.LLMatcher.grammar_from_json_schema(close_objects(FORECAST))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    json.dumps(close_objects(FORECAST))  # still plain JSON
