"""MLX's CPU buffer cache, sized so attention's score matrices are reused.

MLX's CPU allocator keeps freed buffers for reuse only up to a cache limit of
32 MB (``mlx/backend/no_gpu/allocator.cpp``). A long prefill's score matrix
is bigger than that (heads × new tokens × context × 4 bytes: 77 MB for
SmolLM2's 9 heads, 500 new tokens over 4.3k keys), so every attention call
got fresh pages from the kernel and paid a page fault per 4 KiB on first
touch: on this machine a QK^T over those shapes took 2.3x as long at the
default limit as with a 2 GiB one, and an add over its output 7.1x
(``python -m bench.cpu.buffer_cache``; docs/bench/cpu-attention.md). The cache is only what MLX holds
between calls, freed at ``mx.clear_cache()``; ``raise_limit`` sets it to
``min(2 GiB, RAM / 8)`` on MLX's CPU backend (``EMBER_MLX_CACHE_MIB``
overrides; 0 keeps MLX's) and never lowers a limit already set higher.
"""

from __future__ import annotations

import os

import mlx.core as mx

DEFAULT_CAP = 2 << 30


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def wanted(environ: dict[str, str] | None = None, ram: int | None = None) -> int | None:
    """The limit to set, in bytes; None to leave MLX's."""
    env = os.environ if environ is None else environ
    raw = env.get("EMBER_MLX_CACHE_MIB")
    if raw is not None:
        try:
            mib = int(raw)
        except ValueError:
            mib = -1
        if mib >= 0:
            return None if mib == 0 else mib << 20
    return min(DEFAULT_CAP, (ram if ram is not None else _ram_bytes()) // 8)


def raise_limit() -> int:
    """On MLX's CPU backend, raise the buffer cache's limit to ``wanted()``;
    returns the limit in force after (bytes), or 0 where nothing was changed."""
    if mx.default_device() != mx.cpu:
        return 0  # Metal and CUDA size their own caches from the device's memory
    want = wanted()
    if want is None:
        return 0
    before = mx.set_cache_limit(want)
    if before > want:  # someone asked for more already: keep theirs
        mx.set_cache_limit(before)
        return before
    return want
