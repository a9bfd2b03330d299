"""Validation of a KV file's header: every size and offset a reader would act
on, checked against the file before it acts (``validate_header``). A header
that passes its hash can still be anything its writer wrote; a file that
fails here is deleted and counted as a miss by the cold tier."""

from __future__ import annotations

import math

from engine.kv.kvfile_format import (
    ALIGN,
    HASHES,
    ArraysLayer,
    CorruptFile,
    FakeKVLayer,
    KvHeader,
    KVLayer,
    QuantizedLayer,
    RotatingLayer,
)

# The header is read into memory whole, before anything in it is trusted: a
# declared length is bounded here and by the file's size. A 1M-token prefix
# encodes in ~7 MiB (6-digit ids and a comma), the layers in a few KiB.
MAX_HEADER_BYTES = 32 << 20

# Names a tensor slot may carry (MLX's and numpy's), with their item sizes.
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
}
_MAX_TOKEN_ID = 1 << 31


def validate_header(
    header: KvHeader, data_start: int, size: int, *, path: str = "", max_tokens: int | None = None, entry: bool = False
) -> None:
    """Every size and offset a reader would act on, checked before it acts:
    token ids in range and at most ``max_tokens`` of them; each tensor slot's
    dtype known, its bytes equal to shape × item size, aligned, inside the
    file; each KV layer's tensors holding exactly its offset's positions and,
    for a prompt-cache ``entry`` (the cold tier's files), that offset equal to
    the token count: a header listing more tokens than its KV holds would
    serve a wrong prefix. Raises ``CorruptFile``."""

    def bad(why: str) -> CorruptFile:
        return CorruptFile(f"{path}: {why}")

    if header.hash_alg not in HASHES:
        raise bad(f"unknown hash {header.hash_alg!r}")
    n = len(header.tokens)
    if max_tokens is not None and n > max_tokens:
        raise bad(f"{n} tokens, more than the context of {max_tokens}")
    if n and (min(header.tokens) < 0 or max(header.tokens) >= _MAX_TOKEN_ID):
        raise bad("a token id out of range")
    for i, layer in enumerate(header.layers):
        slots = getattr(layer, "tensors", [])
        for slot in slots:
            item = ITEMSIZE.get(slot.dtype)
            if item is None:
                raise bad(f"layer {i}: unknown dtype {slot.dtype!r}")
            if len(slot.shape) > 8 or any(d < 0 for d in slot.shape):
                raise bad(f"layer {i}: bad shape {slot.shape}")
            if slot.bytes != math.prod(slot.shape) * item:
                raise bad(f"layer {i}: {slot.bytes} bytes for shape {slot.shape} of {slot.dtype}")
            if slot.off < 0 or slot.off % ALIGN or data_start + slot.off + slot.bytes > size:
                raise bad(f"layer {i}: tensor at {slot.off} (+{slot.bytes}) outside a file of {size} bytes")
        if isinstance(layer, (KVLayer, QuantizedLayer, FakeKVLayer, RotatingLayer)):
            if layer.offset < 0 or (entry and layer.offset != n):
                raise bad(f"layer {i}: holds {layer.offset} tokens, the header lists {n}")
            want = {KVLayer: 2, FakeKVLayer: 2, RotatingLayer: 2, QuantizedLayer: 6}[type(layer)]
            if len(slots) not in (0, want) or (not slots and layer.offset):
                raise bad(f"layer {i}: {len(slots)} tensors")
            for slot in slots:
                if len(slot.shape) < 2:
                    raise bad(f"layer {i}: bad shape {slot.shape}")
                if isinstance(layer, RotatingLayer):
                    # a multi-token update can leave the ring longer than max_size (mlx-lm's _update_concat)
                    held = slot.shape[-2]
                    if not (
                        0 <= layer.keep <= layer.max_size and 0 <= layer.idx <= max(held, layer.max_size)
                    ) or held > max(layer.max_size, layer.offset):
                        raise bad(f"layer {i}: ring geometry out of range")
                elif slot.shape[-2] != layer.offset:
                    raise bad(f"layer {i}: tensor of {slot.shape[-2]} positions for an offset of {layer.offset}")
        elif isinstance(layer, ArraysLayer) and any(not -1 <= t < len(slots) for t in layer.slots):
            raise bad(f"layer {i}: state slot out of range")
