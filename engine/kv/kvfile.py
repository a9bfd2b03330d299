"""The KV file: one prompt-cache entry (its token prefix and every layer's
cache tensors) in one self-describing, checksummed file; this module writes
and reads it. Its parts: ``kvfile_format`` (the byte layout, the header
schema, checksums, errors; spec in docs/cold-tier.md), ``kvfile_codecs``
(cache objects to header layers and back, one codec per layer kind) and
``kvfile_validate`` (every size and offset checked before a reader acts). The
names callers use are re-exported here.

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
memory is the entry plus one layer.
"""

from __future__ import annotations

import posixpath
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec

from engine.kv.disk import Disk
from engine.kv.kvfile_codecs import TensorSource, cache_bytes, decode_layer, encode_layer, encode_layers
from engine.kv.kvfile_format import (
    _PLACEHOLDER,
    ALIGN,
    FORMAT_VERSION,
    HASH_ALG,
    MAGIC,
    PREAMBLE,
    STEP,
    CorruptFile,
    IncompatibleFile,
    KvFileError,
    KvHeader,
    KvMeta,
    Layer,
    UnsupportedCache,
    UnsupportedFormat,
    _decode_header,
    _encode_header,
    _placeholders,
    _u64_hash,
    align_up,
    layer_trimmable,
    make_header,
    tensor_hash,
)
from engine.kv.kvfile_validate import MAX_HEADER_BYTES, validate_header

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HASH_ALG",
    "MAGIC",
    "PREAMBLE",
    "STEP",
    "CorruptFile",
    "IncompatibleFile",
    "KvFileError",
    "KvHeader",
    "KvMeta",
    "KvReader",
    "KvWriter",
    "Layer",
    "TensorSource",
    "UnsupportedCache",
    "UnsupportedFormat",
    "align_up",
    "cache_bytes",
    "decode_layer",
    "encode_layer",
    "encode_layers",
    "layer_trimmable",
    "load",
    "make_header",
    "read_header",
    "save",
    "tensor_hash",
    "validate_header",
    "write_streamed",
]

# ---------------------------------------------------------------------------
# Writing.


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


def load(disk: Disk, path: str, *, expect: KvMeta | None = None, verify: bool = True) -> tuple[KvHeader, list[Any]]:
    """Read a whole entry synchronously into fresh cache objects."""
    reader = KvReader(disk, path, verify=verify)
    if expect is not None and not reader.header.matches(expect):
        raise IncompatibleFile(f"{path}: written for another model, fingerprint, tokenizer or namespace")
    layers = [decode_layer(h, reader.read_layer(i)) for i, h in enumerate(reader.header.layers)]
    return reader.header, layers
