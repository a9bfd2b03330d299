"""The official ``openai`` client against ``ember serve --model tiny``:
``response_format`` (validated with ``jsonschema``), logprobs in OpenAI's
shapes (checked against an mlx-lm forward), penalties and ``logit_bias``
(against mlx-lm's logits processors), ``n`` choices, and 400s naming the
parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import mlx.core as mx
import numpy as np
import openai
import pytest

from engine.models import resolve_model  # noqa: E402
from tests.live_server import ember_serve  # noqa: E402

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    resolve_model("tiny")
    with ember_serve("--model", "tiny", "--draft-model", "ngram") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oracle():
    """mlx-lm's own model and tokenizer for the bundled checkpoint."""
    from mlx_lm import load

    return load(str(resolve_model("tiny")))


def _fmt(schema=SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_response_format_json_schema_validates(client):
    for temperature, seed in [(0.0, None), (1.0, 1), (1.2, 2)]:
        r = client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=_fmt(), max_tokens=80, temperature=temperature, seed=seed
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_response_format_parse_with_the_sdk(client):
    import pydantic

    class City(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str
        capital: bool

    r = client.beta.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=City, max_tokens=120)
    assert isinstance(r.choices[0].message.parsed, City)


def test_response_format_streams_and_n_choices(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=_fmt(),
        max_tokens=80,
        temperature=1.0,
        seed=5,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    values = [json.loads(texts[i]) for i in range(3)]
    for v in values:
        jsonschema.validate(v, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 1  # three seed streams, not one
    assert usage is not None and usage.completion_tokens > 0


def test_json_object(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "config = "}],
        response_format={"type": "json_object"},
        max_tokens=100,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may run to max_tokens: then it is a cut-off prefix, as OpenAI's
        assert r.choices[0].message.content.startswith("{")


def test_completion_logprobs_match_an_mlx_lm_forward(client, oracle):
    """Greedy, so mlx-lm's own step by step forward picks the same tokens; the
    logprobs are its raw log-softmax at each position."""
    model, tok = oracle
    prompt = "def fib(n):\n    "
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    gen, rows = _greedy_with_processors(oracle, tok.encode(prompt), 12, keep_logprobs=True)
    assert tok.decode(gen) == r.choices[0].text
    np.testing.assert_allclose(lp.token_logprobs, [row[t] for row, t in zip(rows, gen)], atol=2e-4)
    for row, top in zip(rows, lp.top_logprobs):
        assert len(top) == 5
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(row)[::-1][:5], atol=2e-4)


def test_chat_logprobs_shape_and_values(client, oracle):
    _, tok = oracle
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", "replace") == r.choices[0].message.content
    for c in content:  # the sampled token is greedy: it is the top alternative
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6)
    # streamed: the same tokens, their logprobs spread over the chunks
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, logprobs=True, stream=True)
    streamed = [c for ch in stream for ch_c in ch.choices if ch_c.logprobs for c in ch_c.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-6)


def _greedy_with_processors(oracle, prompt: list[int], n: int, keep_logprobs: bool = False, **kw):
    """mlx-lm's make_logits_processors applied to the generated tokens, greedy;
    with ``keep_logprobs`` also the raw log-softmax at each position."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = oracle
    procs = make_logits_processors(**kw)
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    out: list[int] = []
    rows = []
    for _ in range(n):
        rows.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0])
        x = logits
        for p in procs:
            x = p(mx.array(out, mx.int32), x)
        t = int(mx.argmax(x, axis=-1).item())
        if t in tok.eos_token_ids:
            break
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[:, -1, :]
    return (out, rows) if keep_logprobs else out


def test_penalties_and_logit_bias_match_mlx_lm(client, oracle):
    _, tok = oracle
    prompt = "x = [1, 2, 3]\n" * 3
    p_ids = tok.encode(prompt)
    n = 24
    cases = [
        ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5, "frequency_context_size": n}),
        ({"presence_penalty": 2.0}, {"presence_penalty": 2.0, "presence_context_size": n}),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8, "repetition_context_size": n}),
    ]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=n)
    banned = tok.encode(plain.choices[0].text)[0]
    cases.append(({"logit_bias": {str(banned): -100}}, {"logit_bias": {banned: -100.0}}))
    for api_kw, mlx_kw in cases:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, **api_kw)
        want = _greedy_with_processors(oracle, p_ids, n, **mlx_kw)
        assert r.choices[0].text == tok.decode(want), api_kw
        assert r.choices[0].text != plain.choices[0].text, api_kw  # the processor changed something


@pytest.mark.parametrize(
    "body,param",
    [
        ({"response_format": _fmt({"type": "foo"})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(server, body, param):
    r = httpx.post(
        f"{server}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_completion_logprobs_out_of_range(server):
    """One limit for both routes (engine.limits.MAX_TOP_LOGPROBS, 20), not OpenAI's legacy 5."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{server}/v1/completions", json={**body, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(f"{server}/v1/completions", json={**body, "logprobs": 6})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 6
