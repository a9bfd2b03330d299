"""bench/serve/bare_server.py, the bare-loop reference bench.serve.vs_mlx_lm measures over HTTP:
it must stream what mlx_lm.stream_generate yields, token for token, in the
shape the bench's client reads."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient  # noqa: E402

from engine.models import resolve_model  # noqa: E402

pytestmark = pytest.mark.slow


def test_streams_the_bare_loops_tokens():
    import mlx_lm

    from bench.serve.bare_server import build_app

    path = str(resolve_model("tiny"))
    model, tok = mlx_lm.load(path)
    want = [r.text for r in mlx_lm.stream_generate(model, tok, "def parse(", max_tokens=12)]
    with TestClient(build_app(path)) as client:
        r = client.post("/v1/completions", json={"prompt": "def parse(", "max_tokens": 12, "stream": True})
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 400
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == want
    assert chunks[-1]["usage"]["completion_tokens"] == 12
