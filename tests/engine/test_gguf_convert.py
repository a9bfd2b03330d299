"""The GGUF converter on a tiny synthetic llama written with ``gguf.GGUFWriter``.

The oracle is mlx-lm's own llama on the original (HF-layout) weights: the file
stores Q/K permuted the way llama.cpp's converter does (its ``permute``), so a
missing or wrong un-permutation changes the logits, and the converted
directory must give the same logits as the model built from the originals.
"""

from __future__ import annotations

import json
from dataclasses import replace

import gguf
import mlx.core as mx
import numpy as np
import pytest

from engine.mlx.gguf_convert import GGUFError, cached_conversion, convert, mlx_name, model_config  # noqa: E402

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 128, 2
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i s", "Ġ is"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|user|>", "<|assistant|>"]
    return tokens, merges


def _hf_weights(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    head_dim = HIDDEN // HEADS
    w = {
        "model.embed_tokens.weight": rng.normal(0, 0.5, (vocab, HIDDEN)),
        "model.norm.weight": 1 + rng.normal(0, 0.1, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.2, (HEADS * head_dim, HIDDEN))
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.2, (KV_HEADS * head_dim, HIDDEN))
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.2, (KV_HEADS * head_dim, HIDDEN))
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.2, (HIDDEN, HEADS * head_dim))
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.2, (FF, HIDDEN))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, 0.2, (FF, HIDDEN))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, 0.2, (HIDDEN, FF))
        w[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, HIDDEN)
    return {k: v.astype(np.float32) for k, v in w.items()}


_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_TO_GGUF['.'.join(rest[:-1])]}.weight"


def write_llama_gguf(path, qtype=None, seed=0) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF laid out as llama.cpp writes one; returns the HF weights.
    ``qtype`` (a GGMLQuantizationType) quantizes the 2-D projection weights."""
    tokens, merges = _vocab()
    weights = _hf_weights(len(tokens), np.random.default_rng(seed))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    for name, arr in weights.items():
        if ".q_proj." in name:
            arr = _llama_cpp_permute(arr, HEADS)
        elif ".k_proj." in name:
            arr = _llama_cpp_permute(arr, KV_HEADS)
        if qtype is not None and arr.ndim == 2 and "embed" not in name:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def _logits(model, ids) -> np.ndarray:
    out = model(mx.array([ids]))
    return np.array(out.astype(mx.float32))[0]


def _reference_model(path, weights: dict[str, np.ndarray]):
    """mlx-lm's llama built from the converted config and the ORIGINAL HF weights."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


IDS = [5, 80, 260, 261, 33, 7, 120, 255, 3, 64]


