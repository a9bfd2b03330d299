"""What the SGLang Model Gateway needs from a replica, without the gateway:
its probes (/server_info, /model_info, /get_load) and its request extension
fields, which only a replica started with --trust-gateway accepts. The bodies
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


async def test_untrusted_replica_refuses_gateway_fields():
    async with serving() as (_, client):
        r = await client.post("/v1/chat/completions", json=GATEWAY_CHAT)
        assert_error(r, 400, param="no_stop_trim")


async def test_trusted_replica_answers_gateway_chat_and_counts_fields():
    async with serving(trust_gateway=True) as (_, client):
        r = await client.post("/v1/chat/completions", json=GATEWAY_CHAT)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "fake-gpu-0"  # "unknown" from the gateway means no model named
        assert body["choices"][0]["message"]["content"] == expected_text(chat_prompt(CHAT), 5)
        r = await client.post("/v1/completions", json=GATEWAY_COMPLETION)
        assert r.status_code == 200 and "data: [DONE]" in r.text
        info = (await client.get("/server_info")).json()
        assert info["trust_gateway"] is True
        assert info["gateway_extension_fields"]["no_stop_trim"] == 2
        assert info["gateway_extension_fields"]["separate_reasoning"] == 1
        metrics = (await client.get("/metrics")).text
        assert 'ember_gateway_extension_fields_total{field="no_stop_trim"} 2.0' in metrics


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"no_stop_trimm": False}, "no_stop_trimm"),  # a misspelt field is still a 400
        ({"temprature": 0.5}, "temprature"),
        ({"no_stop_trim": True}, "no_stop_trim"),  # an extension Ember cannot honour
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ],
)
async def test_trusted_replica_still_refuses_what_it_cannot_do(extra, param):
    async with serving(trust_gateway=True) as (_, client):
        r = await client.post("/v1/chat/completions", json={**GATEWAY_CHAT, **extra})
        assert_error(r, 400, param=param)
        info = (await client.get("/server_info")).json()
        assert info["gateway_extension_fields"] == {}  # nothing counted for a refused request


async def test_unknown_model_is_only_an_alias_behind_a_trusted_gateway():
    async with serving() as (_, client):
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
