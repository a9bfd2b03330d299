"""Fast checks of the bundled models (engine/models/tiny, tiny-draft).

Nothing here trains; the models are built by ``python -m tools.train_tiny``
(docs/models.md).
"""

from __future__ import annotations

import json

import pytest

from engine.models import BUNDLED, resolve_model

MAX_BYTES = 25 * 1024 * 1024

# What docs/models.md documents.
EXPECTED = {
    "tiny": dict(
        num_hidden_layers=6, hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2
    ),
    "tiny-draft": dict(
        num_hidden_layers=1, hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2
    ),
}
COMMON = dict(model_type="llama", vocab_size=2048, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def loaded():
    from mlx_lm import load

    return {name: load(str(resolve_model(name))) for name in BUNDLED}


def test_resolve_model(tmp_path):
    assert set(BUNDLED) == {"tiny", "tiny-draft"}
    for name, path in BUNDLED.items():
        assert resolve_model(name) == path
        assert path.is_dir()
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError):
        resolve_model("tiny-nonexistent")


@pytest.mark.parametrize("name", ["tiny", "tiny-draft"])
def test_layout_and_config(name):
    d = resolve_model(name)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (d / f).is_file(), f
    assert list(d.glob("model*.safetensors")) == [d / "model.safetensors"]
    assert (d / "model.safetensors").stat().st_size < MAX_BYTES
    cfg = json.loads((d / "config.json").read_text())
    for k, v in {**COMMON, **EXPECTED[name]}.items():
        assert cfg[k] == v, (k, cfg[k], v)
    assert cfg["max_position_embeddings"] >= 16384


def test_shared_tokenizer():
    a, b = resolve_model("tiny"), resolve_model("tiny-draft")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_load_eos_and_chat_template(loaded):
    import mlx.core as mx

    vocab = {}
    for name, (model, tok) in loaded.items():
        assert tok.eos_token == "<|endoftext|>"
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        assert tok.eos_token_ids == {eos}
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert isinstance(ids, list) and ids
        assert all(isinstance(i, int) for i in ids)
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>user\nhi<|im_end|>")
        assert text.endswith("<|im_start|>assistant\n")
        assert tok.decode(tok.encode("import os\n")) == "import os\n"
        vocab[name] = tok.vocab_size
        logits = model(mx.array([ids]))
        assert logits.shape == (1, len(ids), 2048)
        assert logits.dtype == mx.float32
    assert vocab["tiny"] == vocab["tiny-draft"] == 2048


@pytest.mark.parametrize("name", ["tiny", "tiny-draft"])
def test_greedy_generate(loaded, name):
    from mlx_lm import generate

    model, tok = loaded[name]
    text = generate(model, tok, "def ", max_tokens=12)
    assert isinstance(text, str) and text.strip()
    # greedy is deterministic
    assert generate(model, tok, "def ", max_tokens=12) == text


def test_speculative_generate_matches_greedy(loaded):
    from mlx_lm import generate

    target, tok = loaded["tiny"]
    draft, _ = loaded["tiny-draft"]
    plain = generate(target, tok, "import os\n", max_tokens=16)
    spec = generate(target, tok, "import os\n", max_tokens=16, draft_model=draft, num_draft_tokens=2)
    assert spec == plain
