"""The fake GPU's KV cache: a numpy mirror of mlx_lm.models.cache.KVCache
(``(1, heads, capacity, head_dim)``, capacity in steps of 256, the same trim
semantics), so the cold tier persists and restores it like an MLX cache."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.kv.kvfile_codecs import LayerCodec, TensorSource, capacity, np_source, np_tensor, register_codec, slots_of
from engine.kv.kvfile_format import FakeKVLayer, Layer


class FakeKVCache:
    step = 256

    def __init__(self) -> None:
        # np.ndarray after the first update, None before: typed Any because the
        # per-token paths index them unguarded once a layer is known to hold rows
        self.keys: Any = None
        self.values: Any = None
        self.offset = 0

    def update(self, keys: np.ndarray, values: np.ndarray) -> None:
        prev, n = self.offset, keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            steps = (self.step + n - 1) // self.step
            shape_k = (1, keys.shape[1], steps * self.step, keys.shape[3])
            shape_v = (1, values.shape[1], steps * self.step, values.shape[3])
            new_k = np.zeros(shape_k, keys.dtype)
            new_v = np.zeros(shape_v, values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = np.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = np.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes in use (tokens up to ``offset``), not the step-padded capacity."""
        if self.keys is None:
            return 0
        per_token = self.keys[..., :1, :].nbytes + self.values[..., :1, :].nbytes
        return per_token * self.offset

    def copy(self) -> FakeKVCache:
        c = FakeKVCache()
        if self.keys is not None:
            c.keys = self.keys[..., : self.offset, :].copy()
            c.values = self.values[..., : self.offset, :].copy()
        c.offset = self.offset
        return c


# ---------------------------------------------------------------------------
# Its KV-file codec (``engine.kv.kvfile_codecs``), registered here so the
# neutral file format imports no backend: the cold tier persists and restores
# a fake cache like an MLX one, in numpy.


def _encode(layer: FakeKVCache) -> tuple[Layer, list[TensorSource]]:
    src = (
        []
        if layer.keys is None
        else [np_source(layer.keys[..., : layer.offset, :]), np_source(layer.values[..., : layer.offset, :])]
    )
    return FakeKVLayer(offset=layer.offset, tensors=slots_of(src)), src


def _decode(header: FakeKVLayer, bufs: list[Any]) -> FakeKVCache:
    layer = FakeKVCache()
    layer.offset = header.offset
    if header.tensors:
        arrays = []
        for buf, slot in zip(bufs, header.tensors):
            src = np_tensor(buf, slot)
            shape = list(src.shape)
            shape[-2] = capacity(header.offset)
            dst = np.zeros(shape, src.dtype)
            dst[..., : header.offset, :] = src
            arrays.append(dst)
        layer.keys, layer.values = arrays
    bufs.clear()
    return layer


register_codec(LayerCodec(FakeKVCache, FakeKVLayer, _encode, _decode, lambda layer: layer.nbytes))
