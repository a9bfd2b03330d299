"""The KV file's format: the byte layout, the header schema (one tagged
struct per layer kind) and its identity, the per-tensor checksums, and the
errors a reader raises. ``engine.kv.kvfile`` writes and reads files in it;
``engine.kv.kvfile_codecs`` turns cache objects into its layers and back;
``engine.kv.kvfile_validate`` checks a header before anything acts on it. They
change together under ``FORMAT_VERSION``.

Layout (little endian; spec and rationale in docs/cold-tier.md)::

    0   8   magic b"EMBERKV\\0"
    8   2   u16 format version (1)
    10  2   u16 reserved (0)
    12  4   u32 header length (JSON bytes)
    16  4   u32 data start (aligned to 16 KiB)
    20  8   u64 header hash: blake2b(header JSON, digest_size=8)
    28  …   JSON header (msgspec), zero padding up to data start
    data start + slot.off: raw tensor bytes, every slot.off 16 KiB aligned

The header carries the identity (model, config fingerprint, tokenizer hash,
namespace), the exact token prefix (the lookup key: no sidecar index) and per
layer its kind, offset, ring/quantization parameters and tensor slots
``{off, bytes, shape, dtype, hash}``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

MAGIC = b"EMBERKV\0"
FORMAT_VERSION = 1
ALIGN = 16 * 1024  # the arm64 page size: page-aligned tensors can be mapped or dropped per tensor
STEP = 256  # mlx-lm's KVCache growth step
PREAMBLE = struct.Struct("<8sHHIIQ")
_PLACEHOLDER = "0" * 16


class KvFileError(Exception):
    """A KV file cannot be used; the cold tier deletes it and counts a miss."""


class CorruptFile(KvFileError):
    """Bad magic, header hash, truncated data or a tensor hash mismatch."""


class UnsupportedFormat(KvFileError):
    """Another format version (older or newer): regenerate rather than read."""


class IncompatibleFile(KvFileError):
    """A valid file written for another model, fingerprint, tokenizer or namespace."""


class UnsupportedCache(KvFileError):
    """A cache kind this format does not know how to persist."""


# ---------------------------------------------------------------------------
# The header.


class TensorSlot(msgspec.Struct, kw_only=True):
    off: int  # relative to data start, ALIGN-aligned
    bytes: int
    shape: list[int]
    dtype: str
    hash: str = _PLACEHOLDER  # blake2b-8 of the bytes, 16 hex digits (fixed width: patched in place)


class KVLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="KVCache"):
    offset: int
    tensors: list[TensorSlot]  # [keys, values] up to offset; empty for an empty cache


class RotatingLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="RotatingKVCache"):
    offset: int
    keep: int
    max_size: int
    idx: int  # the ring's write index (mlx-lm's _idx)
    tensors: list[TensorSlot]  # [keys, values], the whole ring as laid out


class QuantizedLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="QuantizedKVCache"):
    offset: int
    group_size: int
    bits: int
    tensors: list[TensorSlot]  # [k_packed, k_scales, k_biases, v_packed, v_scales, v_biases] up to offset


class ArraysLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="ArraysCache"):
    slots: list[int]  # per state slot: its index in tensors, or -1 for None
    tensors: list[TensorSlot]


class FakeKVLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="FakeKVCache"):
    offset: int
    tensors: list[TensorSlot]


class ListLayer(msgspec.Struct, kw_only=True, tag_field="kind", tag="CacheList"):
    """mlx-lm's ``CacheList`` (one layer holding several caches, e.g.
    falcon_h1's SSM state + attention KV): its parts' headers, written with no
    tensors of their own; this layer's tensors are theirs in order, ``counts``
    of them each."""

    parts: list[KVLayer | RotatingLayer | QuantizedLayer | ArraysLayer]
    counts: list[int]
    tensors: list[TensorSlot]


Layer = KVLayer | RotatingLayer | QuantizedLayer | ArraysLayer | FakeKVLayer | ListLayer


class KvMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Who a file belongs to; a reader rejects a file whose identity differs."""

    model_id: str
    config_fingerprint: str
    tokenizer_hash: str
    ns: str = ""


class KvHeader(msgspec.Struct, kw_only=True):
    format_version: int
    created_at: float
    model_id: str
    config_fingerprint: str
    ns: str
    tokenizer_hash: str
    tokens: list[int]
    layers: list[Layer]

    def trimmable(self) -> bool:
        return all(layer_trimmable(layer) for layer in self.layers)

    hash_alg: str = "blake2b-8"  # of the tensor slots' ``hash``; files written before xxh3 say nothing

    def matches(self, meta: KvMeta, *, ns: bool = True) -> bool:
        return (
            self.model_id == meta.model_id
            and self.config_fingerprint == meta.config_fingerprint
            and self.tokenizer_hash == meta.tokenizer_hash
            and (not ns or self.ns == meta.ns)
        )


def layer_trimmable(layer: Layer) -> bool:
    if isinstance(layer, ListLayer):
        return all(layer_trimmable(p) for p in layer.parts)
    if isinstance(layer, RotatingLayer):
        return layer.offset < layer.max_size  # a wrapped ring has lost the tokens a trim would expose
    return not isinstance(layer, ArraysLayer)  # SSM state cannot run backwards


_encode_header = msgspec.json.Encoder().encode
_decode_header = msgspec.json.Decoder(KvHeader).decode


def _blake2b_8(buf: Any) -> str:
    return hashlib.blake2b(buf, digest_size=8).hexdigest()


def _xxh3_64(buf: Any) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


# Per-tensor checksums, by the header's ``hash_alg``; every one is 16 hex
# digits (the writer patches them in place). xxh3-64 is what new files use:
# measured ~20x faster than blake2b-8 (docs/cold-tier.md), cheap enough to
# verify every restore by default. It guards against bit rot and torn or
# foreign bytes, not against an adversary (who could also rewrite the hash).
HASHES: dict[str, Callable[[Any], str]] = {"xxh3-64": _xxh3_64, "blake2b-8": _blake2b_8}
HASH_ALG = "xxh3-64"


def tensor_hash(buf: Any, alg: str = HASH_ALG) -> str:
    return HASHES[alg](buf)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def make_header(meta: KvMeta, tokens: Sequence[int] | np.ndarray, layers: list[Layer], created_at: float) -> KvHeader:
    return KvHeader(
        format_version=FORMAT_VERSION,
        created_at=float(created_at),
        model_id=meta.model_id,
        config_fingerprint=meta.config_fingerprint,
        ns=meta.ns,
        tokenizer_hash=meta.tokenizer_hash,
        # plain ints for the JSON: an int64 array's tolist(), far faster than int() per token
        tokens=(tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.int64)).tolist(),
        layers=layers,
        hash_alg=HASH_ALG,
    )


_HASH_FIELD = b'"hash":"' + _PLACEHOLDER.encode() + b'"'


def _placeholders(body: bytes | bytearray, n: int) -> list[int] | None:
    """Offsets of the ``n`` slots' placeholder digits in an encoded header, in
    slot order (msgspec writes fields and lists in order, ``hash`` last in a
    slot). A string field cannot fake one: its quotes would be escaped. None
    if the count is not ``n``."""
    out, at = [], body.find(_HASH_FIELD)
    while at >= 0:
        out.append(at + len(b'"hash":"'))
        at = body.find(_HASH_FIELD, at + len(_HASH_FIELD))
    return out if len(out) == n else None


def _u64_hash(body: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")
