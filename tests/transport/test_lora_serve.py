"""LoRA adapters on a live ``ember serve --model tiny --adapter ...`` (issue
#43): the adapter's greedy output is mlx-lm's with ``adapter_path``; the same
prompt sent to the base model first is no cache hit for the adapter (a KV of
the base model reused would change its tokens); base and adapter requests in
flight together each get their own; and with ``--ssd-cache`` a prefix the
adapter stored is restored after a restart, but not once the adapter's file
was replaced. The cache-hit count is ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench.lora import random_adapter as make_adapter
from engine.models import resolve_model
from tests.live_server import ember_serve

pytestmark = pytest.mark.slow

TEXT = "Summarise the following notes in one line. " + " ".join(
    f"Note {i}: the build on runner {i % 7} took {10 + i} minutes." for i in range(12)
)
N = 10


def _oracle(prompt: list[int], adapter: Path | None) -> list[int]:
    from mlx_lm import load

    model = load(str(resolve_model("tiny")), adapter_path=str(adapter) if adapter else None)[0]
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, sampler=make_sampler(0.0))]


def _prompt() -> list[int]:
    from mlx_lm import load

    return load(str(resolve_model("tiny")))[1].encode(TEXT)


def _ask(c: httpx.Client, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _answer_text(answer: dict) -> str:
    return answer["choices"][0]["text"]


def _text(ids: list[int]) -> str:
    from mlx_lm import load

    return load(str(resolve_model("tiny")))[1].decode(ids)


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_adapter_requests_match_mlx_lm_and_never_reuse_the_base_models_cache(tmp_path):
    one = make_adapter(resolve_model("tiny"), tmp_path / "one", seed=1)
    two = make_adapter(resolve_model("tiny"), tmp_path / "two", seed=2)
    prompt = _prompt()
    want = {m: _text(_oracle(prompt, a)) for m, a in (("tiny", None), ("one", one), ("two", two))}
    assert len(set(want.values())) == 3
    flags = ("--model", "tiny", "--no-ssd-cache", "--adapter", f"one={one}", "--adapter", f"two={two}")
    with ember_serve(*flags) as (_, url), httpx.Client(base_url=url, timeout=120) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert c.get("/v1/models/tiny:two").json()["id"] == "two"
        assert cards["one"]["kind"] == cards["two"]["kind"] == "adapter"
        assert cards["one"]["parent"] == "tiny"
        base = _ask(c, "tiny", prompt)
        first = _ask(c, "one", prompt)  # the same prompt, just cached by the base model
        again = _ask(c, "tiny:one", prompt)
        assert (_answer_text(base), _answer_text(first), _answer_text(again)) == (
            want["tiny"],
            want["one"],
            want["one"],
        )
        assert _cached(first) == 0, first["usage"]
        assert _cached(again) > 0, again["usage"]  # its own prefix is a hit
        assert first["model"] == "one"
        # in flight together: one continuous batch holding rows of three adapters
        with ThreadPoolExecutor(6) as pool:
            names = ["tiny", "one", "two"] * 2
            answers = list(pool.map(lambda m: _ask(c, m, prompt), names))
        assert [_answer_text(a) for a in answers] == [want[m] for m in names]
        assert c.post("/v1/completions", json={"model": "three", "prompt": "x"}).status_code == 404


def test_a_replaced_adapter_file_is_a_miss_after_a_restart(tmp_path):
    path = resolve_model("tiny")
    ad = make_adapter(path, tmp_path / "ad", seed=1)
    prompt = _prompt()
    flags = ("--model", "tiny", "--ssd-cache", str(tmp_path / "ssd"), "--adapter", f"one={ad}")

    def run_once() -> dict:
        with ember_serve(*flags) as (_, url), httpx.Client(base_url=url, timeout=120) as c:
            answer = _ask(c, "one", prompt)
            flushed = c.post("/admin/cache/flush", json={})
            assert flushed.status_code == 200, flushed.text  # on SSD, renamed and fsynced
            return answer

    stored = run_once()
    restored = run_once()  # the same adapter: its prefix comes back from SSD
    assert _cached(stored) == 0 and _cached(restored) > 0, restored["usage"]
    new = make_adapter(path, tmp_path / "new", seed=7)
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(new / name, ad / name)
    replaced = run_once()
    assert _cached(replaced) == 0, replaced["usage"]
    assert _answer_text(replaced) == _text(_oracle(prompt, ad)) != _answer_text(stored)


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("one", "NAME=PATH"),
        ("one={missing}", "no adapter_config.json"),
        ("a:b={ad}", "must match"),
    ],
)
def test_bad_adapter_flags_exit_2(tmp_path, flag, says, capsys):
    from transport.cli import build_parser, engine_config

    (tmp_path / "ad").mkdir()
    flag = flag.format(missing=tmp_path / "nowhere", ad=tmp_path / "ad")
    with pytest.raises(SystemExit) as exc:
        parsed = build_parser().parse_args(["serve", "--model", "tiny", "--no-ssd-cache", "--adapter", flag])
        engine_config(parsed, parsed.parser)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_adapters_need_the_mlx_backend(tmp_path, capsys):
    from transport.cli import build_parser, engine_config

    ad = make_adapter(resolve_model("tiny"), tmp_path / "ad", seed=1)
    parsed = build_parser().parse_args(["serve", "--fake-gpu", "--no-ssd-cache", "--adapter", f"one={ad}"])
    with pytest.raises(SystemExit):
        engine_config(parsed, parsed.parser)
    assert "MLX backend" in capsys.readouterr().err
    parsed = build_parser().parse_args(["serve", "--model", "tiny", "--no-ssd-cache", "--adapter", f"one={ad}"])
    spec = engine_config(parsed, parsed.parser).adapters[0]
    assert spec.name == "one" and spec.id.startswith("one@") and spec.path == str(ad.resolve())
