"""GGUF checkpoints (llama.cpp, Ollama, LM Studio) → an mlx-lm model directory.

``convert(gguf_path, out_dir)`` reads the file with the ``gguf`` package (the
ggml project's reader) and writes what ``mlx_lm.load`` reads: ``config.json``
from the file's metadata, ``model.safetensors`` under mlx-lm's parameter
names, and ``tokenizer.json``/``tokenizer_config.json`` (with the chat
template, when the file has one) built by transformers' own GGUF tokenizer
builders. ``cached_conversion(gguf_path)`` does it once per file and dtype
into ``~/.cache/ember/gguf/<key>`` so a second start only loads.

Two things llama.cpp's converter does to the weights are undone here:

* llama: the rows of ``attn_q``/``attn_k`` are permuted so that ggml's RoPE
  (adjacent pairs) matches HF's (halves); mlx-lm uses HF's layout
  (``nn.RoPE(traditional=False)``), so the permutation is reversed.
* gemma*: RMSNorm weights are stored as ``1 + w`` (ggml multiplies by the
  weight, Gemma by ``1 + w``), so 1 is subtracted back.

Weights: ``dtype="quantized"`` keeps the file's Q4_0/Q4_1/Q8_0 blocks as MLX
affine quantization (``mx.load`` reads them exactly: 32-wide groups, one
scale and one bias per group) when every tensor of the file is of a kind
``mx.load`` reads; otherwise (K-quants, Q5_0, ...) every tensor is
dequantized with ``gguf.dequantize`` to a float dtype. Which one a device
serves fastest is measured, not assumed (docs/gguf.md): on the CPU float32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, cast

import numpy as np

from engine.cache_dir import cache_root as ember_cache_root

log = logging.getLogger("ember.gguf")

CONVERTER_VERSION = 2  # bump when the output of convert() changes (2: a ChatML model stops at <|endoftext|> too)
DTYPES = ("float32", "float16", "bfloat16", "quantized", "q8", "q4")
# MLX affine re-quantization of the dequantized weights (``q8``/``q4``): mlx-lm's default group
REQUANT_GROUP = 64

# GGUF tensor names (after "blk.N.") → mlx-lm's names under "model.layers.N.".
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# Norms after the attention/FFN differ: llama has one (ffn_norm, before the MLP);
# gemma2/3 have four.
_ARCH_LAYER_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    # qwen2: llama's layout plus q/k/v biases (``blk.N.attn_q.bias`` maps by suffix)
    "qwen2": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """The file is not a GGUF this converter can turn into an mlx-lm model."""


def _require_gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # optional: the `models` extra brings it
        raise GGUFError(
            "reading GGUF files needs the `gguf` package: pip install 'ember-mlx[models]' (or pip install gguf)"
        ) from exc
    return gguf


# ---------------------------------------------------------------------------
# metadata


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key/value of the file as plain Python values."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def model_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for the file's architecture."""
    arch = meta.get("general.architecture")
    if arch not in _ARCH_LAYER_NAMES:
        raise GGUFError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCH_LAYER_NAMES))})"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[name] = int(meta[f"tokenizer.ggml.{key}"])
    cfg.update(_chatml_end_of_text(meta, cfg.get("eos_token_id")))
    if arch == "llama":
        cfg.update(
            model_type="llama",
            rope_theta=float(get("rope.freq_base", 10000.0)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            attention_bias=False,
            mlp_bias=False,
        )
        if get("rope.scaling.type") not in (None, "none"):
            raise GGUFError(f"llama RoPE scaling {get('rope.scaling.type')!r} is not supported yet")
    elif arch == "qwen2":
        # llama.cpp's Qwen2 converter keeps HF's Q/K row order (no permute to undo),
        # writes rope_theta into the file, and an ``output.weight`` when untied.
        cfg.update(model_type="qwen2", rope_theta=float(get("rope.freq_base", 1_000_000.0)))
        if get("rope.scaling.type") not in (None, "none"):
            raise GGUFError(f"qwen2 RoPE scaling {get('rope.scaling.type')!r} is not supported yet")
    elif arch == "gemma3":
        head_dim = int(get("attention.key_length", 256))
        cfg.update(
            model_type="gemma3_text",
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 1_000_000.0)),
            sliding_window=int(get("attention.sliding_window", 512)),
            # Not in the file; llama.cpp hard-codes them for gemma3 (llama-model.cpp):
            # every 6th layer global, local RoPE base 10k, and queries scaled by
            # 1/sqrt(head_dim) for every size but 27B (which GGUF cannot tell apart
            # other than by its 62 layers).
            sliding_window_pattern=6,
            rope_local_base_freq=10_000.0,
            query_pre_attn_scalar=(hidden // heads) if int(get("block_count")) == 62 else head_dim,
        )
        if get("rope.scaling.type") not in (None, "none"):
            cfg["rope_scaling"] = {
                "rope_type": get("rope.scaling.type"),
                "factor": float(get("rope.scaling.factor", 1.0)),
            }
    return cfg


