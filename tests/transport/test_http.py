"""The HTTP adapter against the fake GPU, in virtual time: every route, status
code and error shape; streaming with usage and keep-alives; a disconnect
aborts the request; 503 while starting and while draining."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.gateway import Drain
from ember import EngineConfig, FakeGPUConfig, SamplingParams, load_ports
from ember import registry as registry_mod
from engine.eventlog import EventLog
from engine.fake.gpu import FakeBackend, expected_tokens
from engine.fake.tokenizer import ByteTokenizer
from engine.types import SpecUsage, Usage
from transport.openai.bodies import UsageBody
from transport.server.http import build_app

pytestmark = pytest.mark.anyio

FAKE = EngineConfig(backend="fake", max_batch=4, max_queue=8, prefill_chunk=64)
TOK = ByteTokenizer()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@asynccontextmanager
async def serving(config: EngineConfig = FAKE, **kw: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = build_app(config, **kw)
    async with app.router.lifespan_context(app):
        await app.state.ember.settled.wait()
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ember") as client:
            yield app, client


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    return TOK.apply_chat_template(messages)


def expected_text(prompt: list[int], n: int, cfg: FakeGPUConfig = FakeGPUConfig()) -> str:
    return TOK.decode(expected_tokens(prompt, n, cfg))


def sse_blocks(body: str) -> list[str]:
    assert body.endswith("\n\n"), "every SSE event ends with a blank line"
    return body[:-2].split("\n\n")


def sse_data(body: str) -> list[Any]:
    blocks = [b for b in sse_blocks(body) if not b.startswith(":")]
    assert blocks[-1] == "data: [DONE]"
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[len("data: ") :]) for b in blocks[:-1]]


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------------
# Happy paths.


async def test_chat_completion_text_and_usage():
    async with serving() as (app, client):
        r = await client.post("/v1/chat/completions", json={"model": "fake-gpu-0", "messages": CHAT, "max_tokens": 7})
        assert r.status_code == 200
        body = r.json()
        prompt = chat_prompt(CHAT)
        assert body["object"] == "chat.completion" and body["model"] == "fake-gpu-0"
        [choice] = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": expected_text(prompt, 7)}
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 7,
            "total_tokens": len(prompt) + 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


async def test_completion_with_string_and_token_prompts_and_max_completion_tokens():
    async with serving() as (app, client):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.json()["choices"][0]["text"] == expected_text(list(b"abc"), 5)
        assert r.json()["object"] == "text_completion"
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.json()["choices"][0]["text"] == expected_text([1, 2, 3], 4)
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3


async def test_default_max_tokens_is_clamped_to_the_context_left():
    cfg = EngineConfig(backend="fake", fake=FakeGPUConfig(context_length=64))
    async with serving(cfg) as (app, client):
        r = await client.post("/v1/completions", json={"prompt": [7] * 60})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 4


async def test_cached_tokens_report_what_the_engine_served_from_cache():
    long_chat = [{"role": "user", "content": "a long shared prefix " * 20}]
    async with serving() as (app, client):
        reported = 0
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json={"messages": long_chat, "max_tokens": 3})
            details = r.json()["usage"]["prompt_tokens_details"]
            reported += details["cached_tokens"]
        stats = (await client.get("/stats")).json()
        assert reported == stats["scheduler"]["cached_tokens"]


async def test_stop_as_string_and_as_list():
    prompt = list(b"the prompt")
    full = expected_text(prompt, 30)
    stop = full[10:13]
    async with serving() as (app, client):
        for value in (stop, ["never-there", stop]):
            r = await client.post("/v1/completions", json={"prompt": "the prompt", "max_tokens": 30, "stop": value})
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert choice["text"] == full[: full.index(stop)]


async def test_seeded_sampling_over_http_is_reproducible():
    req = {"prompt": "xyz", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.01, "seed": 7}
    async with serving() as (app, client):
        a = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        b = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        c = (await client.post("/v1/completions", json={**req, "seed": 8})).json()["choices"][0]["text"]
    assert a == b and a != c


async def test_streaming_chat_with_usage_ends_in_done():
    async with serving() as (app, client):
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_data(r.text)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        prompt = chat_prompt(CHAT)
        assert text == expected_text(prompt, 6)
        finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert [c["choices"][0]["finish_reason"] for c in finish] == ["length"]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 6
        assert usage_chunk["usage"]["prompt_tokens"] == len(prompt)
        assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
        assert all(c["usage"] is None for c in chunks[:-1])


async def test_streaming_completion_without_usage():
    async with serving() as (app, client):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "stream": True})
        chunks = sse_data(r.text)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(list(b"abc"), 5)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["usage"] is None for c in chunks)


async def test_keepalive_comments_while_a_long_prefill_runs():
    # 2000 prompt tokens at 10 ms each of (virtual) prefill: ~20 s before the first token.
    cfg = EngineConfig(backend="fake", prefill_chunk=256, fake=FakeGPUConfig(prefill_b=0.01))
    async with serving(cfg, keepalive_s=2.0) as (app, client):
        r = await client.post("/v1/completions", json={"prompt": [5] * 2000, "max_tokens": 3, "stream": True})
        blocks = sse_blocks(r.text)
        first_data = next(i for i, b in enumerate(blocks) if b.startswith("data: "))
        keepalives = [i for i, b in enumerate(blocks) if b == ": keepalive"]
        assert len(keepalives) >= 8, blocks
        assert max(keepalives) < first_data  # all of them came before the first token
        assert "".join(c["choices"][0]["text"] for c in sse_data(r.text)) == expected_text([5] * 2000, 3)


async def test_speculation_usage_over_http_when_a_drafter_runs():
    async with serving(EngineConfig(backend="fake", draft_model="ngram")) as (app, client):
        r = await client.post("/v1/completions", json={"prompt": "abcabcabcabc", "max_tokens": 12})
        spec = r.json()["usage"]["speculation"]
        stats = (await client.get("/stats")).json()["speculation"]
        assert spec["drafted"] == stats["spec_decode_num_draft_tokens"]
        assert spec["accepted"] == stats["spec_decode_num_accepted_tokens"]
        assert r.json()["choices"][0]["text"] == expected_text(list(b"abcabcabcabc"), 12)  # speculation is exact
        r = await client.post("/v1/completions", json={"prompt": "abcabcabcabc", "max_tokens": 12, "speculate": False})
        assert "speculation" not in r.json()["usage"]
        metrics = (await client.get("/metrics")).text
        assert 'ember_speculation_spec_decode_num_drafts{model="fake-gpu-0"} ' in metrics


def test_speculation_usage_is_rendered_when_present():
    spec = SpecUsage(drafted=10, accepted=7, target_calls=4, acceptance_rate=0.7, mean_accept_len=2.75)
    body = UsageBody.of(Usage(prompt_tokens=5, completion_tokens=11, cached_tokens=2, speculation=spec))
    assert body.speculation == {
        "drafted": 10,
        "accepted": 7,
        "target_calls": 4,
        "acceptance_rate": 0.7,
        "mean_accept_len": 2.75,
    }
    assert UsageBody.of(Usage(prompt_tokens=1, completion_tokens=1)).speculation is None


# ---------------------------------------------------------------------------
# Models, health, stats, metrics.


async def test_models_and_model_detail():
    async with serving(EngineConfig(backend="fake", model_name="ember-test")) as (app, client):
        r = await client.get("/v1/models")
        assert r.json()["object"] == "list"
        assert [m["id"] for m in r.json()["data"]] == ["ember-test"]
        assert (await client.get("/v1/models/ember-test")).json()["id"] == "ember-test"
        assert_error(await client.get("/v1/models/other"), 404, code="model_not_found")
        r = await client.post("/v1/completions", json={"model": "ember-test", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "ember-test"


async def test_health_stats_and_metrics():
    async with serving() as (app, client):
        r = await client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ready", "loaded": ["fake-gpu-0"]}
        for _ in range(2):
            await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
        await client.post("/v1/completions", json={"prompt": "a", "max_tokens": -1})
        stats = (await client.get("/stats")).json()
        assert stats["scheduler"]["finished"] == 2 and stats["scheduler"]["generated_tokens"] == 8
        assert stats["gateway"]["rejected"]["invalid"] == 1
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text)
            for s in fam.samples
        }
        assert samples[("ember_http_requests_total", (("route", "chat"), ("status", "200")))] == 2
        assert samples[("ember_http_requests_total", (("route", "completions"), ("status", "400")))] == 1
        m = (("model", "fake-gpu-0"),)  # every engine series and latency names its model (the served name)
        assert samples[("ember_time_to_first_token_seconds_count", m)] == 2
        assert samples[("ember_inter_token_latency_seconds_count", m)] == 2 * 3
        assert samples[("ember_scheduler_generated_tokens_total", m)] == 8
        assert samples[("ember_scheduler_queued", m)] == 0
        assert samples[("ember_requests_rejected_total", (*m, ("reason", "invalid")))] == 1
        # TTFT in virtual time: one prefill step plus one decode step of the cost model
        ttft_sum = samples[("ember_time_to_first_token_seconds_sum", m)]
        assert 0 < ttft_sum < 1


async def test_each_app_has_its_own_metrics_registry():
    async with serving() as (app1, c1), serving() as (app2, c2):
        await c1.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        m2 = (await c2.get("/metrics")).text
        assert 'ember_http_requests_total{route="completions"' not in m2
        assert 'ember_http_requests_total{route="completions",status="200"} 1.0' in (await c1.get("/metrics")).text


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real loop: the model "loads" on a thread
async def test_health_503_while_the_model_loads(monkeypatch):
    release = threading.Event()

    def slow_load_ports(config, ports, *, keep_events=None):
        release.wait(10)
        ports.backend = FakeBackend(config.fake)  # the "model", loaded
        return load_ports(config, ports, keep_events=keep_events)

    monkeypatch.setattr(registry_mod, "load_ports", slow_load_ports)  # the registry loads every model
    app = build_app(EngineConfig(backend="mlx", model="slow"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ember") as client:
            r = await client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "starting", "loaded": []}
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert_error(r, 503, code="engine_starting")
            assert r.headers["retry-after"] == "1"
            release.set()
            await app.state.ember.settled.wait()
            assert (await client.get("/health")).status_code == 200
            r = await client.post("/v1/completions", json={"model": "slow", "prompt": "a", "max_tokens": 1})
            assert r.status_code == 200


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real loop: the model "loads" on a thread
async def test_a_failed_start_answers_503_and_no_request_loads_the_model_again(monkeypatch):
    loads = []

    def broken_load_ports(config, ports, *, keep_events=None):
        loads.append(config.model)
        raise FileNotFoundError("no safetensors in /nonexistent/broken")

    monkeypatch.setattr(registry_mod, "load_ports", broken_load_ports)
    async with serving(EngineConfig(backend="mlx", model="broken")) as (app, client):
        assert app.state.ember.phase == "failed"
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert_error(
            await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}), 503, code="engine_dead"
        )
        assert_error(await client.get("/stats"), 503, code="engine_dead")
        assert loads == ["broken"]  # the failed start is final: a request does not retry the load


# ---------------------------------------------------------------------------
# Errors.

BAD_BODIES = [
    # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"max_tokens": 3}, 400, None),  # no prompt
    ("/v1/completions", {"prompt": "a", "nonsense": 1}, 400, "nonsense"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    # max_tokens above the context left is clamped, not refused: tests/transport/test_output_limits.py
    ("/v1/completions", {"prompt": [1] * 40_000, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt[0]"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "num_draft_tokens": 10**6}, 400, "num_draft_tokens"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        "/v1/completions",
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}},
        400,
        "stream_options.include_usage",
    ),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        None,
    ),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4},
        400,
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
]


async def test_bad_requests_get_400_in_openai_shape_and_harm_no_one():
    async with serving() as (app, client):
        # a long request runs throughout; every bad one is refused around it
        async with anyio.create_task_group() as tg:
            results = {}

            async def long_one():
                r = await client.post("/v1/completions", json={"prompt": "keep going", "max_tokens": 200})
                results["long"] = r

            tg.start_soon(long_one)
            for path, body, status, param in BAD_BODIES:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await client.post(path, content=content, headers={"content-type": "application/json"})
                assert_error(r, status, param)
        assert results["long"].json()["choices"][0]["text"] == expected_text(list(b"keep going"), 200)
        assert (await client.get("/health")).status_code == 200


async def test_ignored_and_neutral_fields_are_accepted():
    body = {
        "messages": CHAT,
        "max_tokens": 2,
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "parallel_tool_calls": True,
    }
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    async with serving() as (app, client):
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 2})
        prompt = chat_prompt([{"role": "user", "content": "hi"}])
        assert r.json()["choices"][0]["message"]["content"] == expected_text(prompt, 2)


async def test_unknown_model_route_method_and_oversized_body():
    async with serving(max_body_bytes=1000) as (app, client):
        assert_error(
            await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"}),
            404,
            "model",
            "model_not_found",
        )
        assert_error(await client.get("/v1/nothing"), 404)
        assert_error(await client.get("/v1/completions"), 405)
        assert_error(await client.post("/v1/completions", json={"prompt": "a" * 2000}), 413, code="request_too_large")


async def test_queue_full_is_429_with_retry_after():
    async with serving(EngineConfig(backend="fake", max_batch=1, max_queue=0)) as (app, client):
        engine = app.state.ember.engine
        held = await engine.asubmit([1, 2], SamplingParams(max_tokens=50))
        async with held:
            r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            err = assert_error(r, 429, code="engine_overloaded")
            assert err["type"] == "rate_limit_error"
            assert r.headers["retry-after"] == "1"
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
            assert_error(r, 429)
        # the slot is free again once the held request is gone
        assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200


async def test_health_and_requests_503_while_draining():
    async with serving() as (app, client):
        engine = app.state.ember.engine
        held = await engine.asubmit([1, 2, 3], SamplingParams(max_tokens=20))
        drained = anyio.Event()

        async def drain():
            await engine.gateway.ref.ask(Drain())
            drained.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await anyio.wait_all_tasks_blocked()
            r = await client.get("/health")
            assert r.status_code == 503 and r.json() == {"status": "draining", "loaded": ["fake-gpu-0"]}
            assert_error(await client.post("/v1/completions", json={"prompt": "a"}), 503, code="engine_draining")
            assert not drained.is_set()
            # the running request still finishes, and then the drain completes
            async with held:
                tokens = [t async for d in held for t in d.token_ids]
            assert tokens == expected_tokens([1, 2, 3], 20)
        assert drained.is_set()


class CrashingBackend(FakeBackend):
    def step(self, plan):
        if self.steps == 3:
            raise RuntimeError("GPU driver bug")
        return super().step(plan)


async def test_a_dead_engine_answers_503_and_health_says_dead():
    async with serving(backend=CrashingBackend()) as (app, client):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 50})
        assert_error(r, 503, code="engine_dead")
        r = await client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "dead", "loaded": ["fake-gpu-0"]}
        assert_error(await client.post("/v1/completions", json={"prompt": "abc"}), 503, code="engine_dead")


async def test_a_request_failing_inside_the_engine_is_500_or_an_error_event():
    cfg = EngineConfig(backend="fake", fake=FakeGPUConfig(oom_step_prob=1.0))
    async with serving(cfg) as (app, client):
        err = assert_error(await client.post("/v1/completions", json={"prompt": "abc"}), 500, code="request_failed")
        assert "out of memory" in err["message"]
        r = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
        assert r.status_code == 200
        blocks = sse_blocks(r.text)
        assert blocks[-1] == "data: [DONE]"
        error = json.loads(blocks[-2][len("data: ") :])["error"]
        assert error["code"] == "request_failed"
        assert (await client.get("/health")).status_code == 200  # the engine itself is fine


# ---------------------------------------------------------------------------
# A client that goes away.


class AsgiClient:
    """Drives the app over raw ASGI, to disconnect at a moment of our choosing
    (httpx's ASGITransport buffers a whole response before returning)."""

    def __init__(self, app: Any, path: str, body: dict[str, Any]):
        self.app = app
        self.path = path
        self.body = json.dumps(body).encode()
        self.sent: list[dict[str, Any]] = []
        self.gone = anyio.Event()
        self._body_read = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def data_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m["body"].startswith(b"data: {")]

    async def run(self) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"host", b"ember")],
            "client": ("127.0.0.1", 5000),
            "server": ("ember", 80),
        }
        await self.app(scope, self.receive, self.send)


