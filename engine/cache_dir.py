"""Ember's cache root: the one rule for where anything Ember writes on its own
lives (the SSD prompt-cache tier, GGUF conversions, the per-CPU calibration,
the C softmax kernel, ``ember launch``'s client configs)::

    $EMBER_CACHE_DIR                 (set)
    $XDG_CACHE_HOME/ember            (set)
    ~/.cache/ember

Each user names a sub-folder (``kv``, ``gguf``, ``cpu``, ``launch``); none
computes the root itself, so one variable moves all of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def cache_root(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    if env.get("EMBER_CACHE_DIR"):
        return env["EMBER_CACHE_DIR"]
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "ember")
