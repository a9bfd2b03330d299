"""``POST /v1/responses`` takes what Codex CLI 0.171 and the OpenAI SDK send:
the captured Codex bodies (tests/transport/fixtures/, recorded from
``codex exec`` against a logging server), namespace and custom tools mapped
back on output, hosted tools dropped and counted, and turns chained with
``previous_response_id`` rendering the same prompt as the whole conversation."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import openai
import pytest

from tests.transport.test_agent_render import MARKUP, completion
from tests.transport.test_http import serving
from transport.responses.api import ResponsesRenderer
from transport.responses.schema import ResponsesRequest
from transport.responses.store import ResponseNotFound, ResponseStore
from transport.turn.tool_calls import CallSplitter

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["codex_0.171.0_first_request.json", "codex_0.171.0_tool_result_request.json"])
async def test_codex_bodies_are_answered_and_counted(name):
    body = json.loads((FIXTURES / name).read_text())
    body["model"] = "fake-gpu-0"
    for item in body["input"]:  # the byte tokenizer's prompt must fit the fake GPU's 32k context
        for part in item.get("content") or []:
            part["text"] = part["text"][:2000]
    async with serving() as (_, client):
        r = await client.post("/v1/responses", json={**body, "max_output_tokens": 4})
        assert r.status_code == 200, r.text[:500]
        assert '"type":"response.incomplete"' in r.text  # 4 tokens: cut short, as asked
        env = (await client.get("/stats")).json()["envelope"]["responses"]
    for key in ("include:ignored", "prompt_cache_key:honoured", "client_metadata:ignored"):
        assert env[key] == 1, key
    assert any(k.startswith("reasoning:") for k in env)  # counted by transport/turn/reasoning.py
    assert env["tools.web_search:dropped"] == 1 and env["tools.namespace:honoured"] == 1
    if "tool_result" in name:
        assert env["input.reasoning:ignored"] == 1


def _req(body):
    return msgspec.convert(body, ResponsesRequest).check()


NS_TOOL = {
    "type": "namespace",
    "name": "agents",
    "description": "d",
    "tools": [{"type": "function", "name": "close", "parameters": {"type": "object"}}],
}
CUSTOM = {
    "type": "custom",
    "name": "apply_patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}


def test_namespace_and_custom_tools_flatten_and_map_back():
    req = _req({"input": "x", "tools": [NS_TOOL, CUSTOM, {"type": "web_search"}]})
    names = [t["function"]["name"] for t in req.tool_setup().template_tools()]
    assert names == ["agents__close", "apply_patch"]  # web_search left out
    text = (
        '<tool_call>\n{"name": "agents__close", "arguments": {"target": "a1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}\n</tool_call>'
    )
    r = ResponsesRenderer("m", req, CallSplitter(MARKUP, ["agents__close", "apply_patch"]))
    resp = openai.types.responses.Response.model_validate_json(r.body(completion(text)))
    fc, ctc = resp.output
    assert (fc.type, fc.name, fc.namespace, json.loads(fc.arguments)) == (
        "function_call",
        "close",
        "agents",
        {"target": "a1"},
    )
    assert (ctc.type, ctc.name, ctc.input) == ("custom_tool_call", "apply_patch", "*** Begin Patch")
    # sent back, they render as the calls the model wrote
    back = _req(
        {
            "input": [
                {"role": "user", "content": "x"},
                {
                    "type": "function_call",
                    "call_id": fc.call_id,
                    "name": "close",
                    "namespace": "agents",
                    "arguments": fc.arguments,
                },
                {"type": "custom_tool_call", "call_id": ctc.call_id, "name": "apply_patch", "input": ctc.input},
                {"type": "function_call_output", "call_id": fc.call_id, "output": "ok"},
                {"type": "custom_tool_call_output", "call_id": ctc.call_id, "output": "done"},
                {"type": "reasoning", "summary": [], "encrypted_content": "x"},
            ],
            "tools": [NS_TOOL, CUSTOM],
        }
    )
    calls = back.template_messages()[1]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["agents__close", "apply_patch"]
    assert calls[1]["function"]["arguments"] == {"input": "*** Begin Patch"}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(extra, param):
    from engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as e:
        _req({"input": "x", **extra}).tool_setup()
    assert e.value.param == param


def test_sdk_envelope_fields_are_accepted():
    req = _req(
        {
            "input": "x",
            "include": [],
            "store": False,
            "reasoning": {"effort": "none", "summary": "auto"},
            "truncation": "auto",
            "top_logprobs": 0,
            "service_tier": "auto",
            "safety_identifier": "u",
            "stream_options": {"include_obfuscation": False},
            "background": False,
            "max_tool_calls": 3,
            "user": "u",
            "metadata": {"a": "b"},
            "prompt_cache_key": "k",
            "prompt_cache_retention": "24h",
            "client_metadata": {"a": "b"},
            "context_management": [{"type": "compaction"}],
        }
    )
    assert req.thinking_choice() is False
    assert ("truncation", "ignored") in req.envelope_notes()


async def test_previous_response_id_renders_the_whole_conversation_and_hits_the_cache():
    async with serving() as (_, client):
        turn1 = {"input": "hello", "instructions": "be brief", "store": True, "max_output_tokens": 5}
        r1 = (await client.post("/v1/responses", json=turn1)).json()
        r2 = await client.post(
            "/v1/responses",
            json={
                "input": "more",
                "instructions": "be brief",
                "previous_response_id": r1["id"],
                "max_output_tokens": 3,
            },
        )
        assert r2.status_code == 200, r2.text
        full = [{"role": "user", "content": "hello"}, *r1["output"], {"role": "user", "content": "more"}]
        r3 = (
            await client.post("/v1/responses", json={"input": full, "instructions": "be brief", "max_output_tokens": 3})
        ).json()
        u2 = r2.json()["usage"]
        assert u2["input_tokens"] == r3["usage"]["input_tokens"]  # the same prompt
        assert u2["input_tokens_details"]["cached_tokens"] >= r1["usage"]["input_tokens"]  # the previous turn is a hit
        r = await client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_gone"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"


def test_response_store_is_bounded_by_count_and_bytes():
    s = ResponseStore(max_responses=2, max_bytes=200)
    s.put("a", [{"x": "1"}])
    s.put("b", [{"x": "2"}])
    s.get("a")  # a is now the most recent
    s.put("c", [{"x": "3"}])
    assert "b" not in s and "a" in s and "c" in s
    assert not s.put("big", [{"x": "y" * 300}])
    s.put("d", [{"x": "z" * 150}])
    assert len(s) == 2 and "d" in s and s.bytes <= 200
    with pytest.raises(ResponseNotFound):
        s.get("a")
