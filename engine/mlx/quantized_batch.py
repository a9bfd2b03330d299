"""A batch cache for mlx-lm's ``QuantizedKVCache`` (``--kv-bits``).

mlx-lm has batch caches for plain KV (``BatchKVCache``), rotating windows and
SSM state, but none for quantized KV, which is why ``mlx_lm.server`` turns
batching off under ``--kv-bits``. This is ``BatchKVCache`` with each of keys
and values held as mlx's quantized triple (packed uint32, scales, biases), so
rows of a quantized cache join the persistent decode batch like any other:
``merge``/``extend``/``extract``/``filter``, right padding through
``prepare``/``finalize``, ``trim``. Attention goes through mlx-lm's own
quantized path (``scaled_dot_product_attention`` dispatches on ``bits``), with
``BatchKVCache``'s left-padding mask.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import (
    QuantizedKVCache,
    _BaseCache,
    create_causal_mask,
    dynamic_roll,
)

Triple = tuple[mx.array, mx.array, mx.array]


def _map(fn: Any, t: Triple) -> Triple:
    return tuple(fn(x) for x in t)  # type: ignore[return-value]


class BatchQuantizedKVCache(_BaseCache):
    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys: Triple | None = None
        self.values: Triple | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Triple, Triple]:
        B, H, S, Dk = keys.shape
        Dv = values.shape[-1]
        prev = self._idx
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            per_int = 8 * mx.uint32.size // self.bits
            steps = (self.step + S - 1) // self.step * self.step

            def fresh(dim: int) -> Triple:
                shape = (B, H, steps)
                return (
                    mx.zeros((*shape, dim // per_int), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                )

            if self.keys is None:
                self.keys, self.values = fresh(Dk), fresh(Dv)
            else:

                def grow(x: mx.array) -> mx.array:
                    x = x[..., :prev, :]
                    return mx.concatenate([x, mx.zeros((*x.shape[:2], steps, x.shape[3]), dtype=x.dtype)], axis=2)

                self.keys, self.values = _map(grow, self.keys), _map(grow, self.values)
        self.offset = self.offset + S
        self._idx += S
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        idx = self._idx
        return _map(lambda x: x[..., :idx, :], self.keys), _map(lambda x: x[..., :idx, :], self.values)

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKVCache")
            lp = mx.array(left_padding)
            self.left_padding += lp
            self.offset = self.offset - lp
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys = _map(lambda x: dynamic_roll(x, pad[:, None], axis=2), self.keys)
            self.values = _map(lambda x: dynamic_roll(x, pad[:, None], axis=2), self.values)
            self.offset = self.offset - pad
            self.left_padding += pad
            self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: Any) -> None:
        if self.keys is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other

        def padded(c: BatchQuantizedKVCache) -> tuple[Triple, Triple, mx.array, mx.array]:
            left = idx - c._idx
            if c.keys is None:
                b = c.offset.shape[0]

                def empty(t: Triple) -> Triple:
                    return _map(lambda x: mx.zeros((b, x.shape[1], 0, x.shape[3]), x.dtype), t)

                k, v = empty(ref.keys), empty(ref.values)
            else:
                k = _map(lambda x: x[..., : c._idx, :], c.keys)
                v = _map(lambda x: x[..., : c._idx, :], c.values)
            if left:
                pad = [(0, 0), (0, 0), (left, 0), (0, 0)]
                k, v = _map(lambda x: mx.pad(x, pad), k), _map(lambda x: mx.pad(x, pad), v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, l1), (k2, v2, o2, l2) = padded(self), padded(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))  # type: ignore[assignment]
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))  # type: ignore[assignment]
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([l1, l2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = self.left_padding.tolist()[idx]
        cache.keys = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), self.keys)
        cache.values = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), self.values)
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedKVCache]) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, group_size=first.group_size, bits=first.bits)
        if longest == 0:
            return out
        ref = next(c for c in caches if c.keys is not None)

        def stack(part: str) -> Triple:
            comps = []
            for j, x in enumerate(getattr(ref, part)):
                buf = mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), x.dtype)
                for i, (p, n, c) in enumerate(zip(padding, lengths, caches)):
                    if n:
                        buf[i : i + 1, :, p : p + n] = getattr(c, part)[j][..., :n, :]
                comps.append(buf)
            return tuple(comps)  # type: ignore[return-value]

        out.keys, out.values = stack("keys"), stack("values")
        out.offset = out.offset + longest
        out._idx = longest
        return out

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))
