"""What the SGLang Model Gateway needs from a replica, without the gateway:
its probes (/server_info, /model_info, /get_load) and its request extension
fields, envelope fields every replica accepts at their neutral values (with or
without --trust-gateway, now a no-op alias). The bodies
below are the ones sglang-router 0.3.2 sent (captured; docs/distributed.md)."""

from __future__ import annotations

import json

import pytest

from tests.transport.test_http import CHAT, FAKE, assert_error, chat_prompt, expected_text, serving

pytestmark = pytest.mark.anyio

# What sglang-router 0.3.2 forwarded for {"messages": CHAT, "max_tokens": 5}.
GATEWAY_CHAT = {
    "messages": CHAT,
    "model": "unknown",
    "logprobs": False,
    "max_completion_tokens": 5,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
GATEWAY_COMPLETION = {
    "model": "fake-gpu-0",
    "prompt": "hello",
    "max_tokens": 5,
    "stream": True,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


@pytest.mark.parametrize("trust", [False, True])
async def test_replica_answers_gateway_chat_and_counts_fields(trust):
    """Without the flag (as a user runs it) and with it (the no-op alias)."""
    async with serving(trust_gateway=trust) as (_, client):
        r = await client.post("/v1/chat/completions", json=GATEWAY_CHAT)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "fake-gpu-0"  # "unknown" from the gateway means no model named
        assert body["choices"][0]["message"]["content"] == expected_text(chat_prompt(CHAT), 5)
        r = await client.post("/v1/completions", json=GATEWAY_COMPLETION)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        info = (await client.get("/server_info")).json()
        assert info["trust_gateway"] is trust
        assert info["gateway_extension_fields"]["no_stop_trim"] == 2
        assert info["gateway_extension_fields"]["separate_reasoning"] == 1
        metrics = (await client.get("/metrics")).text
        assert 'ember_gateway_extension_fields_total{field="no_stop_trim"} 2.0' in metrics
        envelope = (await client.get("/stats")).json()["envelope"]
        assert envelope["chat"]["no_stop_trim:ignored"] == 1
        assert envelope["completions"]["no_stop_trim:ignored"] == 1
        assert envelope["chat"]["stream_reasoning:ignored"] == 1
        assert 'ember_envelope_fields_total{action="ignored",field="return_hidden_states",route="chat"} 1.0' in metrics


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"no_stop_trimm": False}, "no_stop_trimm"),  # a misspelt field is still a 400
        ({"temprature": 0.5}, "temprature"),
        ({"no_stop_trim": True}, "no_stop_trim"),  # an extension Ember cannot honour
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
    ],
)
@pytest.mark.parametrize("trust", [False, True])
async def test_replica_still_refuses_what_it_cannot_do(extra, param, trust):
    async with serving(trust_gateway=trust) as (_, client):
        r = await client.post("/v1/chat/completions", json={**GATEWAY_CHAT, **extra})
        assert_error(r, 400, param=param)
        info = (await client.get("/server_info")).json()
        assert info["gateway_extension_fields"] == {}  # nothing counted for a refused request
        assert "chat" not in (await client.get("/stats")).json()["envelope"]


async def test_unknown_model_is_only_an_alias_from_the_gateway():
    """Without the gateway's fields "unknown" is a model name like any other."""
    async with serving(trust_gateway=True) as (_, client):
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "model": "unknown", "max_tokens": 2})
        assert_error(r, 404, param="model", code="model_not_found")


async def test_probes_name_the_served_model():
    async with serving(
        FAKE.__class__(**{**{f: getattr(FAKE, f) for f in FAKE.__struct_fields__}, "model_name": "m1"})
    ) as (_, client):
        info = (await client.get("/server_info")).json()
        assert info["served_model_name"] == "m1"
        assert "model_path" not in info  # the gateway would try to download "m1" from the hub
        assert info["max_running_requests"] == FAKE.max_batch
        assert info["max_total_tokens"] > 0
        assert (await client.get("/get_server_info")).json() == info
        model = (await client.get("/model_info")).json()
        assert model["served_model_name"] == "m1" and model["is_generation"] is True
        assert (await client.get("/get_model_info")).json() == model
        assert (await client.get("/health_generate")).status_code == 200


async def test_get_load_counts_running_requests_and_tokens():
    async with serving() as (app, client):
        idle = (await client.get("/get_load")).json()
        assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        engine = app.state.ember.engine
        stream = await engine.asubmit(chat_prompt(CHAT), engine_params(max_tokens=50))
        async with stream:
            seen = []
            async for _ in stream:
                seen.append((await client.get("/get_load")).json()[0])
                if len(seen) == 3:
                    break
        assert all(s["num_reqs"] == 1 for s in seen), seen
        assert seen[-1]["num_tokens"] >= len(chat_prompt(CHAT)), seen
        assert json.dumps(seen)  # plain JSON numbers


def engine_params(**kw):
    from engine.types import SamplingParams

    return SamplingParams(**kw)


async def test_reasoning_switches_are_free_on_a_model_that_does_not_reason():
    async with serving() as (_, client):
        body = {**GATEWAY_CHAT, "separate_reasoning": False, "stream_reasoning": False}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def test_reasoning_left_in_the_answer_is_refused_on_a_model_that_reasons():
    from collections import Counter

    from engine.errors import InvalidRequest
    from transport.openai.gateway_compat import GatewayChatCompletionRequest, check_extensions
    from transport.turn.decode import decode_request

    req = decode_request(
        json.dumps({**GATEWAY_CHAT, "separate_reasoning": False}).encode(), GatewayChatCompletionRequest
    )
    assert check_extensions(req, Counter(), reasons=False)  # a no-op there
    with pytest.raises(InvalidRequest) as err:
        check_extensions(req, Counter(), reasons=True)
    assert err.value.param == "separate_reasoning"
    neutral = decode_request(json.dumps(GATEWAY_CHAT).encode(), GatewayChatCompletionRequest)
    assert len(check_extensions(neutral, Counter(), reasons=True)) == 6
