"""The SSD prompt-cache tier's folder and cap, decided in one place.

``resolve_ssd(config)`` is the one function: ``ember serve`` calls it on the
config its flags make, ``ember launch`` starts ``ember serve`` without a folder
of its own (so a launched session finds a served session's cache), the
embedded ``Engine.open`` calls it, and the registry (``ember/registry.py``)
reads its answer to place every other model's folder beside it
(``ember/ssd_folders.py``) under its one cap.

``ssd_cache_dir``:

- ``None``: no SSD tier (``EngineConfig``'s default: a library does not write
  to disk unasked; ``ember generate``; ``ember serve --no-ssd-cache``).
- ``"auto"`` (``ember serve``'s default; ``--ssd-cache auto``;
  ``EngineConfig(ssd_cache_dir="auto")`` for an embedded engine): one folder per
  model key under the KV root::

      $EMBER_KV_CACHE_DIR/<model-key>          (EMBER_KV_CACHE_DIR set: the test suite's temp dir)
      $EMBER_CACHE_DIR/kv/<model-key>          (EMBER_CACHE_DIR set)
      $XDG_CACHE_HOME/ember/kv/<model-key>     (XDG_CACHE_HOME set)
      ~/.cache/ember/kv/<model-key>

  and a cap of ``min(ssd_cache_max_gib, FREE_FRACTION x free space)`` of the
  filesystem that will hold it, measured once at start (``--ssd-cache-max``
  given to ``serve`` is taken as is). Too little free space, or no RAM tier
  (``prompt_cache_gib == 0``): the tier is off, and the note says so.
- a path: that folder, with ``ssd_cache_max_gib`` as its cap.

One folder per model key: the SSD layout already separates config
fingerprints, but inside one fingerprint folder the start-up scan deletes
every file written for another model id or tokenizer (docs/cold-tier.md, "SSD
layout"), so two fine-tunes of one architecture sharing a folder would wipe
each other's cache on every switch. The key is the model spec's readable tail
plus a hash of everything that changes the stored bytes (the resolved model,
the KV quantization and window).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from ember.ssd_folders import config_key, kv_root
from engine.config import SSD_AUTO, EngineConfig

GIB = 1024**3
DEFAULT_CAP_GIB = 32.0  # EngineConfig.ssd_cache_max_gib, the cap an explicit folder gets
FREE_FRACTION = 0.10  # never take more than a tenth of the free space
MIN_CAP_GIB = 0.25  # below this the tier is not worth its writes: it stays off
DEMOTE_IDLE_S = 300.0  # a RAM entry idle this long is demoted to SSD, unless told otherwise


def ssd_on(config: EngineConfig) -> bool:
    """Whether ``config`` (resolved) runs an SSD tier: a folder, and the RAM tier it spills from."""
    return bool(config.ssd_cache_dir) and config.ssd_cache_dir != SSD_AUTO and config.prompt_cache_gib > 0


def demote_idle_s(config: EngineConfig) -> float:
    """How long a RAM entry stays idle before it is demoted to SSD (``--ssd-demote-idle``)."""
    return DEMOTE_IDLE_S if config.ssd_demote_idle_s is None else config.ssd_demote_idle_s


def _free_bytes(path: str, disk_usage: Callable[[str], object]) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)  # the folder is created at start: measure its nearest existing parent
    return int(disk_usage(probe).free)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SsdDefault:
    dir: str
    cap_gib: float
    free_gib: float

    def describe(self) -> str:
        return f"SSD prompt cache {self.dir}, cap {self.cap_gib:.1f} GiB across every model served (free {self.free_gib:.0f} GiB; --no-ssd-cache turns it off)"


def default_ssd(
    config: EngineConfig,
    *,
    environ: Mapping[str, str] | None = None,
    disk_usage: Callable[[str], object] = shutil.disk_usage,
) -> SsdDefault | None:
    """The default folder and cap for ``config``'s model, or None when the disk has too little free space."""
    path = os.path.join(kv_root(environ), config_key(config))
    try:
        free = _free_bytes(path, disk_usage)
    except OSError:
        return None  # an unreadable cache dir: serve without the tier rather than fail to start
    cap = min(config.ssd_cache_max_gib, FREE_FRACTION * free / GIB)
    if cap < MIN_CAP_GIB:
        return None
    return SsdDefault(dir=path, cap_gib=round(cap, 2), free_gib=free / GIB)


def resolve_ssd(
    config: EngineConfig,
    *,
    cap_given: bool = False,
    environ: Mapping[str, str] | None = None,
    disk_usage: Callable[[str], object] = shutil.disk_usage,
) -> tuple[EngineConfig, str]:
    """``config`` with its SSD folder and cap decided (``"auto"`` made a folder
    or None), and the sentence the start line says about it. ``cap_given``: the
    cap was set by the user and is kept as is."""
    where = config.ssd_cache_dir
    if not where:
        return config, "SSD prompt cache off"
    if where != SSD_AUTO:
        return config, f"SSD prompt cache {where}, cap {config.ssd_cache_max_gib:g} GiB"
    if config.prompt_cache_gib == 0:  # the SSD tier needs the RAM tier: a default is no error
        return msgspec.structs.replace(config, ssd_cache_dir=None), "SSD prompt cache off"
    found = default_ssd(config, environ=environ, disk_usage=disk_usage)
    if found is None:
        off = msgspec.structs.replace(config, ssd_cache_dir=None)
        return off, "SSD prompt cache off (too little free disk space)"
    if cap_given:
        resolved = msgspec.structs.replace(config, ssd_cache_dir=found.dir)
        return resolved, f"SSD prompt cache {found.dir}, cap {config.ssd_cache_max_gib:g} GiB"
    resolved = msgspec.structs.replace(config, ssd_cache_dir=found.dir, ssd_cache_max_gib=found.cap_gib)
    return resolved, found.describe()
