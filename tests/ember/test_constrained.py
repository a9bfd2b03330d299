"""Grammar-constrained decoding (llguidance) on the bundled ``tiny`` model.

Oracles: the output parses and validates with ``jsonschema`` (an independent
validator, not llguidance); greedy output with n-gram speculation equals the
same request without it (so draft tokens the grammar forbids were rejected and
the matcher rolled back with the cache); the first-token frequencies under a
constraint match the model's own distribution (an mlx-lm forward) restricted
to the allowed tokens and renormalised (a chi-square test).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading

import jsonschema
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.numpy  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest

from ember import Engine, EngineConfig, InvalidRequest, SamplingParams  # noqa: E402
from engine.models import resolve_model  # noqa: E402
from engine.types import Constraint  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = os.environ.get("EMBER_TEST_MODEL", "tiny")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "ok"]}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
PROMPTS = ["def add(a, b):\n    return", '{"name": "Bob", "age": 3, ', "import os\n", "x = [1, 2, 3]\n" * 4]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is a real thread


def _cfg(**kw) -> EngineConfig:
    model = resolve_model(MODEL)
    return EngineConfig(model=str(model), max_batch=8, prompt_cache_gib=0, **kw)


def _spec(stats: dict) -> dict:
    return stats["speculation"]["verifier"] if "verifier" in stats["speculation"] else stats["speculation"]


def _json(schema=SCHEMA) -> Constraint:
    return Constraint(kind="json_schema", source=json.dumps(schema))


def _requests() -> list[tuple[str, SamplingParams]]:
    out = []
    for p in PROMPTS:
        for t, seed in [(0.0, None), (0.7, 1), (1.0, 2), (1.5, 3)]:
            out.append((p, SamplingParams(max_tokens=120, temperature=t, seed=seed, constraint=_json())))
    # Any JSON object: nothing bounds its size, so the tiny model can run to
    # max_tokens (a "length" finish, as OpenAI's); these prompts close it.
    for p in ["config = ", '{"id": 1}\n']:
        out.append((p, SamplingParams(max_tokens=120, constraint=Constraint(kind="json_object"))))
    return out


@pytest.mark.parametrize("draft", [None, "ngram"])
async def test_constrained_outputs_validate_alone_and_batched(draft):
    kw = {"draft_model": draft, "num_draft_tokens": 3} if draft else {}
    async with Engine.open(_cfg(**kw)) as engine:
        reqs = _requests()
        alone = [await engine.acomplete(p, sp) for p, sp in reqs[:3]]
        batched = await asyncio.gather(*[engine.acomplete(p, sp) for p, sp in reqs])
        stats = engine.stats()
        pipelined = engine.backend.stats()["pipelined"]
    for c, (_, sp) in zip(alone + batched, reqs[:3] + reqs):
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        if sp.constraint.kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)
    # a request alone and in a batch of 20 others: the same greedy output
    assert alone[0].text == batched[0].text
    if draft:
        assert _spec(stats)["spec_decode_num_draft_tokens"] > 0  # the windows really ran
    else:
        assert pipelined > 0  # masked steps ran ahead of the Scheduler


async def test_greedy_constrained_speculation_equals_plain():
    """Drafts the grammar forbids are rejected and the matcher rolls back with
    the cache: greedy output with prompt lookup is the output without it."""
    reqs = [(p, SamplingParams(max_tokens=120, constraint=_json())) for p in PROMPTS]
    reqs += [
        (p, SamplingParams(max_tokens=60, constraint=Constraint(kind="regex", source=r"(x = \[[0-9], [0-9]\]\n){1,6}")))
        for p in PROMPTS
    ]
    async with Engine.open(_cfg()) as engine:
        plain = await asyncio.gather(*[engine.acomplete(p, sp) for p, sp in reqs])
    async with Engine.open(_cfg(draft_model="ngram", num_draft_tokens=4)) as engine:
        spec = await asyncio.gather(*[engine.acomplete(p, sp) for p, sp in reqs])
        stats = _spec(engine.stats())
        backend = engine.backend.stats()
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    # constrained plain steps ran ahead with their masks, and steps run ahead
    # were undone (the matcher rolled back) when a row turned to a verify window
    assert backend["pipelined"] > 0 and backend["undone"] > 0, backend
    # drafts were both accepted and rejected
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0


def test_forbidden_draft_is_rejected_and_rolled_back():
    """At the backend port: a verify window whose second draft the grammar
    forbids gets a target token there that differs from it, and after the trim
    the matcher is where the cache is."""
    from engine.mlx.backend import load_mlx_backend
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan, VerifyRow

    backend, device = load_mlx_backend(_cfg())
    try:
        tok = backend.tokenizer
        prompt = tok.encode("answer: ")
        sp = SamplingParams(max_tokens=20, constraint=Constraint(kind="regex", source=r"[0-9]{8}"))
        device.call(backend.step, StepPlan(open=[OpenRow(1, sp)], prefill=[PrefillChunk(1, prompt[:-1])]))
        first = device.call(backend.step, StepPlan(decode=[DecodeRow(1, prompt[-1])])).tokens[1]
        assert tok.decode([first]).isdigit()
        digit, letter = tok.encode("7")[0], tok.encode("q")[0]
        res = device.call(backend.step, StepPlan(verify=[VerifyRow(1, [first, digit, letter, digit])]))
        targets = res.verified[1]
        assert len(targets) == 4 and targets[1] != letter and tok.decode([targets[1]]).isdigit()
        row = backend._rows[1].logits
        # all four were fed; the matcher stopped at `letter`
        assert row.consumed == 2 and len(row.history) == 4
        device.call(backend.step, StepPlan(trim=[(1, 2)]))  # reject `letter` and what followed
        assert row.consumed == len(row.history) == 2
        nxt = device.call(backend.step, StepPlan(decode=[DecodeRow(1, targets[1])])).tokens[1]
        text = tok.decode([first, digit, targets[1], nxt])
        assert len(text) >= 4 and text.isdigit()
    finally:
        device.close()


async def test_bad_constraints_are_refused_naming_the_parameter():
    async with Engine.open(_cfg()) as engine:
        grammars = engine.backend.grammars
        compile_, threads = grammars.compile, []

        def watched(c):
            threads.append(threading.get_ident())
            return compile_(c)

        grammars.compile = watched
        ok = await engine.acomplete(
            "x", SamplingParams(max_tokens=4, constraint=Constraint(kind="regex", source="[ab]+"))
        )
        assert set(ok.text) <= {"a", "b"}
        # compiled on a worker thread, never on the event loop's
        assert threads and threading.get_ident() not in threads
        for c in [
            Constraint(kind="json_schema", source='{"type": "foo"}'),
            Constraint(kind="json_schema", source="{not json"),
            Constraint(kind="json_schema", source="[1, 2]"),
            Constraint(kind="regex", source="[a-"),
            Constraint(kind="lark", source="start: undefined_rule"),
        ]:
            with pytest.raises(InvalidRequest) as e:
                await engine.acomplete("x", SamplingParams(constraint=c))
            assert e.value.param == "constraint", c
        with pytest.raises(InvalidRequest) as e:
            await engine.acomplete("x", SamplingParams(constraint=_json(), ignore_eos=True))
        assert e.value.param == "ignore_eos"
        assert engine.backend.grammars.counters["refused"] >= 3


async def test_fake_backend_refuses_logits_processing_by_name():
    async with Engine.open(EngineConfig(backend="fake")) as engine:
        for kw, param in [
            ({"constraint": _json()}, "constraint"),
            ({"logprobs": 2}, "logprobs"),
            ({"logit_bias": {3: 1.0}}, "logit_bias"),
            ({"frequency_penalty": 0.5}, "frequency_penalty"),
            ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ]:
            with pytest.raises(InvalidRequest) as e:
                await engine.acomplete("hello", SamplingParams(max_tokens=4, **kw))
            assert e.value.param == param


def _chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + alpha_z * math.sqrt(a)) ** 3


@pytest.mark.heavy  # thousands of sampled tokens for a chi-square bound: 17 s without OpenBLAS
async def test_constraint_keeps_the_distribution_over_allowed_tokens():
    """At temperature 1 the first token's frequencies under a regex are the
    model's probabilities restricted to the tokens the grammar allows there,
    renormalised (chi-square, seeded, p > 0.001)."""
    from mlx_lm import load

    cfg = _cfg()
    regex = r"(a|an|the|to|it|is|in|on|of|one|two|three|x|y|z|[0-9]+)( [a-z]+)?"
    prompt_text = "def add(a, b):\n    return"
    n = 600
    async with Engine.open(cfg) as engine:
        prompt = engine.encode(prompt_text)
        c = Constraint(kind="regex", source=regex)
        gate = asyncio.Semaphore(32)  # under the Gateway's in-flight bound

        async def one(i: int):
            async with gate:
                return await engine.acomplete(
                    prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=1000 + i, constraint=c)
                )

        done = await asyncio.gather(*[one(i) for i in range(n)])
        eos = sorted(engine.tokenizer.eos_token_ids)
        hf = engine.backend.grammars._hf
        vocab = engine.info.vocab_size
    firsts = [d.token_ids[0] if d.token_ids else eos[0] for d in done]

    # The oracle: mlx-lm's own forward, and a fresh llguidance matcher for the mask.
    model, _ = load(cfg.model)
    logits = model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    p = np.array(mx.softmax(logits, axis=-1)).astype(np.float64)
    lt = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_regex(regex))
    words = llguidance.numpy.allocate_token_bitmask(1, vocab)
    llguidance.numpy.fill_next_token_bitmask(m, words)
    allowed = np.unpackbits(words[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
    q = np.where(allowed, p, 0.0)
    q /= q.sum()
    assert all(allowed[t] for t in firsts)

    counts = np.bincount(firsts, minlength=vocab).astype(np.float64)
    expected = q * n
    big = expected >= 5
    assert big.sum() >= 4, "the test needs several likely allowed tokens"
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a small remainder into the last big bin
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    assert chi2 < _chi2_critical(df), (chi2, df, obs, exp)
    # and the unconstrained distribution is clearly different (the test can fail)
    p_obs = counts / n
    assert np.abs(p_obs - p).sum() > 0.2


async def test_n_choices_open_and_prefill_together():
    """``n`` rows of one request are admitted concurrently, so they open in the
    same step and their prompt goes through one batched prefill forward."""
    from transport.turn.choices import submit_choices

    async with Engine.open(_cfg()) as engine:
        prompt = engine.encode("import os\nimport sys\n" * 20)
        before = engine.backend.counters["prefill_together"]
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in (1, 2, 3)]
        stream = await submit_choices(engine, prompt, params, {})
        texts = {rid: "" for rid in stream.rids}
        async with stream:
            async for d in stream:
                texts[d.rid] += d.text
        assert engine.backend.counters["prefill_together"] - before == 3
        assert len(set(texts.values())) > 1  # three seed streams
        bad = [SamplingParams(constraint=Constraint(kind="regex", source="[a-"))] * 3
        with pytest.raises(InvalidRequest) as e:
            await submit_choices(engine, prompt, bad, {"constraint": "response_format"})
        assert e.value.param == "response_format"
        assert engine.gateway.stats()["in_flight"] == 0  # nothing left behind