def test_llama_float32_matches_mlx_lm_on_the_original_weights(tmp_path):
    from mlx_lm import load

    weights = write_llama_gguf(tmp_path / "m.gguf")
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == KV_HEADS and cfg["tie_word_embeddings"]
    model, tok = load(str(out))
    got, want = _logits(model, IDS), _logits(_reference_model(out, weights), IDS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_rope_unpermutation_is_what_makes_it_match(tmp_path, monkeypatch):
    # The same file converted without undoing llama.cpp's permutation gives other logits:
    # the test above can fail.
    from mlx_lm import load

    import engine.mlx.gguf_convert as gc

    weights = write_llama_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(gc, "unpermute_rope_rows", lambda w, n: w)
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    model, _ = load(str(out))
    assert np.abs(_logits(model, IDS) - _logits(_reference_model(out, weights), IDS)).max() > 1e-2


@pytest.mark.parametrize("qname", ["Q8_0", "Q4_0"])
def test_quantized_blocks_stay_quantized_and_compute_what_dequantizing_does(tmp_path, qname):
    from mlx_lm import load

    qtype = getattr(gguf.GGMLQuantizationType, qname)
    write_llama_gguf(tmp_path / "m.gguf", qtype=qtype)
    q = convert(tmp_path / "m.gguf", tmp_path / "q", dtype="quantized", progress=False)
    f = convert(tmp_path / "m.gguf", tmp_path / "f", dtype="float32", progress=False)
    cfg = json.loads((q / "config.json").read_text())
    bits = 8 if qname == "Q8_0" else 4
    assert cfg["quantization"]["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": bits}
    qmodel, _ = load(str(q))
    assert type(qmodel.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    fmodel, _ = load(str(f))
    for i in range(LAYERS):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            ql = qmodel.model.layers[i]
            fl = fmodel.model.layers[i]
            for attr in part.split("."):
                ql, fl = getattr(ql, attr), getattr(fl, attr)
            deq = mx.dequantize(ql.weight, ql.scales, ql.biases, group_size=32, bits=bits)
            # the same blocks, un-permuted the same way; float16 arithmetic on one side
            np.testing.assert_allclose(np.array(deq.astype(mx.float32)), np.array(fl.weight), rtol=2e-3, atol=2e-3)
    assert np.argmax(_logits(qmodel, IDS), -1).tolist() == np.argmax(_logits(fmodel, IDS), -1).tolist()


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    from mlx_lm import load

    write_llama_gguf(tmp_path / "m.gguf")
    out = convert(tmp_path / "m.gguf", tmp_path / "out", dtype="float32", progress=False)
    _, tok = load(str(out))
    text = "the cat is here"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    tokens, _ = _vocab()
    assert tokens.index("Ġis") in ids and tokens.index("he") in ids  # the merges were applied
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>hi\n<|assistant|>"
    assert tok.eos_token_ids == {tokens.index("<|endoftext|>")}


def test_cached_conversion_converts_once(tmp_path, monkeypatch):
    import engine.mlx.gguf_convert as gc

    write_llama_gguf(tmp_path / "m.gguf")
    calls = []
    real = gc.convert
    monkeypatch.setattr(gc, "convert", lambda *a, **k: calls.append(1) or real(*a, **{**k, "progress": False}))
    first = cached_conversion(tmp_path / "m.gguf", "float32", root=tmp_path / "cache")
    second = cached_conversion(tmp_path / "m.gguf", "float32", root=tmp_path / "cache")
    assert first == second and (first / "model.safetensors").is_file() and len(calls) == 1
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".converting")]


def test_bad_files_are_clear_errors(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert(tmp_path / "junk.gguf", tmp_path / "out", progress=False)
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        model_config({"general.architecture": "mamba"}, set())
    with pytest.raises(GGUFError, match="unknown tensor"):
        mlx_name("blk.0.frobnicate.weight", "llama")


def test_gemma3_names_and_config():
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.sliding_window": 512,
        "gemma3.context_length": 32768,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a"] * 100,
    }
    cfg = model_config(meta, {"token_embd.weight"})
    assert cfg["model_type"] == "gemma3_text" and cfg["sliding_window"] == 512 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["tie_word_embeddings"] and cfg["vocab_size"] == 100
    assert mlx_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert mlx_name("blk.2.ffn_norm.weight", "llama") == "model.layers.2.post_attention_layernorm.weight"
    assert mlx_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"