def _chatml_end_of_text(meta: dict[str, Any], eos: int | None) -> dict[str, Any]:
    """A ChatML model's stop tokens: ``<|im_end|>`` (the file's EOS) and
    ``<|endoftext|>``. A GGUF holds one EOS id, where the model's own
    generation_config.json lists both (Qwen2.5's: [151645, 151643]); an
    instruct model that writes ``<|endoftext|>`` has ended its answer, and
    without it the engine decodes past it (seen: Qwen2.5-Coder-1.5B under Codex
    answering on after it)."""
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    if eos is None or not 0 <= eos < len(tokens) or tokens[eos] != "<|im_end|>":
        return {}
    try:
        end = list(tokens).index("<|endoftext|>")
    except ValueError:
        return {}
    return {"eos_token_id": [eos, end]} if end != eos else {}


# ---------------------------------------------------------------------------
# tokenizer


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A transformers fast tokenizer from the file's ``tokenizer.*`` metadata,
    built by transformers' own GGUF builders (the code behind
    ``from_pretrained(..., gguf_file=...)``, whose file reader needs torch)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as exc:
        raise GGUFError(
            f"building a tokenizer from GGUF metadata needs transformers>=5 with GGUF support: {exc}"
        ) from exc
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    groups = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if tok_dict.get("tokenizer_type") == "llama":
        # as transformers' get_gguf_tokenizer: llama.cpp adds BOS to a sentencepiece vocabulary unless told not to
        tok_config.setdefault("add_bos_token", True)
    tokens = tok_dict["tokens"]
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            tok_config[name] = tokens[int(token_id)]
    try:
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)
    except ValueError as exc:
        raise GGUFError(str(exc)) from exc
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


