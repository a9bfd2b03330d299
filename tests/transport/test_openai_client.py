"""The official ``openai`` client against a live ``ember serve --fake-gpu``
subprocess on 127.0.0.1, then SIGTERM: the server drains and exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from engine.fake.gpu import expected_tokens
from engine.fake.tokenizer import ByteTokenizer
from engine.mlx.gguf_models import installed
from tests.live_server import ember_serve, read_url

TOK = ByteTokenizer()
START_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    with ember_serve("--fake-gpu") as served:
        yield served


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    _, url = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list()] == ["fake-gpu-0"]


def test_chat(client):
    messages = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="fake-gpu-0", messages=messages, max_tokens=8)
    prompt = TOK.apply_chat_template(messages)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TOK.decode(expected_tokens(prompt, 8))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 8)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion(client):
    r = client.completions.create(model="fake-gpu-0", prompt="abc", max_tokens=6, stop=["\x00never"])
    assert r.choices[0].text == TOK.decode(expected_tokens(list(b"abc"), 6))
    assert r.usage.total_tokens == 3 + 6


def test_streaming_chat_with_usage(client):
    messages = [{"role": "user", "content": "stream me"}]
    stream = client.chat.completions.create(
        model="fake-gpu-0", messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = TOK.apply_chat_template(messages)
    assert text == TOK.decode(expected_tokens(prompt, 10))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []


def test_streaming_completion(client):
    chunks = list(client.completions.create(model="fake-gpu-0", prompt="xy", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == TOK.decode(expected_tokens(list(b"xy"), 5))


def test_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="a", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-gpu-0", messages=[{"role": "user", "content": "a"}], n=99)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-gpu-0", prompt="a", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"


def test_n_choices(client):
    """n rows admitted together; greedy on the fake GPU, so every choice is the same text."""
    want = TOK.decode(expected_tokens(list(b"xy"), 5))
    r = client.completions.create(model="fake-gpu-0", prompt="xy", max_tokens=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [want] * 3
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 15
    texts: dict[int, str] = {}
    ends = []
    for chunk in client.chat.completions.create(
        model="fake-gpu-0", messages=[{"role": "user", "content": "a"}], max_tokens=4, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                ends.append(c.index)
    assert sorted(ends) == [0, 1] and texts[0] == texts[1] != ""


def test_sigterm_drains_and_exits_zero(server, client):
    proc, url = server
    assert httpx.get(f"{url}/health").status_code == 200
    # a request in flight when SIGTERM arrives still completes
    stream = client.completions.create(
        model="fake-gpu-0", prompt="last", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    first = next(chunks)
    proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text == TOK.decode(expected_tokens(list(b"last"), 40, stop_at_eos=False))
    assert proc.wait(timeout=30) == 0


@pytest.mark.slow
@pytest.mark.skipif(
    installed("smollm2-135m"), reason="the models extra is installed: `ember serve` defaults to smollm2-135m"
)
def test_ember_serve_without_model_serves_the_bundled_tiny_on_mlx():
    proc = subprocess.Popen(
        [sys.executable, "-m", "transport.cli", "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = read_url(proc, START_TIMEOUT_S)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
            ids = [m.id for m in c.models.list()]
            assert ids[0] == "tiny" and "tiny-draft" in ids, (
                ids
            )  # the served model first, then what else it can load (#30)
            r = c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8
            )
            assert r.usage.completion_tokens + (r.choices[0].finish_reason == "stop") >= 1
            chunks = list(
                c.completions.create(
                    model="tiny", prompt="import os\n", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
                )
            )
            assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) >= 1
        stats = httpx.get(f"{url}/stats").json()
        assert stats["scheduler"]["generated_tokens"] >= 9 and stats["dead"] is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    except BaseException as exc:
        # A rare failure here (1 in ~40 runs, not reproduced) left no trace:
        # put the server's own output into the report.
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        tail = proc.stderr.read()[-4000:] if proc.stderr is not None else ""
        raise AssertionError(f"{exc!r}; server rc={proc.returncode}; server stderr tail:\n{tail}") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
