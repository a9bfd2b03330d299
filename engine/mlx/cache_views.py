"""Views of an mlx-lm prompt cache that take no copy: the first ``n`` tokens of
a cache (``prefix_view``, ``CachePrefix``) and a snapshot that shares the
entry's own arrays (``snapshot_cache``), plus per-layer byte counts."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
)


@dataclass(frozen=True)
class CachePrefix:
    """The first ``n`` positions of a stored cache, as ``PromptCache.take``
    hands them out on the event loop: the slices are cut by ``prefix_view``
    when the row opens on the MLX thread (MLX's streams belong to the thread
    that made them; an op built on the loop cannot run on the MLX thread)."""

    cache: list[Any]
    n: int


def prefix_view(cache: list[Any], n: int) -> list[Any]:
    """A private cache of the first ``n`` positions of a stored one, with
    nothing copied or evaluated yet. Each ``KVCache`` gets lazy slices of the stored arrays;
    the row's first forward on the MLX thread copies them as it writes
    (MLX never writes into a buffer another array still holds, so the
    stored entry stays as it was; tested). The copy the prompt cache used
    to take evaluated the whole entry on the loop and then trimmed it: 7-17 ms
    for an 8k-token entry of the bundled model, a stall of every stream on
    every hit, however few of its tokens the hit reused. Other cache kinds
    are copied whole and trimmed to ``n``."""
    out: list[Any] = []
    for c in cache:
        if type(c) is KVCache:
            view = KVCache()
            if c.keys is not None and n > 0:
                if n > c.offset:
                    raise ValueError(f"the cache holds {c.offset} tokens, not {n}")
                view.keys, view.values, view.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            out.append(view)
            continue
        if type(c) is QuantizedKVCache:  # --kv-bits: the same lazy slices, of each quantized triple
            out.append(_quantized_view(c, n))
            continue
        c = copy.deepcopy(c)
        size = getattr(c, "offset", None)
        if isinstance(size, int) and size != n and (size < n or not c.is_trimmable() or c.trim(size - n) != size - n):
            raise ValueError(f"a {type(c).__name__} holding {size} tokens cannot serve {n}")
        out.append(c)
    return out


def _quantized_view(c: QuantizedKVCache, n: int) -> QuantizedKVCache:
    view = QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if c.keys is not None and n > 0:
        if n > c.offset:
            raise ValueError(f"the cache holds {c.offset} tokens, not {n}")
        view.keys = tuple(x[..., :n, :] for x in c.keys)
        view.values = tuple(x[..., :n, :] for x in c.values)
        view.offset = n
    return view


def layer_nbytes(c: Any) -> int:
    """Bytes of one layer's tokens in use. A rotating window holds at most its
    buffer, however many tokens went through it (its ``offset``): counting
    ``offset`` tokens overcounted sliding-window layers (1.46x on the tiny
    gemma3, ~5x for a real one at 32k tokens)."""
    if type(c) is CacheList:
        return sum(layer_nbytes(sub) for sub in c.caches)
    keys, offset = getattr(c, "keys", None), getattr(c, "offset", None)
    if type(c) is QuantizedKVCache and keys is not None:
        return sum(x.nbytes // x.shape[2] for x in (*keys, *c.values)) * offset
    if isinstance(keys, mx.array) and isinstance(offset, int) and keys.shape[2]:
        values = c.values
        held = min(offset, keys.shape[2])
        return (keys.nbytes // keys.shape[2] + values.nbytes // values.shape[2]) * held
    return c.nbytes


def snapshot_cache(cache: list[Any]) -> list[Any]:
    """A private copy of a row's cache as it stands, for a checkpoint entry:
    plain KV layers as lazy slices of the tokens in use (nothing copied: the
    row's next write makes its own buffer, see ``prefix_view``), every other
    kind (rotating windows, SSM state, lists) a deep copy, which is bounded
    by the window or the state size, not by the prompt."""
    out: list[Any] = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            view = KVCache()
            view.keys, view.values, view.offset = c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset
            out.append(view)
        elif type(c) is QuantizedKVCache:
            out.append(_quantized_view(c, c.offset))
        else:
            out.append(copy.deepcopy(c))
    return out