# ---------------------------------------------------------------------------
# tensors


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (convert_hf_to_gguf.py,
    ``LlamaModel.permute``): ``reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``.
    Works on any array whose first axis is the output rows (weights, and the
    scales/biases of a quantized weight alike)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mlx_name(gguf_name: str, arch: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m:
        part = _ARCH_LAYER_NAMES[arch].get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
        if part is None:
            raise GGUFError(f"unknown tensor {gguf_name!r} for architecture {arch}")
        return f"model.layers.{m.group(1)}.{part}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise GGUFError(f"unknown tensor {gguf_name!r} for architecture {arch}")


def _fix(name: str, arr: Any, arch: str, cfg: dict[str, Any]) -> Any:
    """The per-architecture corrections, on numpy or mx arrays."""
    if arch == "llama" and name.startswith("blk.") and (".attn_q." in name or ".attn_k." in name):
        heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
        if isinstance(arr, np.ndarray):
            return unpermute_rope_rows(arr, heads)
        import mlx.core as mx

        rows = arr.shape[0]
        return mx.swapaxes(arr.reshape(heads, rows // heads // 2, 2, *arr.shape[1:]), 1, 2).reshape(arr.shape)
    if arch.startswith("gemma") and name.endswith("norm.weight"):
        return arr - 1
    return arr


def _float_tensors(reader: Any, arch: str, cfg: dict[str, Any], dtype: str, progress: bool) -> dict[str, Any]:
    import mlx.core as mx
    from gguf import GGMLQuantizationType, dequantize
    from tqdm import tqdm

    mx_dtype = getattr(mx, dtype)
    out: dict[str, Any] = {}
    for t in tqdm(reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress):
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims innermost first
        arr = _fix(t.name, arr, arch, cfg)
        out[mlx_name(t.name, arch)] = mx.array(arr).astype(mx_dtype)
    return out


def _quantized_tensors(
    path: pathlib.Path, arch: str, cfg: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The file's tensors as ``mx.load`` reads them (Q4_0/Q4_1/Q8_0 as MLX affine
    quantization), or None when it cannot read some of them."""
    import mlx.core as mx

    try:
        raw = cast(dict[str, Any], mx.load(str(path)))  # a .gguf loads as a dict of arrays
    except (RuntimeError, ValueError) as exc:
        log.info("[gguf] mx.load cannot read every tensor (%s); dequantizing instead", exc)
        return None
    out: dict[str, Any] = {}
    quant: dict[str, Any] = {"group_size": 32, "bits": 4}
    for name, arr in raw.items():
        gname = name.rsplit(".", 1)[0] + ".weight"  # scales/biases belong to the weight's tensor
        key = mlx_name(name, arch)
        out[key] = _fix(gname if name.endswith((".scales", ".biases")) else name, arr, arch, cfg)
        if name.endswith(".scales"):
            weight = raw[gname]
            bits = 32 * weight.shape[-1] // (arr.shape[-1] * 32)  # packed uint32 words per group of 32
            quant[key.rsplit(".", 1)[0]] = {"group_size": 32, "bits": int(bits)}
    for key, value in out.items():
        if mx.issubdtype(value.dtype, mx.floating) and not key.endswith((".scales", ".biases")):
            out[key] = value.astype(mx.float16)
    return out, quant


def requantize(
    weights: dict[str, Any], *, bits: int, group_size: int = REQUANT_GROUP
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every matrix of a linear layer or embedding as MLX affine quantization
    (``mx.quantize``), the norms and biases kept in float32: what
    ``mlx_lm.convert -q`` writes, from the GGUF's dequantized values (a K-quant
    or Q5_0 block has no MLX equivalent to keep). ``mlx_lm.load`` quantizes
    exactly the modules whose ``scales`` it finds."""
    import mlx.core as mx

    out: dict[str, Any] = {}
    for name, w in weights.items():
        if name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group_size == 0 and "norm" not in name:
            q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
            base = name[: -len(".weight")]
            out[name], out[f"{base}.scales"], out[f"{base}.biases"] = q, scales, biases
            mx.eval(q, scales, biases)
        else:
            out[name] = w
    return out, {"group_size": group_size, "bits": bits}


# ---------------------------------------------------------------------------
# the conversion


def convert(
    gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, dtype: str = "float32", progress: bool = True
) -> pathlib.Path:
    """Write an mlx-lm model directory for ``gguf_path`` at ``out_dir``."""
    gguf = _require_gguf()
    import mlx.core as mx

    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    path = pathlib.Path(gguf_path)
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
    meta = read_metadata(reader)
    arch = str(meta.get("general.architecture"))
    cfg = model_config(meta, {t.name for t in reader.tensors})
    tokenizer = build_tokenizer(meta)

    weights = None
    if dtype == "quantized":
        got = _quantized_tensors(path, arch, cfg)
        if got is not None:
            weights, cfg["quantization"] = got
    if weights is None:
        float_dtype = {"quantized": "float16", "q8": "float32", "q4": "float32"}.get(dtype, dtype)
        weights = _float_tensors(reader, arch, cfg, float_dtype, progress)
        if dtype in ("q8", "q4"):
            weights, cfg["quantization"] = requantize(weights, bits=int(dtype[1]))

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg["ember_gguf"] = {"source": path.name, "dtype": dtype, "converter": CONVERTER_VERSION}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(out))
    return out


def cache_root() -> pathlib.Path:
    return pathlib.Path(ember_cache_root()) / "gguf"


def file_key(path: pathlib.Path, dtype: str, block: int = 1 << 20) -> str:
    """Identity of a GGUF file for the cache: size plus its first and last MiB
    (the header, the metadata and a tail of the tensor data), the dtype and the
    converter version. Hashing every byte of a multi-GB file at each start
    would cost more than the conversion is worth saving."""
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{dtype}:{path.stat().st_size}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(block))
        fh.seek(max(0, path.stat().st_size - block))
        h.update(fh.read(block))
    return h.hexdigest()[:20]


def default_dtype(cpu: str | None = None) -> str:
    """``EMBER_WEIGHTS`` when set; else on MLX's CPU backend ``cpu`` (a packaged
    model's measured choice, docs/bench/weight-format.md) or float32 (measured
    fastest there for small models, docs/gguf.md); the file's own quantization
    elsewhere (Metal/CUDA have quantized kernels)."""
    import mlx.core as mx

    chosen = os.environ.get("EMBER_WEIGHTS", "").strip()
    if chosen and chosen != "auto":
        if chosen not in DTYPES:
            raise GGUFError(f"EMBER_WEIGHTS must be auto or one of {', '.join(DTYPES)}, not {chosen!r}")
        return chosen
    return (cpu or "float32") if mx.default_device() == mx.cpu else "quantized"


def cached_conversion(
    gguf_path: str | os.PathLike[str], dtype: str | None = None, *, root: pathlib.Path | None = None
) -> pathlib.Path:
    """The converted directory for ``gguf_path``, converting on first use."""
    given = pathlib.Path(gguf_path).expanduser()
    path = given.resolve()
    dtype = dtype or default_dtype()
    # named for the path given, not its target: a hub cache file is a link to a blob named by its sha256
    target = (root or cache_root()) / f"{given.stem}-{file_key(path, dtype)}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("[gguf] converting %s to %s (%s, once; later starts load the cached copy)", path, target, dtype)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert(path, tmp, dtype=dtype)
        try:
            os.rename(tmp, target)  # atomic: a crash mid-way leaves no half directory under the final name
        except OSError:
            if not (target / "config.json").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
