"""The KV file: one prompt-cache entry (its token prefix and every layer's
cache tensors) in one self-describing, checksummed file.

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
``{off, bytes, shape, dtype, hash}``. Tensor bytes are the array's raw memory,
so bf16 round-trips bit-exactly (numpy has no bf16: MLX arrays travel as an
unsigned carrier of the same width via ``mx.array.view``).

Why not mlx-lm's ``save_prompt_cache`` (safetensors): it stores the 256-step
buffer rather than the tokens in use, records neither the model identity nor
the tokens, has no checksums, is not atomic, cannot stream one tensor at a
time behind a gate, cannot hold the fake GPU's numpy caches, and its tensor
offsets are not page aligned.

Writing is a step machine (``KvWriter``: open → one tensor per step →
commit), so the cold tier can wait for the engine to be idle before every
tensor and run each step where it belongs: tensor materialization on the
device (the MLX thread), file I/O off the event loop. ``commit`` fsyncs the
``*.tmp`` file, renames it and fsyncs the folder. Restore is the mirror: read
one layer's bytes (I/O), build that layer's fresh arrays (device), so peak
memory is the entry plus one layer; plain KV lands in 256-step capacity with
at least one free slot, so the first decode step updates in place.

Why one module of ~800 lines (issue 18 asks modules over ~500 to say why):
it is one file format. The header schema, the cache-kind codec, the writer,
the reader and ``validate_header`` change together under ``FORMAT_VERSION``,
and a reader split from its writer is where format drift starts. If it grows,
the seam is the codec (``encode_layer``/``decode_layer`` and their helpers).
"""

from __future__ import annotations

import hashlib
import math
import posixpath
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import xxhash

from engine.kv.disk import Disk

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


# ---------------------------------------------------------------------------
# Cache objects → header layers + tensor sources (runs on the device).


@dataclass(slots=True)
class TensorSource:
    """One tensor to write: its geometry now, its bytes when ``materialize`` runs."""

    shape: list[int]
    dtype: str
    nbytes: int
    materialize: Callable[[], memoryview]


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


def _np_source(x: np.ndarray) -> TensorSource:
    return TensorSource(list(x.shape), x.dtype.name, int(x.nbytes), lambda: np.ascontiguousarray(x).data.cast("B"))


def _slots(sources: list[TensorSource]) -> list[TensorSlot]:
    return [TensorSlot(off=0, bytes=s.nbytes, shape=s.shape, dtype=s.dtype) for s in sources]


def encode_layer(layer: Any) -> tuple[Layer, list[TensorSource]]:
    """Describe one cache layer; tensors are sliced to the tokens in use."""
    from engine.fake.kv_cache import FakeKVCache

    kind = type(layer)
    if kind is FakeKVCache:
        src = (
            []
            if layer.keys is None
            else [_np_source(layer.keys[..., : layer.offset, :]), _np_source(layer.values[..., : layer.offset, :])]
        )
        return FakeKVLayer(offset=layer.offset, tensors=_slots(src)), src
    c = _mlx_cache_classes()
    if kind is c.KVCache:
        src = (
            []
            if layer.keys is None
            else [_mx_source(layer.keys[..., : layer.offset, :]), _mx_source(layer.values[..., : layer.offset, :])]
        )
        return KVLayer(offset=layer.offset, tensors=_slots(src)), src
    if kind is c.RotatingKVCache:
        src = [] if layer.keys is None else [_mx_source(layer.keys), _mx_source(layer.values)]
        return (
            RotatingLayer(
                offset=layer.offset, keep=layer.keep, max_size=layer.max_size, idx=layer._idx, tensors=_slots(src)
            ),
            src,
        )
    if kind is c.QuantizedKVCache:
        src = []
        if layer.keys is not None:
            # Quantization groups run along head_dim, so a token-axis cut never splits one.
            src = [_mx_source(t[..., : layer.offset, :]) for t in (*layer.keys, *layer.values)]
        return QuantizedLayer(
            offset=layer.offset, group_size=layer.group_size, bits=layer.bits, tensors=_slots(src)
        ), src
    if kind is c.ArraysCache:
        if layer.left_padding is not None or layer.lengths is not None:
            raise UnsupportedCache("ArraysCache with batch padding state (a batched cache, not a prompt entry)")
        src, slots = [], []
        for a in layer.cache:
            slots.append(-1 if a is None else len(src))
            if a is not None:
                src.append(_mx_source(a))
        return ArraysLayer(slots=slots, tensors=_slots(src)), src
    if kind is c.CacheList:
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
    raise UnsupportedCache(f"cannot persist a {kind.__module__}.{kind.__name__}")


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
    from engine.fake.kv_cache import FakeKVCache

    total = 0
    for layer in cache:
        if type(layer) is FakeKVCache:
            total += layer.nbytes
            continue
        h, _ = encode_layer(layer)
        total += sum(t.bytes for t in h.tensors)
    return total


