"""Property: whatever the body, the server answers without a 5xx and keeps
serving. Bodies mix well-formed fields, wrong types, out-of-range numbers,
unknown fields and raw garbage, against one long-lived app on the fake GPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ember import EngineConfig, FakeGPUConfig
from transport.server.http import build_app

# Free steps (no modelled GPU time) and a small context keep every example cheap.
FREE = FakeGPUConfig(context_length=512, prefill_a=0, prefill_b=0, decode_c=0, decode_d=0, verify_b=0)
CONFIG = EngineConfig(backend="fake", fake=FREE, max_batch=4, max_queue=4)
OK_STATUSES = {200, 400, 404, 413, 429}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)


def mostly(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid three times in four, else an edge or out-of-range value of the right type."""
    return st.integers(min_value=0, max_value=3).flatmap(lambda i: edge if i == 3 else valid)


message = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=6)),
        "content": st.text(max_size=40),
    },
    optional={"name": st.text(max_size=5)},
)
# Plausible values per field: mostly valid, with edge and out-of-range ones.
COMMON = {
    "model": st.sampled_from(["fake-gpu-0", "fake-gpu-0", "other"]),
    "max_tokens": mostly(st.integers(min_value=1, max_value=40), st.integers(min_value=-(2**66), max_value=2**66)),
    "temperature": mostly(st.floats(min_value=0, max_value=2), st.floats()),
    "top_p": mostly(st.floats(min_value=0.01, max_value=1), st.floats()),
    "top_k": mostly(st.integers(min_value=0, max_value=300), st.integers()),
    "min_p": mostly(st.floats(min_value=0, max_value=1), st.floats()),
    "seed": mostly(st.integers(min_value=0, max_value=2**64 - 1), st.integers()),
    "stop": mostly(
        st.text(max_size=3) | st.lists(st.text(max_size=4), max_size=4), st.lists(st.text(max_size=300), max_size=20)
    ),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": mostly(st.just(1), st.integers()),
    "ignore_eos": st.booleans(),
    "num_draft_tokens": mostly(st.integers(min_value=0, max_value=8), st.integers()),
    "speculate": st.booleans(),
    "user": st.text(max_size=5),
    "presence_penalty": mostly(st.just(0), st.floats()),
}
CHAT = {
    **COMMON,
    "messages": mostly(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=1)),
    "max_completion_tokens": mostly(st.integers(min_value=1, max_value=40), st.integers()),
    "logprobs": mostly(st.just(False), st.booleans()),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), max_size=1),
}
COMPLETION = {
    **COMMON,
    "prompt": mostly(
        st.text(min_size=1, max_size=60) | st.lists(st.integers(min_value=0, max_value=259), min_size=1, max_size=60),
        st.text(max_size=600) | st.lists(st.integers(min_value=-3, max_value=300), max_size=600),
    ),
    "echo": mostly(st.just(False), st.booleans()),
    "suffix": mostly(st.none(), st.text(max_size=3)),
}
REQUIRED = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    path, fields = draw(st.sampled_from([("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]))
    kind = draw(st.sampled_from(["plausible"] * 5 + ["wrong-type", "unknown-field", "garbage", "any-json"]))
    if kind == "garbage":
        return path, draw(st.binary(max_size=80))
    if kind == "any-json":
        return path, json.dumps(draw(json_values)).encode()
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True))
    body = {name: draw(fields[name]) for name in {REQUIRED[path], *names}}
    if "stream_options" in body and kind == "plausible":
        body["stream"] = True  # it is only allowed with stream (the other case is a 400 that other kinds reach)
    if kind == "wrong-type":
        body[draw(st.sampled_from(sorted(body)))] = draw(json_values)
    if kind == "unknown-field":
        body[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    return path, json.dumps(body).encode()  # may hold Infinity: invalid JSON, a 400 too


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = build_app(CONFIG)
    with TestClient(app) as c:
        c.portal.call(app.state.ember.settled.wait)
        yield c


@pytest.mark.slow  # 150 examples
@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(req=requests())
def test_no_body_gets_a_5xx(client, req):
    path, body = req
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code in OK_STATUSES, (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_server_still_serves_after_the_fuzzing(client):
    assert client.get("/health").json()["status"] == "ready"
    r = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    stats = client.get("/stats").json()
    assert stats["dead"] is None and stats["gateway"]["in_flight"] == 0
    assert stats["scheduler"]["active_rows"] == 0
