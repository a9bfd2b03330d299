"""LoRA adapters as served (issue #43): what ``--adapter NAME=PATH`` names.

An adapter is mlx-lm's format (``mlx_lm.lora`` writes it, ``mlx_lm.tuner.utils.
load_adapters`` reads it): a directory with ``adapter_config.json`` and
``adapters.safetensors``. Its id is ``NAME@HASH``, the hash over both files'
bytes, and it is the adapter part of every request's cache namespace
(``engine.kv.namespace``): replacing the files changes the id, so the prompt
cache's tiers never serve KV computed with the old weights, across a restart
too. Nothing here imports MLX; ``engine.mlx.lora`` applies the weights.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import msgspec

__all__ = ["AdapterSpec", "read_adapter", "parse_adapter_flag", "content_hash", "ADAPTER_NAME"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"
# A name is a namespace part's value without "@" (which joins it to the hash)
# and without ":" (BASE:NAME picks an adapter of a named base model).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_.+=-]{1,64}")


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str  # what a request's ``model`` names (NAME or BASE:NAME)
    path: str  # the adapter directory
    id: str  # NAME@HASH: the cache namespace's adapter part


def content_hash(path: pathlib.Path) -> str:
    """sha256 over the config's and the weights' bytes (16 hex digits)."""
    h = hashlib.sha256()
    for part in (CONFIG, WEIGHTS):
        data = (path / part).read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def read_config(path: pathlib.Path) -> dict:
    """The adapter's config, checked for what ``engine.mlx.lora`` serves: LoRA
    (not DoRA, not a full fine-tune) with a ``scale``."""
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"adapter {path}: cannot read {CONFIG}: {exc}") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"adapter {path}: fine_tune_type {kind!r} is not served (only lora)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), (int, float)):
        raise ValueError(f"adapter {path}: {CONFIG} needs lora_parameters.scale (mlx-lm's format)")
    return config


def read_adapter(name: str, path: str) -> AdapterSpec:
    """An adapter directory, checked, with its content id; ValueError says what is wrong."""
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} must match {ADAPTER_NAME.pattern}")
    folder = pathlib.Path(path).expanduser()
    for part in (CONFIG, WEIGHTS):
        if not (folder / part).is_file():
            raise ValueError(f"adapter {name!r}: no {part} in {folder} (mlx-lm's adapter format)")
    read_config(folder)
    return AdapterSpec(name=name, path=str(folder.resolve()), id=f"{name}@{content_hash(folder)}")


def parse_adapter_flag(value: str) -> tuple[str, str]:
    """``NAME=PATH`` → (NAME, PATH)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter takes NAME=PATH, got {value!r}")
    return name, path