# ---------------------------------------------------------------------------
# Bytes → fresh cache objects (runs on the device).


def _capacity(offset: int) -> int:
    return (offset // STEP + 1) * STEP  # ≥ 1 free slot: the next update needs no concat


def _np_tensor(buf: Any, slot: TensorSlot) -> np.ndarray:
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
    shape[-2] = _capacity(offset) - offset
    return mx.concatenate([x, mx.zeros(shape, dtype=x.dtype)], axis=-2)


def decode_layer(header: Layer, bufs: list[Any]) -> Any:
    """Build one fresh cache layer from its tensors' bytes (consumes ``bufs``)."""
    if len(bufs) != len(header.tensors):
        raise CorruptFile("tensor count does not match the header")
    if isinstance(header, FakeKVLayer):
        from engine.fake.kv_cache import FakeKVCache

        layer = FakeKVCache()
        layer.offset = header.offset
        if header.tensors:
            arrays = []
            for buf, slot in zip(bufs, header.tensors):
                src = _np_tensor(buf, slot)
                shape = list(src.shape)
                shape[-2] = _capacity(header.offset)
                dst = np.zeros(shape, src.dtype)
                dst[..., : header.offset, :] = src
                arrays.append(dst)
            layer.keys, layer.values = arrays
        bufs.clear()
        return layer
    c = _mlx_cache_classes()
    if isinstance(header, ListLayer):
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
    if isinstance(header, KVLayer):
        layer = c.KVCache()
        if out:
            layer.keys, layer.values = out
        layer.offset = header.offset
        return layer
    if isinstance(header, RotatingLayer):
        layer = c.RotatingKVCache(max_size=header.max_size, keep=header.keep)
        if out:
            layer.keys, layer.values = out
        layer.offset, layer._idx = header.offset, header.idx
        return layer
    if isinstance(header, QuantizedLayer):
        layer = c.QuantizedKVCache(group_size=header.group_size, bits=header.bits)
        if out:
            layer.keys, layer.values = tuple(out[:3]), tuple(out[3:])
        layer.offset = header.offset
        return layer
    if isinstance(header, ArraysLayer):
        layer = c.ArraysCache(len(header.slots))
        for j, t in enumerate(header.slots):
            layer.cache[j] = None if t < 0 else out[t]
        return layer
    raise UnsupportedCache(f"unknown layer kind {type(header).__name__}")


# ---------------------------------------------------------------------------
# Writing.


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


class KvWriter:
    """Writes one file as a sequence of steps: ``open``, ``write(i, bytes)``
    per tensor in order, ``commit`` (or ``abort`` on any failure).

    Offsets and the header length are fixed up front (hashes are fixed-width
    placeholders patched at commit), so the file size is known before any
    byte is written: the cold tier reserves it against the byte cap.
    """

    def __init__(self, disk: Disk, path: str, header: KvHeader):
        self.disk = disk
        self.path = path
        self.tmp_path = path + ".tmp"
        self.header = header
        self.slots = [s for layer in header.layers for s in layer.tensors]
        off = 0
        for s in self.slots:
            s.off, s.hash = off, _PLACEHOLDER
            off = align_up(off + s.bytes)
        # Encoded once: the hashes are fixed-width placeholders, patched into
        # these bytes at commit (``_hash_at``: where each slot's digits are).
        self._body = bytearray(_encode_header(header))
        self.header_len = len(self._body)
        self._hash_at = _placeholders(self._body, len(self.slots))
        self.data_start = align_up(PREAMBLE.size + self.header_len)
        last = self.slots[-1] if self.slots else None
        self.file_bytes = self.data_start + last.off + last.bytes if last else PREAMBLE.size + self.header_len
        self._fh: int | None = None
        self._next = 0

    def open(self) -> None:
        self._fh = self.disk.open(self.tmp_path, write=True)

    def write(self, i: int, buf: Any) -> None:
        if self._fh is None or i != self._next:
            raise RuntimeError(f"tensor {i} written out of order (expected {self._next})")
        slot = self.slots[i]
        view = memoryview(buf).cast("B")
        if view.nbytes != slot.bytes:
            raise RuntimeError(f"tensor {i}: {view.nbytes} bytes, header says {slot.bytes}")
        slot.hash = tensor_hash(view, self.header.hash_alg)
        self.disk.write(self._fh, self.data_start + slot.off, view)
        self._next += 1

    def commit(self) -> None:
        """Header, fsync, rename, fsync the folder: durable when this returns."""
        if self._fh is None or self._next != len(self.slots):
            raise RuntimeError("commit before every tensor was written")
        if self._hash_at is not None:
            patched = self._body
            for at, slot in zip(self._hash_at, self.slots):
                patched[at : at + len(_PLACEHOLDER)] = slot.hash.encode()
            body = bytes(patched)
        else:  # the placeholders could not be located: encode the patched header again
            body = _encode_header(self.header)
        if len(body) != self.header_len:
            raise RuntimeError("header length drifted while patching hashes")
        pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(body), self.data_start, _u64_hash(body))
        disk, fh = self.disk, self._fh
        disk.write(fh, 0, pre + body)
        disk.fsync(fh)
        disk.close(fh)
        self._fh = None
        disk.rename(self.tmp_path, self.path)
        disk.fsync_dir(posixpath.dirname(self.path) or ".")

    def abort(self) -> None:
        """Best effort: close and remove the temporary file."""
        if self._fh is not None:
            try:
                self.disk.close(self._fh)
            except OSError:
                pass
            self._fh = None
        try:
            self.disk.unlink(self.tmp_path)
        except OSError:
            pass


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


