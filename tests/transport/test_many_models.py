"""Many models behind one server (ember/registry.py routed by transport/server/http.py), on the fake GPU:
two models with interleaved streams, aliases, unknown names, a request during a load, a failing
load, admin unload and reload, /v1/models, /stats."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from ember import EngineConfig, FakeGPUConfig
from engine.fake.gpu import expected_tokens
from engine.fake.tokenizer import ByteTokenizer
from tests.transport.test_http import serving

pytestmark = pytest.mark.anyio

TOK = ByteTokenizer()
A = EngineConfig(backend="fake")  # served as fake-gpu-0
B = msgspec.structs.replace(A, fake=FakeGPUConfig(seed=7))


def _stream_text(body: str) -> str:
    out = []
    for block in body.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            d = json.loads(block[6:])
            out.append(d["choices"][0].get("text", ""))
    return "".join(out)


async def _complete(client: httpx.AsyncClient, model: str | None, prompt: str, n: int, stream: bool) -> tuple[int, str]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
    if model is not None:
        body["model"] = model
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return r.status_code, r.text
    return 200, _stream_text(r.text) if stream else r.json()["choices"][0]["text"]


async def test_two_models_interleaved_streams_match_each_alone():
    prompts = ["hello there", "abc", "the quick brown fox", "zz"]
    alone: dict[str, list[str]] = {}
    for name, cfg in (("fake-gpu-0", A), ("b", B)):
        async with serving(cfg) as (_, client):
            alone[name] = [(await _complete(client, None, p, 12, False))[1] for p in prompts]
    # the oracle: the fake GPU's own greedy tokens for each seed
    assert alone["b"][0] == TOK.decode(expected_tokens(TOK.encode(prompts[0]), 12, B.fake))
    assert alone["fake-gpu-0"] != alone["b"]

    got: dict[tuple[str, int], str] = {}
    async with serving(A, more_models={"b": B}) as (_, client):

        async def one(name: str, i: int) -> None:
            status, text = await _complete(client, name, prompts[i], 12, True)
            assert status == 200, text
            got[(name, i)] = text

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                for name in ("fake-gpu-0", "b"):
                    tg.start_soon(one, name, i)
    for name in ("fake-gpu-0", "b"):
        assert [got[(name, i)] for i in range(len(prompts))] == alone[name], name


async def test_alias_routes_and_unknown_is_404_listing_names_in_each_shape():
    async with serving(A, more_models={"b": B}, registry_kw={"aliases": {"claude-haiku-*": "b"}}) as (app, client):
        direct = await _complete(client, "b", "hi", 8, False)
        via_alias = await _complete(client, "claude-haiku-4-5-20251001", "hi", 8, False)
        assert direct == via_alias and direct[0] == 200
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "'nope'" in err["message"] and "fake-gpu-0" in err["message"] and "b" in err["message"]
        r = await client.post(
            "/v1/messages", json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 404 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "not_found_error" and "fake-gpu-0" in r.json()["error"]["message"]
        r = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        assert r.status_code == 404 and "fake-gpu-0" in r.json()["error"]["message"]
        # the Messages route routes by alias too
        r = await client.post(
            "/v1/messages",
            json={"model": "claude-haiku-4-5", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 200 and r.json()["model"] == "b"


async def test_models_lists_states_and_admin_unload_then_a_request_reloads():
    async with serving(A, more_models={"b": B}) as (app, client):
        reg = app.state.ember.registry
        cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
        assert cards["fake-gpu-0"]["state"] == "loaded" and cards["b"]["state"] == "available"
        assert cards["fake-gpu-0"]["context_length"] == A.fake.context_length
        before = await _complete(client, "b", "abc", 8, False)
        card = (await client.get("/v1/models/b")).json()
        assert card["state"] == "loaded" and card["memory_bytes"] is not None
        stats = (await client.get("/stats")).json()
        assert set(stats["models"]) == {"fake-gpu-0", "b"} and "gateway" in stats["models"]["b"]
        assert "gateway" in stats  # the default model's keys stay top-level
        r = await client.post("/admin/models/b/unload", json={})
        assert r.status_code == 200 and r.json()["unloaded"] is True and r.json()["state"] == "available"
        assert (await client.get("/v1/models/b")).json()["state"] == "available"
        assert set((await client.get("/stats")).json()["models"]) == {"fake-gpu-0"}
        assert await _complete(client, "b", "abc", 8, False) == before  # loads it again
        assert reg.entries["b"].loads == 2
        r = await client.post("/admin/models/nope/load", json={})
        assert r.status_code == 404
        r = await client.post("/admin/models/b/load", json={})
        assert r.status_code == 200 and r.json()["state"] == "loaded"


async def test_a_request_during_a_load_waits_and_succeeds_while_health_stays_200():
    gate = anyio.Event()
    async with serving(A, more_models={"b": B}) as (app, client):
        reg = app.state.ember.registry
        real_open = reg._open

        @contextlib.asynccontextmanager
        async def slow_open(entry):
            if entry.name == "b":
                await gate.wait()
            async with real_open(entry) as engine:
                yield engine

        reg._open = slow_open
        results: list[Any] = []

        async def req() -> None:
            results.append(await _complete(client, "b", "abc", 8, True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(req)
            tg.start_soon(req)
            await anyio.wait_all_tasks_blocked()
            assert reg.entries["b"].state == "loading" and reg.entries["b"].waiters == 2
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/v1/models/b")).json()["state"] == "loading"
            assert (await _complete(client, None, "abc", 4, False))[0] == 200  # the default keeps serving
            gate.set()
        assert [r[0] for r in results] == [200, 200] and results[0] == results[1]
        assert reg.entries["b"].loads == 1


async def test_a_failing_load_is_a_5xx_naming_the_cause_and_the_default_keeps_serving():
    def missing_weights():  # what a model directory without its weights raises while loading
        raise FileNotFoundError("no safetensors in /nonexistent/models/broken-model")

    async with serving(A) as (app, client):
        app.state.ember.registry.add_chat("broken", A, ports=missing_weights)
        r = await client.post(
            "/v1/chat/completions", json={"model": "broken", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "broken" in err["message"]
        assert "/nonexistent/models/broken-model" in err["message"], err["message"]
        assert (await _complete(client, None, "abc", 4, False))[0] == 200
        assert (await client.get("/health")).status_code == 200
        card = (await client.get("/v1/models/broken")).json()
        assert card["state"] == "available" and "/nonexistent" in card["error"]


async def test_chat_to_an_embedding_model_and_embeddings_to_a_chat_model_are_400():
    async with serving(A) as (app, client):
        app.state.ember.registry.add_embedding("emb", "/nonexistent/st-dir")
        r = await client.post(
            "/v1/chat/completions", json={"model": "emb", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "/v1/embeddings" in r.json()["error"]["message"]
        r = await client.post("/v1/embeddings", json={"model": "fake-gpu-0", "input": "x"})
        assert r.status_code == 400 and "not an embedding model" in r.json()["error"]["message"]
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": "x", "encoding_format": "hex"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
        r = await client.post("/v1/embeddings", json={"model": "emb", "input": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"


async def test_per_request_keep_alive_as_ollama_sends_it():
    async with serving(A, more_models={"b": B}) as (app, client):
        entry = app.state.ember.registry.entries["b"]
        msgs = [{"role": "user", "content": "x"}]
        r = await client.post(
            "/v1/chat/completions", json={"model": "b", "messages": msgs, "max_tokens": 2, "keep_alive": "5m"}
        )
        assert r.status_code == 200 and entry.keep_alive_s == 300.0
        r = await client.post("/v1/messages", json={"model": "b", "messages": msgs, "max_tokens": 2, "keep_alive": -1})
        assert r.status_code == 200 and entry.keep_alive_s is None  # never unload
        r = await client.post(
            "/v1/responses", json={"model": "b", "input": "x", "max_output_tokens": 2, "keep_alive": 30}
        )
        assert r.status_code == 200 and entry.keep_alive_s == 30.0
        r = await client.post("/v1/chat/completions", json={"model": "b", "messages": msgs, "keep_alive": "soon"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


async def test_the_dashboards_recent_requests_name_their_model():
    """/stats' recent_requests carry the served name, so each model's dashboard
    section shows its own requests (transport/ui/app.js filters on it)."""
    async with serving(A, more_models={"b": B}, registry_kw={"aliases": {"claude-haiku-*": "b"}}) as (_, client):
        assert (await _complete(client, "b", "hi", 4, False))[0] == 200
        assert (await _complete(client, None, "hi", 4, True))[0] == 200
        assert (await _complete(client, "claude-haiku-4-5", "hi", 4, False))[0] == 200
        recent = (await client.get("/stats")).json()["recent_requests"]["requests"]
    assert [r["model"] for r in recent] == ["b", "fake-gpu-0", "b"]


async def test_metrics_carry_a_model_label_per_loaded_model():
    from prometheus_client.parser import text_string_to_metric_families

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    async with serving(A, more_models={"b": B}) as (_, client):
        assert (await _complete(client, None, "hello", 5, False))[0] == 200
        got = samples((await client.get("/metrics")).text)
        assert got[("ember_scheduler_generated_tokens_total", (("model", "fake-gpu-0"),))] == 5
        assert not any(dict(labels).get("model") == "b" for _, labels in got)  # not loaded: no series
        for n in (3, 4):
            assert (await _complete(client, "b", "hi", n, True))[0] == 200
        got = samples((await client.get("/metrics")).text)
        a, b = (("model", "fake-gpu-0"),), (("model", "b"),)
        assert got[("ember_scheduler_generated_tokens_total", a)] == 5  # each model its own counters
        assert got[("ember_scheduler_generated_tokens_total", b)] == 3 + 4
        assert got[("ember_scheduler_admitted_total", b)] == 2 and got[("ember_scheduler_admitted_total", a)] == 1
        assert got[("ember_time_to_first_token_seconds_count", a)] == 1
        assert got[("ember_time_to_first_token_seconds_count", b)] == 2
        assert got[("ember_ready", a)] == got[("ember_ready", b)] == 1
        assert got[("ember_prompt_cache_puts", b)] >= 1  # the sections' gauges too
        await client.post("/admin/models/b/unload", json={})
        got = samples((await client.get("/metrics")).text)
        assert ("ember_ready", b) not in got and got[("ember_ready", a)] == 1
        assert got[("ember_time_to_first_token_seconds_count", b)] == 2  # the HTTP histograms outlive the engine


async def test_the_default_model_unloaded_by_admin_loads_again_and_the_server_stays_up():
    """``--model`` is not pinned, so an admin unload (or the budget, below) may take it. The
    server is still ready: /health 200 naming what is loaded, /stats and the probes answer
    without the default's engine stats, and the next request for it loads it again."""
    async with serving(A, more_models={"b": B}) as (app, client):
        reg = app.state.ember.registry
        before = await _complete(client, None, "abc", 8, False)
        assert before[0] == 200 and (await _complete(client, "b", "hi", 4, False))[0] == 200
        r = await client.post("/admin/models/fake-gpu-0/unload", json={})
        assert r.status_code == 200 and r.json()["unloaded"] is True
        assert reg.entries["fake-gpu-0"].state == "available"

        r = await client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ready", "loaded": ["b"]}
        r = await client.get("/stats")
        assert r.status_code == 200, r.text
        stats = r.json()
        assert stats["default_model"] == {"name": "fake-gpu-0", "state": "available"}
        assert "scheduler" not in stats and "cache_misses" not in stats  # no engine: no engine stats
        assert set(stats["models"]) == {"b"} and "scheduler" in stats["models"]["b"]
        assert (await client.get("/metrics")).status_code == 200
        r = await client.post("/admin/cache/flush", json={})  # its unload flushed it (no SSD tier: empty)
        assert r.status_code == 200 and r.json()["durable"] is True
        assert (await client.get("/server_info")).status_code == 200
        assert (await client.get("/get_load")).json()[0]["num_reqs"] == 0
        assert (await client.get("/health_generate")).status_code == 200
        assert reg.entries["fake-gpu-0"].state == "available"  # none of these loaded it

        r = await client.post(  # a request that needs the model loads it: count_tokens too
            "/v1/messages/count_tokens", json={"model": "fake-gpu-0", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        assert reg.entries["fake-gpu-0"].loads == 2
        await client.post("/admin/models/fake-gpu-0/unload", json={})
        assert await _complete(client, None, "abc", 8, False) == before  # no model named: the default, loaded again
        assert reg.entries["fake-gpu-0"].loads == 3
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["loaded"] == ["fake-gpu-0", "b"]
        assert "scheduler" in (await client.get("/stats")).json()  # top-level again
        await client.post("/admin/models/fake-gpu-0/unload", json={})
        r = await client.post("/admin/models/fake-gpu-0/load", json={})
        assert r.status_code == 200 and r.json()["state"] == "loaded"


async def test_the_budget_evicts_the_default_model_and_a_chat_to_it_loads_it_again():
    async with serving(A, more_models={"b": B}, registry_kw={"max_memory": 150}) as (app, client):
        reg = app.state.ember.registry
        for e in reg.entries.values():
            e.size_bytes = 100  # two of them do not fit 150
        msgs = [{"role": "user", "content": "hi"}]
        first = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6})
        assert first.status_code == 200
        assert (await _complete(client, "b", "hi", 4, False))[0] == 200  # evicts the default
        assert reg.evictions["memory"] == 1 and reg.entries["fake-gpu-0"].state == "available"
        assert (await client.get("/health")).json() == {"status": "ready", "loaded": ["b"]}
        assert (await client.get("/stats")).status_code == 200
        again = await client.post(
            "/v1/chat/completions", json={"model": "fake-gpu-0", "messages": msgs, "max_tokens": 6}
        )
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert reg.evictions["memory"] == 2 and [e.name for e in reg.loaded()] == ["fake-gpu-0"]


async def test_a_drain_with_the_default_model_unloaded_still_answers_503_and_loads_nothing():
    async with serving(A, more_models={"b": B}) as (app, client):
        host = app.state.ember
        await client.post("/admin/models/fake-gpu-0/unload", json={})
        assert (await _complete(client, "b", "hi", 4, False))[0] == 200
        assert await host.drain_all()  # what SIGTERM runs (transport/cli.py) before uvicorn stops
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_draining"
        assert (await client.get("/stats")).status_code == 503
        assert host.registry.entries["fake-gpu-0"].state == "available"  # not loaded again while draining