def steps_after(log: EventLog, kind: str) -> list[dict[str, Any]]:
    t = log.of(kind)[0][0]
    return [f for tt, f in log.of("step") if tt >= t]


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request_within_one_step(stream):
    log = EventLog()
    async with serving(events=log) as (app, _):
        engine = app.state.ember.engine
        c = AsgiClient(app, "/v1/completions", {"prompt": "abc", "max_tokens": 10_000, "stream": stream})
        idle_after_abort = anyio.Event()
        at_gone: dict[str, int] = {}

        def on_record(kind: str, t: float, fields: dict[str, Any]) -> None:
            # leave once a few tokens were made (streaming: after the client saw some)
            made = engine.stats()["scheduler"]["generated_tokens"]
            if kind == "step_end" and made >= 5 and not c.gone.is_set() and (not stream or len(c.data_chunks()) >= 3):
                at_gone.update(record=len(log.records), tokens=made)
                c.gone.set()
            if kind == "idle" and log.of("abort"):
                idle_after_abort.set()

        log.listeners.append(on_record)
        await c.run()  # returns once the disconnect is noticed
        await idle_after_abort.wait()
        sched = engine.stats()["scheduler"]
        assert sched["aborted"] == 1 and sched["active_rows"] == 0 and sched["finished"] == 0
        # at most the one step already planned decodes it after the client left ...
        later = [f for k, _, f in log.records[at_gone["record"] :] if k == "step"]
        assert sum(1 in f["decode"] for f in later) <= 1
        assert sched["generated_tokens"] <= at_gone["tokens"] + 1
        # ... and the step right after the abort closes the row; it is never decoded again
        after = steps_after(log, "abort")
        assert after[0]["close"] == [1]
        assert all(1 not in f["decode"] for f in after)
        if stream:
            assert not any(m.get("more_body") is False for m in c.sent[1:])  # no end of body for a gone client
        assert engine.stats()["gateway"]["in_flight"] == 0