async def _noop(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


async def write_streamed(
    writer: KvWriter,
    sources: list[TensorSource],
    *,
    wait_turn: Callable[[], Awaitable[Any]] | None = None,
    device_run: Callable[..., Awaitable[Any]] = _noop,
    io_run: Callable[..., Awaitable[Any]] = _noop,
) -> None:
    """Write one tensor at a time, awaiting ``wait_turn()`` before every tensor
    step and before the commit (n tensors → n + 1 gate calls).

    A gate that raises is scheduling advice gone wrong, never a reason to
    corrupt or abandon the write: its exception is swallowed. Any write error
    aborts (the ``.tmp`` is removed) and propagates.
    """
    try:
        await io_run(writer.open)
        for i, src in enumerate(sources):
            await _gate(wait_turn)
            buf = await device_run(src.materialize)
            await io_run(writer.write, i, buf)
            del buf
        await _gate(wait_turn)
        await io_run(writer.commit)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await io_run(writer.abort)
        raise


async def _gate(wait_turn: Callable[[], Awaitable[Any]] | None) -> None:
    if wait_turn is None:
        return
    try:
        await wait_turn()
    except Exception:  # noqa: BLE001 - see write_streamed; cancellation still propagates
        pass


def save(
    disk: Disk, path: str, meta: KvMeta, tokens: Sequence[int], cache: Sequence[Any], *, created_at: float = 0.0
) -> KvHeader:
    """Write a whole entry synchronously (tests, tools); returns its header."""
    layers, sources = encode_layers(cache)
    writer = KvWriter(disk, path, make_header(meta, tokens, layers, created_at))
    try:
        writer.open()
        for i, src in enumerate(sources):
            writer.write(i, src.materialize())
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return writer.header


# ---------------------------------------------------------------------------
# Reading.


class KvReader:
    """Reads a file's header (always hash-verified and checked against the
    file's size, ``validate_header``) and then one layer at a time; with
    ``verify`` (the cold tier's default) every tensor's checksum too."""

    def __init__(
        self, disk: Disk, path: str, *, verify: bool = True, max_tokens: int | None = None, entry: bool = False
    ):
        self.disk = disk
        self.path = path
        self.verify = verify
        self.header, self.data_start = read_header(disk, path, max_tokens=max_tokens, entry=entry)

    def read_layer(self, i: int) -> list[bytes]:
        slots = self.header.layers[i].tensors
        if not slots:
            return []
        fh = self.disk.open(self.path)
        try:
            out = []
            for slot in slots:
                buf = self.disk.read(fh, self.data_start + slot.off, slot.bytes)
                if len(buf) != slot.bytes:
                    raise CorruptFile(f"{self.path}: tensor truncated ({len(buf)} of {slot.bytes} bytes)")
                if self.verify and tensor_hash(buf, self.header.hash_alg) != slot.hash:
                    raise CorruptFile(f"{self.path}: tensor hash mismatch")
                out.append(buf)
            return out
        finally:
            self.disk.close(fh)


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


def read_header(disk: Disk, path: str, *, max_tokens: int | None = None, entry: bool = False) -> tuple[KvHeader, int]:
    """The header and data start, validated against the file (``validate_header``).

    Any way the bytes can be wrong raises ``CorruptFile`` (or
    ``UnsupportedFormat``): the caller maps it to "delete, count, miss"."""
    fh = disk.open(path)
    try:
        size = disk.fstat(fh).size
        pre = disk.read(fh, 0, PREAMBLE.size)
        if len(pre) != PREAMBLE.size:
            raise CorruptFile(f"{path}: shorter than the preamble")
        magic, version, _, header_len, data_start, digest = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise CorruptFile(f"{path}: bad magic")
        if version != FORMAT_VERSION:
            raise UnsupportedFormat(f"{path}: format version {version}, this build reads {FORMAT_VERSION}")
        if data_start != align_up(PREAMBLE.size + header_len):
            raise CorruptFile(f"{path}: data start does not follow the header")
        if header_len > MAX_HEADER_BYTES or PREAMBLE.size + header_len > size:
            raise CorruptFile(f"{path}: header of {header_len} bytes in a file of {size}")
        body = disk.read(fh, PREAMBLE.size, header_len)
    finally:
        disk.close(fh)
    if len(body) != header_len or _u64_hash(body) != digest:
        raise CorruptFile(f"{path}: header hash mismatch")
    try:
        header = _decode_header(body)
    except (msgspec.DecodeError, RecursionError, ValueError, OverflowError) as exc:
        # a hash-valid header can still be anything: not JSON, 100k levels deep…
        raise CorruptFile(f"{path}: header does not decode: {type(exc).__name__}: {str(exc)[:200]}") from None
    if header.format_version != FORMAT_VERSION:
        raise UnsupportedFormat(f"{path}: header format version {header.format_version}")
    validate_header(header, data_start, size, path=path, max_tokens=max_tokens, entry=entry)
    return header, data_start


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


def load(disk: Disk, path: str, *, expect: KvMeta | None = None, verify: bool = True) -> tuple[KvHeader, list[Any]]:
    """Read a whole entry synchronously into fresh cache objects."""
    reader = KvReader(disk, path, verify=verify)
    if expect is not None and not reader.header.matches(expect):
        raise IncompatibleFile(f"{path}: written for another model, fingerprint, tokenizer or namespace")
    layers = [decode_layer(h, reader.read_layer(i)) for i, h in enumerate(reader.header.layers)]
    return reader.header, layers