def test_ember_convert_subcommand_writes_a_loadable_directory(tmp_path, capsys):
    from transport.cli import build_parser

    write_llama_gguf(tmp_path / "m.gguf")
    args = build_parser().parse_args(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out"), "--dtype", "float32"])
    assert args.run(args, args.parser) == 0
    assert "ember serve --model" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["ember_gguf"]["dtype"] == "float32"
    bad = build_parser().parse_args(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o2")])
    with pytest.raises(SystemExit) as e:
        bad.run(bad, bad.parser)
    assert e.value.code == 2 and "is not a file" in capsys.readouterr().err


def test_a_gguf_path_as_model_resolves_to_its_cached_conversion(tmp_path, monkeypatch):
    from engine.models import resolve_model

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    write_llama_gguf(tmp_path / "m.gguf")
    path = resolve_model(str(tmp_path / "m.gguf"))
    assert path.parent == tmp_path / "cache" / "gguf" and (path / "tokenizer.json").is_file()
    assert resolve_model(str(tmp_path / "m.gguf")) == path


def test_the_served_weight_format_is_the_packaged_models_measured_choice(monkeypatch):
    """On MLX's CPU backend a packaged model serves in its measured format
    (the Qwen 1.5B and 0.5B: q8, docs/bench/weight-format.md), any other in float32; EMBER_WEIGHTS overrides
    both, and a bad value is one clear error."""
    import mlx.core as mx

    from engine.mlx.gguf_convert import default_dtype
    from engine.mlx.gguf_models import PACKAGED

    monkeypatch.delenv("EMBER_WEIGHTS", raising=False)
    assert mx.default_device() == mx.cpu  # this suite runs MLX's CPU backend
    assert PACKAGED["qwen2.5-coder-1.5b"].cpu_weights == "q8"
    assert default_dtype(PACKAGED["qwen2.5-coder-0.5b"].cpu_weights) == "q8"  # since the int8 dot path
    assert default_dtype(PACKAGED["qwen2.5-coder-1.5b"].cpu_weights) == "q8"
    assert default_dtype(PACKAGED["smollm2-135m"].cpu_weights) == "float32"
    assert default_dtype() == "float32"
    monkeypatch.setenv("EMBER_WEIGHTS", "float32")
    assert default_dtype("q8") == "float32"
    monkeypatch.setenv("EMBER_WEIGHTS", "q3")
    with pytest.raises(GGUFError, match="EMBER_WEIGHTS"):
        default_dtype("q8")


def test_a_packaged_drafter_resolves_in_its_drafting_format(monkeypatch):
    """``--draft-model qwen2.5-coder-0.5b`` loads the q8 conversion (a draft step is one
    token's latency: docs/bench/spec-real.md), as served alone; a packaged model's
    draft_weights, where it has one, wins for drafting; EMBER_WEIGHTS still decides both."""
    import mlx.core as mx

    import engine.mlx.gguf_convert as gc
    import engine.mlx.gguf_models as gm
    from engine.models import resolve_model

    assert mx.default_device() == mx.cpu
    monkeypatch.delenv("EMBER_WEIGHTS", raising=False)
    monkeypatch.setattr(gm, "packaged_gguf", lambda key: f"/gguf/{key}")
    monkeypatch.setattr(gc, "cached_conversion", lambda path, dtype=None, **_: (path, dtype))
    assert resolve_model("qwen2.5-coder-0.5b", draft=True) == ("/gguf/qwen2.5-coder-0.5b", "q8")
    assert resolve_model("qwen2.5-coder-0.5b") == ("/gguf/qwen2.5-coder-0.5b", "q8")
    monkeypatch.setitem(
        gm.PACKAGED,
        "qwen2.5-coder-0.5b",
        replace(gm.PACKAGED["qwen2.5-coder-0.5b"], cpu_weights=None, draft_weights="q8"),
    )
    assert resolve_model("qwen2.5-coder-0.5b", draft=True) == ("/gguf/qwen2.5-coder-0.5b", "q8")
    assert resolve_model("qwen2.5-coder-0.5b") == ("/gguf/qwen2.5-coder-0.5b", "float32")
    monkeypatch.undo()
    monkeypatch.delenv("EMBER_WEIGHTS", raising=False)
    monkeypatch.setattr(gm, "packaged_gguf", lambda key: f"/gguf/{key}")
    monkeypatch.setattr(gc, "cached_conversion", lambda path, dtype=None, **_: (path, dtype))
    assert resolve_model("qwen2.5-coder-1.5b", draft=True) == ("/gguf/qwen2.5-coder-1.5b", "q8")  # as served
    assert resolve_model("smollm2-135m", draft=True) == ("/gguf/smollm2-135m", "float32")
    monkeypatch.setenv("EMBER_WEIGHTS", "float32")
    assert resolve_model("qwen2.5-coder-0.5b", draft=True) == ("/gguf/qwen2.5-coder-0.5b", "float32")


def test_a_chatml_model_stops_at_endoftext_too():
    """A GGUF holds one EOS id; a ChatML model (EOS ``<|im_end|>``) also ends
    at ``<|endoftext|>``, as its generation_config.json says (Qwen2.5:
    [151645, 151643]): both go into config.json, which mlx-lm's tokenizer
    wrapper reads as its EOS set. Any other model keeps its one id."""
    from engine.mlx.gguf_convert import model_config

    tokens = ["a", "b", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    meta = {
        "general.architecture": "qwen2",
        "qwen2.block_count": 1,
        "qwen2.feed_forward_length": 8,
        "qwen2.attention.head_count": 2,
        "qwen2.embedding_length": 4,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.eos_token_id": 4,
    }
    assert model_config(meta, set())["eos_token_id"] == [4, 2]
    assert model_config({**meta, "tokenizer.ggml.eos_token_id": 2}, set())["eos_token_id"] == 2  # EOS not <|im_end|>
    no_eot = {**meta, "tokenizer.ggml.tokens": ["a", "b", "c", "d", "<|im_end|>"]}
    assert model_config(no_eot, set())["eos_token_id"] == 4
