"""Where ``ember serve`` keeps its SSD prompt-cache tier when no flag says.

The SSD tier is on by default for ``ember serve`` (issue #32: the restart turn of
an agent session is 9.4x faster with it, and a new user does not know the flag).
The directory is under the user's cache dir, the same root the GGUF conversions
and the CPU calibration use::

    $EMBER_KV_CACHE_DIR/<model-key>          (EMBER_KV_CACHE_DIR set: the test suite's temp dir)
    $EMBER_CACHE_DIR/kv/<model-key>          (EMBER_CACHE_DIR set)
    $XDG_CACHE_HOME/ember/kv/<model-key>     (XDG_CACHE_HOME set)
    ~/.cache/ember/kv/<model-key>

One folder per model key: the SSD layout already separates config
fingerprints, but inside one fingerprint folder the start-up scan deletes
every file written for another model id or tokenizer (docs/cold-tier.md, "SSD
layout"), so two fine-tunes of one architecture sharing a folder would wipe
each other's cache on every switch. The key is the model spec's readable tail plus a
hash of everything that changes the stored bytes (the resolved model, the KV
quantization and window).

The byte cap is ``min(DEFAULT_CAP_GIB, FREE_FRACTION x free space)`` of the
filesystem that will hold the folder, measured once at start and stated in the
``ember: serving ...`` line; ``--ssd-cache-max`` overrides it. The embedded
``Engine``/``EngineConfig`` default stays off: a library does not write to disk
unasked.

Many models (``ember/registry.py``): each model loaded beside ``--model`` gets
its own ``<kv root>/<model-key>`` folder (``ember/ssd_folders.py``), and the one
cap stated here covers all of them (``engine/kv/budget.py``): a second model
does not bring a second cap.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ember.ssd_folders import cache_root, kv_root, model_key

__all__ = ["SsdDefault", "cache_root", "default_ssd", "kv_root", "model_key"]

GIB = 1024**3
DEFAULT_CAP_GIB = 32.0  # EngineConfig.ssd_cache_max_gib, the cap an explicit --ssd-cache gets
FREE_FRACTION = 0.10  # never take more than a tenth of the free space
MIN_CAP_GIB = 0.25  # below this the tier is not worth its writes: it stays off


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
    model: str,
    *,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    window: int | None = None,
    environ: Mapping[str, str] | None = None,
    disk_usage: Callable[[str], object] = shutil.disk_usage,
) -> SsdDefault | None:
    """The default SSD tier for ``model``, or None when the disk has too little free space."""
    path = os.path.join(kv_root(environ), model_key(model, kv_bits=kv_bits, kv_group_size=kv_group_size, window=window))
    try:
        free = _free_bytes(path, disk_usage)
    except OSError:
        return None  # an unreadable cache dir: serve without the tier rather than fail to start
    cap = min(DEFAULT_CAP_GIB, FREE_FRACTION * free / GIB)
    if cap < MIN_CAP_GIB:
        return None
    return SsdDefault(dir=path, cap_gib=round(cap, 2), free_gib=free / GIB)
