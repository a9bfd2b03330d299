"""LoRA adapters on the MLX backend (issue #43): rows with different adapters
in one batch each get their own adapter's greedy tokens, as
``mlx_lm.load(path, adapter_path=...)`` + ``generate_step`` give them, through
prefill (alone and together), decode, rows joining, running ahead and verify
windows. The adapters are random (non-zero B) in mlx-lm's own format."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench.lora import random_adapter as make_adapter
from engine.adapters import read_adapter
from engine.config import EngineConfig
from engine.mlx.backend import load_mlx_backend
from engine.models import resolve_model
from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan, VerifyRow
from engine.types import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=10_000, ignore_eos=True)
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n\n", "class Point:\n    def __init__(self, x, y):\n"]
N = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    path = resolve_model("tiny")
    specs = tuple(read_adapter(n, str(make_adapter(path, tmp / n, seed=s))) for n, s in (("one", 1), ("two", 2)))
    backend, device = load_mlx_backend(EngineConfig(model=str(path), adapters=specs))
    yield backend, device, specs, path
    device.close()


def _oracle(served, prompt: list[int], adapter: str | None, n: int = N) -> list[int]:
    from mlx_lm import load

    _, device, _, path = served

    def run():
        model = load(str(path), adapter_path=adapter)[0]
        return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))]

    return device.call(run)


def test_the_adapter_changes_the_output_and_matches_mlx_lm(served):
    backend, device, (one, two), _ = served
    assert backend.counters["lora_stacks"] == 4 * 3  # num_layers x keys: both adapters share the stacks
    prompt = backend.tokenizer.encode(PROMPTS[0])
    refs = {a: _oracle(served, prompt, a and a.path) for a in (None, one, two)}
    assert len({tuple(r) for r in refs.values()}) == 3  # else the test could not tell adapters apart
    for spec in (None, one, two):
        rid = 1 if spec is None else 2 if spec is one else 3
        device.call(backend.step, StepPlan(open=[OpenRow(rid, GREEDY, adapter=spec.id if spec else "")]))
        device.call(backend.step, StepPlan(prefill=[PrefillChunk(rid, prompt[:-1])]))
        out, tok = [], prompt[-1]
        for _ in range(N):
            tok = device.call(backend.step, StepPlan(decode=[DecodeRow(rid, tok)])).tokens[rid]
            out.append(tok)
        device.call(backend.step, StepPlan(close=[rid]))
        assert out == refs[spec], spec


@pytest.mark.parametrize("ahead", [False, True], ids=["step", "run-ahead"])
def test_rows_of_different_adapters_share_one_batch(served, ahead):
    """Base, one, two and one again: prefilled together, joining at different
    steps, decoding in one batch (run ahead when ``ahead``), then a verify
    window of each row's own next tokens. Each row gets its own oracle's."""
    backend, device, (one, two), _ = served
    plan = [(PROMPTS[0], None), (PROMPTS[0], one), (PROMPTS[1], two), (PROMPTS[2], one)]
    prompts = [backend.tokenizer.encode(p) for p, _ in plan]
    refs = [_oracle(served, p, s and s.path, N + 4) for p, (_, s) in zip(prompts, plan)]
    rids = [100 + i + 10 * ahead for i in range(len(plan))]

    def step(**kw):
        res = device.call(backend.step, StepPlan(**kw))
        assert not res.errors, res.errors
        if ahead:
            device.call(backend.run_ahead, lambda: True)
        return res

    step(open=[OpenRow(r, GREEDY, adapter=s.id if s else "") for r, (_, s) in zip(rids, plan)])
    step(prefill=[PrefillChunk(r, p[:-1]) for r, p in zip(rids, prompts)])
    out: dict[int, list[int]] = {r: [] for r in rids}
    nxt = {r: p[-1] for r, p in zip(rids, prompts)}
    for t in range(N + len(rids)):
        live = [r for i, r in enumerate(rids) if i <= t and len(out[r]) < N]
        if not live:
            break
        res = step(decode=[DecodeRow(r, nxt[r]) for r in live])
        for r in live:
            nxt[r] = res.tokens[r]
            out[r].append(res.tokens[r])
    assert [out[r] for r in rids] == [ref[:N] for ref in refs]
    # a verify window of each row's true next tokens: all accepted, one more sampled
    res = step(verify=[VerifyRow(r, [nxt[r], *ref[N : N + 2]]) for r, ref in zip(rids, refs)])
    assert [res.verified[r] for r in rids] == [ref[N : N + 3] for ref in refs]
    step(close=rids)


def test_a_row_naming_an_adapter_not_loaded_fails_alone(served):
    backend, device, _, _ = served
    res = device.call(backend.step, StepPlan(open=[OpenRow(900, GREEDY, adapter="three@0123456789abcdef")]))
    assert "not loaded" in res.errors[900]
    assert 900 not in backend._rows


def test_an_adapter_that_does_not_fit_or_changed_is_refused(tmp_path):
    from engine.mlx import lora

    path = resolve_model("tiny")
    ad = make_adapter(path, tmp_path / "a", seed=3)
    spec = read_adapter("a", str(ad))
    from mlx_lm import load

    model = load(str(path))[0]
    shutil.copy(make_adapter(path, tmp_path / "b", seed=4) / "adapters.safetensors", ad / "adapters.safetensors")
    with pytest.raises(ValueError, match="changed on disk"):
        lora.Adapters().load(model, spec)
    weights = mx.load(str(ad / "adapters.safetensors"))
    name = next(k for k in weights if k.endswith("lora_a"))
    weights[name] = mx.zeros((3, 4))
    mx.save_safetensors(str(ad / "adapters.safetensors"), weights)
    with pytest.raises(ValueError, match="do not fit"):
        lora.Adapters().load(model, read_adapter("a", str(ad)))
    with pytest.raises(ValueError, match="adapter_config.json"):
        read_adapter("c", str(tmp_path))
    with pytest.raises(ValueError, match="must match"):
        read_adapter("a:b", str(ad))


def test_bench_grouped_arm_gives_the_per_row_batch_tokens(served):
    """bench.lora's grouped arm (each adapter's rows their own batch) against its
    per-row-delta arm (one batch): the same greedy tokens, row by row."""
    from bench.lora import grouped, per_row

    backend, device, (one, two), _ = served
    prompt = backend.tokenizer.encode(PROMPTS[1])
    rows = ["", one.id, two.id, one.id]
    tps, tokens = per_row(backend, device, rows, prompt, 6)
    gtps, gtokens = grouped(backend, device, rows, prompt, 6)
    assert tps > 0 and gtps > 0
    assert len({tuple(t) for t in tokens[:3]}) == 3  # else the comparison could not tell rows apart
    assert tokens[1] == tokens[3] and all(len(t) == 6 + 4 for t in tokens)
    assert gtokens == tokens
