"""Where each model's SSD prompt-cache files live (the folder names, no I/O).

``ember serve``'s default tier is one folder per model key under the KV root
(``ember/ssd_tier.py``): ``<kv root>/<model-key>``. A server that holds
many models (``ember/registry.py``) gives every model its own folder the same
way, so a model's cache is in one place whether it is ``--model`` or loaded on
demand, and two models whose configs share a fingerprint (two fine-tunes of one
architecture) never share a folder: the start-up scan deletes the files a
folder holds for another model id (docs/cold-tier.md, "SSD layout"). One byte
cap covers all of them (``engine.kv.budget.SsdBudget``).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping

from engine.cache_dir import cache_root
from engine.config import EngineConfig
from engine.models import hub


def kv_root(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get("EMBER_KV_CACHE_DIR") or os.path.join(cache_root(env), "kv")


def model_key(
    model: str, *, kv_bits: int | None = None, kv_group_size: int | None = None, window: int | None = None
) -> str:
    """A folder name for one model and KV layout: readable, and distinct per layout."""
    spec = model
    if os.sep in model or model.startswith("."):
        spec = os.path.abspath(os.path.expanduser(model))
        if not os.path.exists(spec) and hub.parse(model) is not None:
            spec = model  # a hub name (ORG/NAME): one folder whatever the working directory
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(spec.rstrip(os.sep)) or "model")[:48]
    if kv_group_size == 64:  # the default group size names the same layout as no flag at all
        kv_group_size = None
    digest = hashlib.sha256(repr((spec, kv_bits, kv_group_size, window)).encode()).hexdigest()[:10]
    return f"{tail}-{digest}"


def config_key(config: EngineConfig) -> str:
    return model_key(
        config.model, kv_bits=config.kv_bits, kv_group_size=config.kv_group_size, window=config.max_kv_size
    )


def model_ssd_dir(base: EngineConfig, model: EngineConfig) -> str | None:
    """The SSD folder of ``model``, a model served beside ``base`` (``--model``):
    a sibling of ``base``'s folder when that is the default layout
    (``<kv root>/<model-key>``), else a ``<model-key>`` folder inside
    ``--ssd-cache DIR`` (the default model's files sit in ``DIR`` itself, in
    16-hex fingerprint folders, which no model key can be named)."""
    if not base.ssd_cache_dir:
        return None
    own = os.path.abspath(os.path.expanduser(base.ssd_cache_dir))
    key = config_key(model)
    if os.path.basename(own) == config_key(base):
        return os.path.join(os.path.dirname(own), key)
    return os.path.join(own, key)
