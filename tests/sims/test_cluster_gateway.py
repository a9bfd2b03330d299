"""Two fake-GPU replicas behind the real SGLang Model Gateway (sglang-router,
the ``cluster`` extra; .ci/run installs it and runs ``pytest -m cluster``):
chat, streaming and errors pass through it, and cache-aware routing sends a
session's second turn to the replica that holds its first (cached_tokens > 0)."""

from __future__ import annotations

import json

import httpx
import pytest

from sims.live.replicas import Cluster, router_available

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not router_available(), reason='needs sglang-router: pip install -e ".[cluster]"'),
]

SYSTEM = "You are a careful coding agent working in a large repository. " * 40  # ~2.5 KB: a long shared prefix


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, "cache_aware", ["--fake-gpu", "--batch", "4"]) as c:
        yield c


@pytest.fixture
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=30.0) as c:
        yield c


def _chat(messages, **kw):
    return {"messages": messages, "max_tokens": 8, **kw}


def test_gateway_registers_every_replica_under_its_name(cluster, client):
    workers = client.get("/workers").json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(cluster.replica_urls)
    assert {w["model_id"] for w in workers} == {"fake-gpu-0"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake-gpu-0"]


def test_chat_through_the_gateway_equals_a_replica_answering_directly(cluster, client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    via = client.post("/v1/chat/completions", json=_chat(msgs))
    assert via.status_code == 200, via.text
    direct = httpx.post(cluster.replica_urls[1] + "/v1/chat/completions", json=_chat(msgs), timeout=30.0)
    assert direct.status_code == 200, direct.text
    assert via.json()["choices"][0]["message"]["content"] == direct.json()["choices"][0]["message"]["content"]
    assert via.json()["usage"]["completion_tokens"] == 8


def test_streaming_passes_through(client):
    msgs = [{"role": "user", "content": "stream me"}]
    whole = client.post("/v1/chat/completions", json=_chat(msgs)).json()
    with client.stream(
        "POST", "/v1/chat/completions", json=_chat(msgs, stream=True, stream_options={"include_usage": True})
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_errors_pass_through(client):
    r = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "x"}], model="nope"))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    # the gateway validates some fields itself, in its own error shape (no param)
    r = client.post("/v1/chat/completions", json=_chat([]))
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    # one it lets through and Ember refuses: Ember's 400, param and all
    r = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "x"}], presence_penalty=0.5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty", r.text
    # an SGLang field at a value Ember cannot honour: the replica's 400 names it
    r = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "x"}], no_stop_trim=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_stop_trim"


def test_second_turn_of_a_session_is_served_from_cache(client):
    turn1 = [{"role": "system", "content": SYSTEM + "session 7"}, {"role": "user", "content": "list the files"}]
    first = client.post("/v1/chat/completions", json=_chat(turn1)).json()
    reply = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "now open the first one"}]
    second = client.post("/v1/chat/completions", json=_chat(turn2)).json()
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // 2, (
        first["usage"],
        usage,
    )


def test_a_second_cluster_starts_beside_the_first(cluster):
    # each gateway gets a free Prometheus port: sglang-router's default (29000)
    # let only one gateway per machine start (a second xdist worker's exited 1)
    with Cluster(1, "round_robin", ["--fake-gpu"]) as second:
        assert httpx.get(second.url + "/workers", timeout=5).status_code == 200
    assert httpx.get(cluster.url + "/workers", timeout=5).status_code == 200
