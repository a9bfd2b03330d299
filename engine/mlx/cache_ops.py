"""A row's cache on the MLX backend: made (``make_cache``, ``--max-kv-size``),
quantized (``--kv-bits``, refused at load where the group size does not divide
a head), measured, trimmed, and opened from what ``OpenRow`` carried (a
``CachePrefix`` of a RAM-tier entry is cut on the MLX thread). Part of
``MLXBackend`` (``engine.mlx.backend``); it reads only the model and the KV
options."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from engine.errors import InvalidRequest
from engine.mlx.cache_views import CachePrefix, layer_nbytes, prefix_view
from engine.mlx.state import BackendState


class CacheOps(BackendState):
    """``engine.ports.Backend``'s cache operations, on the MLX thread."""

    def make_cache(self) -> list[Any]:
        """A fresh cache for one row: mlx-lm's (the model's own ``make_cache``, or
        plain KV), with every plain KV layer a sliding window of ``max_kv_size``
        tokens when that is set. That is mlx-lm's ``--max-kv-size`` with two
        differences: no ``keep`` (mlx-lm's batch rotating cache has no attention
        sinks, and a row must compute the same batched or alone), and it also
        applies to models that make their own cache (mlx-lm 0.32 ignores it for
        those, llama included)."""
        cache = make_prompt_cache(self.model)
        if self.max_kv_size:
            cache = [RotatingKVCache(max_size=self.max_kv_size, keep=0) if type(c) is KVCache else c for c in cache]
        return cache

    def _check_kv_groups(self, bits: int, group_size: int) -> None:
        """Refuse ``--kv-bits`` at load when a KV layer's head dimension is not a
        multiple of the group size: ``mx.quantize`` would raise on the first
        request (engine_dead) instead. The dimensions come from a one-token
        forward, so every architecture's layout (MLA, differing K and V) is seen."""
        cache = self.make_cache()
        self.model(mx.array([[0]]), cache=cache)
        dims = sorted(
            {int(x.shape[-1]) for c in cache if type(c) is KVCache and c.keys is not None for x in (c.keys, c.values)}
        )
        bad = [d for d in dims if d % group_size]
        if bad:
            fits = [g for g in (128, 64, 32) if all(d % g == 0 for d in dims)]
            hint = (
                f"; --kv-group-size {fits[0]} divides it" if fits else "; no --kv-group-size (32, 64, 128) divides it"
            )
            raise InvalidRequest(
                f"--kv-bits {bits} cannot quantize this model's KV cache: its head dimension {bad[0]} is not a "
                f"multiple of --kv-group-size {group_size}{hint}",
                "kv_group_size",
            )

    def _quantize(self, cache: list[Any]) -> None:
        """``--kv-bits``: plain KV layers become ``QuantizedKVCache`` once they hold
        tokens, as ``mlx_lm.generate_step`` does after each forward with
        ``quantized_kv_start=0`` (the first chunk attends to itself unquantized)."""
        if not self.kv_bits:
            return
        for i, c in enumerate(cache):
            if type(c) is KVCache and c.keys is not None:
                cache[i] = c.to_quantized(group_size=self.kv_group_size, bits=self.kv_bits)

    def cache_nbytes(self, cache: list[Any]) -> int:
        """Bytes of the tokens in use; mlx-lm's ``nbytes`` counts the 256-step capacity."""
        return sum(layer_nbytes(c) for c in cache)

    def prefix_view(self, cache: list[Any], n: int) -> CachePrefix:
        """Called on the event loop: checks the length, defers the slicing to ``_open``."""
        held = [c.offset for c in cache if type(c) is KVCache and c.keys is not None]
        if any(h < n for h in held):
            raise ValueError(f"the cache holds {min(held)} tokens, not {n}")
        return CachePrefix(cache, n)

    def trim_cache(self, cache: list[Any], n: int) -> int:
        return trim_prompt_cache(cache, n)

    def cache_trimmable(self, cache: list[Any]) -> bool:
        return can_trim_prompt_cache(cache)

    @staticmethod
    def _open_cache(cache: Any, n: int) -> list[Any]:
        """A row's private cache of ``n`` tokens from what ``OpenRow`` carried:
        a ``CachePrefix`` of a RAM-tier entry is cut here (``prefix_view``), a
        cache holding more tokens trimmed; raises when it cannot serve ``n``."""
        if isinstance(cache, CachePrefix):
            cache = prefix_view(cache.cache, cache.n)
        size = getattr(cache[0], "offset", None)
        if isinstance(size, int) and size != n:
            if size < n or not can_trim_prompt_cache(cache):
                raise ValueError(f"prefix cache holds {size} tokens, not {n}")
            trim_prompt_cache(cache, size - n)
        return cast(list[Any], cache)
