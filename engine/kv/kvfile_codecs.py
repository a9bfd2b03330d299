"""Cache objects to KV-file layers and back, one codec per layer kind: mlx-lm's
``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``, ``ArraysCache`` (SSM
state) and ``CacheList``; kinds owned elsewhere (the fake GPU's numpy cache)
register their own codec (``register_codec``), so this module imports no
backend. Encoding runs on the device: a layer's header now, its tensor bytes
when each ``TensorSource.materialize`` runs; decoding builds fresh cache
objects from the bytes read, one tensor materialized at a time.

Tensor bytes are the array's raw memory, so bf16 round-trips bit-exactly
(numpy has no bf16: MLX arrays travel as an unsigned carrier of the same width
via ``mx.array.view``); plain KV lands in 256-step capacity with at least one
free slot, so the first decode step updates in place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.kv.kvfile_format import (
    STEP,
    ArraysLayer,
    CorruptFile,
    KVLayer,
    Layer,
    ListLayer,
    QuantizedLayer,
    RotatingLayer,
    TensorSlot,
    UnsupportedCache,
)


@dataclass(slots=True)
class TensorSource:
    """One tensor to write: its geometry now, its bytes when ``materialize`` runs."""

    shape: list[int]
    dtype: str
    nbytes: int
    materialize: Callable[[], memoryview]


@dataclass(frozen=True, slots=True)
class LayerCodec:
    """A cache kind owned outside mlx-lm, and how it goes to its header layer and back."""

    kind: type  # the cache object's class
    layer: type  # its header struct (one of ``Layer``)
    encode: Callable[[Any], tuple[Layer, list[TensorSource]]]
    decode: Callable[[Any, list[Any]], Any]  # (header layer, its tensors' bytes) -> a fresh cache layer
    nbytes: Callable[[Any], int]  # bytes of the tokens in use, with no array op


# Registered by their owners on import (``engine.fake.kv_cache``): a process
# holds such a cache only after importing the module that defines it.
_BY_KIND: dict[type, LayerCodec] = {}
_BY_LAYER: dict[type, LayerCodec] = {}


def register_codec(codec: LayerCodec) -> None:
    _BY_KIND[codec.kind] = codec
    _BY_LAYER[codec.layer] = codec


def _mx():
    import mlx.core as mx

    return mx


def _mlx_cache_classes():
    from mlx_lm.models import cache as c

    return c


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


_CARRIERS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _mx_source(x: Any) -> TensorSource:
    mx = _mx()
    size = x.dtype.size
    carrier = getattr(mx, _CARRIERS[size])

    def materialize() -> memoryview:
        # view, not astype: the raw bits travel (bf16 has no numpy dtype)
        return np.ascontiguousarray(np.asarray(x.view(carrier))).data.cast("B")

    return TensorSource(list(x.shape), _dtype_name(x.dtype), x.size * size, materialize)


def np_source(x: np.ndarray) -> TensorSource:
    """A numpy tensor to write (the fake GPU's caches)."""
    return TensorSource(list(x.shape), x.dtype.name, int(x.nbytes), lambda: np.ascontiguousarray(x).data.cast("B"))


def slots_of(sources: list[TensorSource]) -> list[TensorSlot]:
    return [TensorSlot(off=0, bytes=s.nbytes, shape=s.shape, dtype=s.dtype) for s in sources]


# ---------------------------------------------------------------------------
# Cache objects → header layers + tensor sources (runs on the device).


def _encode_kv(layer: Any) -> tuple[Layer, list[TensorSource]]:
    src = (
        []
        if layer.keys is None
        else [_mx_source(layer.keys[..., : layer.offset, :]), _mx_source(layer.values[..., : layer.offset, :])]
    )
    return KVLayer(offset=layer.offset, tensors=slots_of(src)), src


def _encode_rotating(layer: Any) -> tuple[Layer, list[TensorSource]]:
    src = [] if layer.keys is None else [_mx_source(layer.keys), _mx_source(layer.values)]
    return (
        RotatingLayer(
            offset=layer.offset, keep=layer.keep, max_size=layer.max_size, idx=layer._idx, tensors=slots_of(src)
        ),
        src,
    )


def _encode_quantized(layer: Any) -> tuple[Layer, list[TensorSource]]:
    src = []
    if layer.keys is not None:
        # Quantization groups run along head_dim, so a token-axis cut never splits one.
        src = [_mx_source(t[..., : layer.offset, :]) for t in (*layer.keys, *layer.values)]
    return QuantizedLayer(offset=layer.offset, group_size=layer.group_size, bits=layer.bits, tensors=slots_of(src)), src


def _encode_arrays(layer: Any) -> tuple[Layer, list[TensorSource]]:
    if layer.left_padding is not None or layer.lengths is not None:
        raise UnsupportedCache("ArraysCache with batch padding state (a batched cache, not a prompt entry)")
    src: list[TensorSource] = []
    slots: list[int] = []
    for a in layer.cache:
        slots.append(-1 if a is None else len(src))
        if a is not None:
            src.append(_mx_source(a))
    return ArraysLayer(slots=slots, tensors=slots_of(src)), src


def _encode_list(layer: Any) -> tuple[Layer, list[TensorSource]]:
    c = _mlx_cache_classes()
    parts: list[Any] = []  # the part kinds ListLayer allows (a nested CacheList is refused below)
    counts: list[int] = []
    part_slots: list[TensorSlot] = []
    src = []
    for sub in layer.caches:
        if type(sub) is c.CacheList:
            raise UnsupportedCache("a CacheList inside a CacheList")
        h, s = encode_layer(sub)
        counts.append(len(h.tensors))
        part_slots.extend(h.tensors)
        h.tensors = []
        parts.append(h)
        src.extend(s)
    return ListLayer(parts=parts, counts=counts, tensors=part_slots), src


def encode_layer(layer: Any) -> tuple[Layer, list[TensorSource]]:
    """Describe one cache layer; tensors are sliced to the tokens in use."""
    kind = type(layer)
    own = _BY_KIND.get(kind)
    if own is not None:
        return own.encode(layer)
    c = _mlx_cache_classes()
    encode = {
        c.KVCache: _encode_kv,
        c.RotatingKVCache: _encode_rotating,
        c.QuantizedKVCache: _encode_quantized,
        c.ArraysCache: _encode_arrays,
        c.CacheList: _encode_list,
    }.get(kind)
    if encode is None:
        raise UnsupportedCache(f"cannot persist a {kind.__module__}.{kind.__name__}")
    return encode(layer)


def encode_layers(cache: Sequence[Any]) -> tuple[list[Layer], list[TensorSource]]:
    layers: list[Layer] = []
    sources: list[TensorSource] = []
    for layer in cache:
        h, s = encode_layer(layer)
        layers.append(h)
        sources.extend(s)
    return layers, sources


def cache_bytes(cache: Sequence[Any]) -> int:
    """Bytes of the tokens in use (what a file holds), not the 256-step buffer.

    No array op is issued: the per-token size comes from the buffer's shape.
    """
    total = 0
    for layer in cache:
        own = _BY_KIND.get(type(layer))
        if own is not None:
            total += own.nbytes(layer)
            continue
        h, _ = encode_layer(layer)
        total += sum(t.bytes for t in h.tensors)
    return total


# ---------------------------------------------------------------------------
# Bytes → fresh cache objects (runs on the device).


def capacity(offset: int) -> int:
    return (offset // STEP + 1) * STEP  # ≥ 1 free slot: the next update needs no concat


def np_tensor(buf: Any, slot: TensorSlot) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.dtype(slot.dtype)).reshape(slot.shape)


def _mx_tensor(buf: Any, slot: TensorSlot) -> Any:
    mx = _mx()
    target = getattr(mx, slot.dtype, None)
    if not isinstance(target, mx.Dtype):
        raise CorruptFile(f"unknown dtype {slot.dtype!r}")
    carrier = np.dtype(_CARRIERS[target.size])
    return mx.array(np.frombuffer(buf, dtype=carrier)).view(target).reshape(slot.shape)


def _pad_tokens_mx(x: Any, offset: int) -> Any:
    mx = _mx()
    shape = list(x.shape)
    shape[-2] = capacity(offset) - offset
    return mx.concatenate([x, mx.zeros(shape, dtype=x.dtype)], axis=-2)


def _decode_list(header: ListLayer, bufs: list[Any]) -> Any:
    c = _mlx_cache_classes()
    if (
        len(header.counts) != len(header.parts)
        or sum(header.counts) != len(header.tensors)
        or min(header.counts, default=0) < 0
    ):
        raise CorruptFile("a CacheList's parts do not add up to its tensors")
    subs, at = [], 0
    for part, n in zip(header.parts, header.counts):
        part.tensors = header.tensors[at : at + n]  # this part's slots (shape, dtype)
        subs.append(decode_layer(part, bufs[at : at + n]))
        at += n
    bufs.clear()
    return c.CacheList(*subs)


def _decode_kv(c: Any, header: Any, out: list[Any]) -> Any:
    layer = c.KVCache()
    if out:
        layer.keys, layer.values = out
    layer.offset = header.offset
    return layer


def _decode_rotating(c: Any, header: Any, out: list[Any]) -> Any:
    layer = c.RotatingKVCache(max_size=header.max_size, keep=header.keep)
    if out:
        layer.keys, layer.values = out
    layer.offset, layer._idx = header.offset, header.idx
    return layer


def _decode_quantized(c: Any, header: Any, out: list[Any]) -> Any:
    layer = c.QuantizedKVCache(group_size=header.group_size, bits=header.bits)
    if out:
        layer.keys, layer.values = tuple(out[:3]), tuple(out[3:])
    layer.offset = header.offset
    return layer


def _decode_arrays(c: Any, header: Any, out: list[Any]) -> Any:
    layer = c.ArraysCache(len(header.slots))
    for j, t in enumerate(header.slots):
        layer.cache[j] = None if t < 0 else out[t]
    return layer


# the mlx-lm kinds whose tensors are built as MLX arrays, then the layer around them
_DECODERS: dict[type, Callable[[Any, Any, list[Any]], Any]] = {
    KVLayer: _decode_kv,
    RotatingLayer: _decode_rotating,
    QuantizedLayer: _decode_quantized,
    ArraysLayer: _decode_arrays,
}


def decode_layer(header: Layer, bufs: list[Any]) -> Any:
    """Build one fresh cache layer from its tensors' bytes (consumes ``bufs``)."""
    if len(bufs) != len(header.tensors):
        raise CorruptFile("tensor count does not match the header")
    own = _BY_LAYER.get(type(header))
    if own is not None:
        return own.decode(header, bufs)
    c = _mlx_cache_classes()
    if isinstance(header, ListLayer):
        return _decode_list(header, bufs)
    build = _DECODERS.get(type(header))
    if build is None:  # a kind whose owner never registered its codec in this process
        raise UnsupportedCache(f"unknown layer kind {type(header).__name__}")
    mx = _mx()
    out: list[Any] = []
    for i, slot in enumerate(header.tensors):
        x = _mx_tensor(bufs[i], slot)
        if isinstance(header, (KVLayer, QuantizedLayer)):
            x = _pad_tokens_mx(x, header.offset)
        mx.eval(x)  # materialize now, so the file bytes can go: peak = entry + one tensor
        bufs[i] = None
        out.append(x)
    bufs.clear()
    return build(c, header, out)
