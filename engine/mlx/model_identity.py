"""What identifies a loaded mlx-lm model: the fingerprint of its computation
graph, a digest of its weights, a hash of its tokenizer, its context length.
The SSD tier keys its files by these (docs/cold-tier.md), and the CPU
calibration cache by the weights digest (``engine.mlx.calibration_cache``)."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

# config.json keys that describe the checkpoint, not the computation graph.
_METADATA_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "generation_config",
        "tokenizer_class",
    }
)
DEFAULT_CONTEXT = 4096


def config_fingerprint(config: dict[str, Any], kv_scheme: list[str]) -> str:
    graph = {k: v for k, v in config.items() if k not in _METADATA_KEYS}
    blob = json.dumps({"config": graph, "kv": kv_scheme}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_digest(path: pathlib.Path, block: int = 1 << 16) -> str:
    """A cheap identity of the weight files: names, sizes and three sampled blocks
    of each (start — the safetensors header —, middle, end). Retrained weights
    with an unchanged config must not reuse SSD entries made by the old ones,
    and hashing every byte of a multi-GB model at each start would be slow."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for at in (0, max(0, size // 2 - block // 2), max(0, size - block)):
                fh.seek(at)
                h.update(fh.read(block))
    return h.hexdigest()[:16]


def tokenizer_hash(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    names = (
        ["tokenizer.json"]
        if (path / "tokenizer.json").is_file()
        else sorted(p.name for p in path.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges", "spiece")))
    )
    for name in names:
        h.update(name.encode())
        h.update((path / name).read_bytes())
    return h.hexdigest()[:16]


def context_length(config: dict[str, Any], tokenizer: Any) -> int:
    for cfg in (config, config.get("text_config") or {}):
        n = cfg.get("max_position_embeddings")
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10_000_000 else DEFAULT_CONTEXT
