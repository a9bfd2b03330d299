"""The KV file format (engine.kv.kvfile) over both disks (engine.kv.disk).

Oracles: a restored cache equals the one saved (bit for bit, bf16 included),
save → load → re-save is byte-identical for every kind, every corruption is
detected, and a file is either absent or complete after a crash at any point
of its write.
"""

from __future__ import annotations

import errno
import os
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from engine.fake.disk import FaultyDisk
from engine.fake.gpu import FakeBackend
from engine.fake.kv_cache import FakeKVCache
from engine.kv import kvfile
from engine.kv.disk import RealDisk

META = kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="tok")
TOKENS = list(range(100, 140))


def _kv(n: int, dtype=mx.float32, dim: int = 8) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, dim)).astype(dtype), mx.random.normal((1, 2, n, dim)).astype(dtype))
    return c


def _rotating(n: int, max_size: int = 16) -> RotatingKVCache:
    c = RotatingKVCache(max_size=max_size, keep=2)
    c.update_and_fetch(mx.random.normal((1, 2, 6, 8)), mx.random.normal((1, 2, 6, 8)))
    for _ in range(n - 6):
        c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    return c


def _quantized(n: int, bits: int = 4) -> QuantizedKVCache:
    c = QuantizedKVCache(group_size=32, bits=bits)
    c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
    return c


def _arrays() -> ArraysCache:
    c = ArraysCache(3)
    c[0] = mx.random.normal((1, 3, 16)).astype(mx.bfloat16)
    c[2] = mx.random.normal((1, 4, 8, 8))
    return c


def _fake(n: int = 40) -> list[FakeKVCache]:
    be = FakeBackend()
    cache = be.make_cache()
    be._feed(cache, list(range(n)))
    return cache


def _trimmed_kv() -> KVCache:
    c = _kv(300)
    c.trim(20)  # offset 280 in a 512-slot buffer: only 280 must be saved
    return c


KINDS = {
    "kv_f32": lambda: [_trimmed_kv(), _kv(5)],
    "kv_bf16": lambda: [_kv(33, mx.bfloat16), _kv(257, mx.bfloat16)],
    "kv_empty": lambda: [KVCache(), _kv(3)],
    "rotating": lambda: [_rotating(10)],
    "rotating_wrapped": lambda: [_rotating(25), _rotating(40)],
    "quantized": lambda: [_quantized(40, 4), _quantized(300, 8)],
    "arrays": lambda: [_arrays()],
    "fake": _fake,
}


@pytest.fixture(params=["real", "faulty"])
def disk_dir(request, tmp_path):
    if request.param == "real":
        return RealDisk(), str(tmp_path)
    d = FaultyDisk(seed=1)
    d.makedirs("/kv")
    return d, "/kv"


def _read_all(disk, path: str) -> bytes:
    fh = disk.open(path)
    try:
        return disk.read(fh, 0, 1 << 31)
    finally:
        disk.close(fh)


def _slurp(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _spit(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _np(x) -> np.ndarray:
    """Raw bits of an array (bf16 as uint16) for exact comparison."""
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x.view({1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[x.dtype.size]))


def _assert_same_layer(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, ArraysCache):
        for x, y in zip(a.cache, b.cache):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and np.array_equal(_np(x), _np(y))
        return
    assert a.offset == b.offset
    if isinstance(a, RotatingKVCache):
        assert (a._idx, a.keep, a.max_size) == (b._idx, b.keep, b.max_size)
        assert np.array_equal(_np(a.keys), _np(b.keys)) and np.array_equal(_np(a.values), _np(b.values))
        return
    if a.keys is None:
        assert b.keys is None
        return
    pairs = (
        zip((*a.keys, *a.values), (*b.keys, *b.values))
        if isinstance(a, QuantizedKVCache)
        else [(a.keys, b.keys), (a.values, b.values)]
    )
    for x, y in pairs:
        assert x.dtype == y.dtype
        assert np.array_equal(_np(x)[..., : a.offset, :], _np(y)[..., : a.offset, :])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_save_load_resave_is_byte_identical(kind, disk_dir):
    disk, d = disk_dir
    mx.random.seed(7)
    cache = KINDS[kind]()
    p1, p2 = os.path.join(d, "a.kv"), os.path.join(d, "b.kv")
    kvfile.save(disk, p1, META, TOKENS, cache, created_at=123.5)
    header, restored = kvfile.load(disk, p1, expect=META, verify=True)
    assert header.tokens == TOKENS and len(restored) == len(cache)
    for a, b in zip(cache, restored):
        _assert_same_layer(a, b)
    kvfile.save(disk, p2, META, TOKENS, restored, created_at=123.5)
    assert _read_all(disk, p1) == _read_all(disk, p2)
    assert not any(n.endswith(".tmp") for n in disk.listdir(d))


def test_bf16_is_bit_exact_including_nan_payloads(tmp_path):
    bits = np.array(
        [0x7FC1, 0xFF81, 0x0001, 0x8000, 0x3F80, 0x7F80], dtype=np.uint16
    )  # NaN payloads, subnormal, -0, 1, inf
    keys = mx.array(np.tile(bits, 8).reshape(1, 1, 6, 8)).view(mx.bfloat16)
    c = KVCache()
    c.update_and_fetch(keys, keys)
    path = str(tmp_path / "x.kv")
    kvfile.save(RealDisk(), path, META, TOKENS[:6], [c])
    _, (r,) = kvfile.load(RealDisk(), path)
    assert r.keys.dtype == mx.bfloat16
    assert np.array_equal(np.asarray(r.keys.view(mx.uint16))[..., :6, :], np.tile(bits, 8).reshape(1, 1, 6, 8))


def test_plain_kv_lands_in_step_capacity_with_slack(tmp_path):
    path = str(tmp_path / "x.kv")
    for n, cap in [(5, 256), (255, 256), (256, 512), (280, 512)]:
        c = _kv(n)
        kvfile.save(RealDisk(), path, META, list(range(n)), [c, *_fake(n)])
        _, (r, f, _) = kvfile.load(RealDisk(), path)
        assert r.keys.shape[2] == cap and f.keys.shape[2] == cap and r.offset == f.offset == n
        r.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
        assert r.keys.shape[2] == cap  # the first decode step updated in place


def test_only_tokens_in_use_are_stored(tmp_path):
    c = _trimmed_kv()
    assert c.nbytes == 2 * 1 * 2 * 512 * 8 * 4  # mlx-lm counts the whole buffer
    assert kvfile.cache_bytes([c]) == 2 * 1 * 2 * 280 * 8 * 4
    fake = _fake(40)
    assert kvfile.cache_bytes(fake) == sum(x.nbytes for x in fake)
    header = kvfile.save(RealDisk(), str(tmp_path / "x.kv"), META, TOKENS, [c])
    assert [t.shape for t in header.layers[0].tensors] == [[1, 2, 280, 8]] * 2


def test_header_layout(tmp_path):
    path = str(tmp_path / "x.kv")
    cache = [_kv(10), _quantized(20), _rotating(25), _arrays()]
    kvfile.save(
        RealDisk(),
        path,
        kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="tok", ns="agent"),
        TOKENS,
        cache,
        created_at=9.0,
    )
    raw = _slurp(path)
    magic, version, _, hlen, data_start, _ = kvfile.PREAMBLE.unpack(raw[: kvfile.PREAMBLE.size])
    assert magic == kvfile.MAGIC and version == kvfile.FORMAT_VERSION
    assert data_start % (16 * 1024) == 0 and data_start >= kvfile.PREAMBLE.size + hlen
    header, start = kvfile.read_header(RealDisk(), path)
    assert start == data_start
    assert (header.model_id, header.config_fingerprint, header.tokenizer_hash, header.ns, header.created_at) == (
        "m",
        "fp",
        "tok",
        "agent",
        9.0,
    )
    kinds = [type(layer).__name__ for layer in header.layers]
    assert kinds == ["KVLayer", "QuantizedLayer", "RotatingLayer", "ArraysLayer"]
    assert header.layers[1].bits == 4 and header.layers[1].group_size == 32
    assert header.layers[2].offset == 25 and header.layers[2].max_size == 16 and header.layers[2].idx == cache[2]._idx
    assert header.layers[3].slots == [0, -1, 1]
    slots = [s for layer in header.layers for s in layer.tensors]
    assert all(s.off % (16 * 1024) == 0 and len(s.hash) == 16 for s in slots)
    for s in slots:
        assert kvfile.tensor_hash(raw[data_start + s.off : data_start + s.off + s.bytes]) == s.hash
    assert [kvfile.layer_trimmable(layer) for layer in header.layers] == [True, True, False, False]
    assert not header.trimmable()


@pytest.mark.parametrize("where", ["magic", "hash_field", "header_body"])
def test_corrupt_header_is_detected(tmp_path, where):
    path = str(tmp_path / "x.kv")
    kvfile.save(RealDisk(), path, META, TOKENS, _fake())
    offset = {"magic": 0, "hash_field": 25, "header_body": kvfile.PREAMBLE.size + 30}[where]
    raw = bytearray(_slurp(path))
    raw[offset] ^= 0x01
    _spit(path, raw)
    with pytest.raises(kvfile.CorruptFile):
        kvfile.read_header(RealDisk(), path)


def test_other_format_version_is_unsupported(tmp_path):
    path = str(tmp_path / "x.kv")
    kvfile.save(RealDisk(), path, META, TOKENS, _fake())
    raw = bytearray(_slurp(path))
    raw[8:10] = struct.pack("<H", kvfile.FORMAT_VERSION + 1)
    _spit(path, raw)
    with pytest.raises(kvfile.UnsupportedFormat):
        kvfile.read_header(RealDisk(), path)


def test_truncated_tensor_and_flipped_tensor_bits(tmp_path):
    disk = FaultyDisk()
    disk.makedirs("/d")
    kvfile.save(disk, "/d/x.kv", META, TOKENS, _fake())
    header, start = kvfile.read_header(disk, "/d/x.kv")
    last = header.layers[-1].tensors[-1]
    disk.corrupt("/d/x.kv", start + last.off + 3)
    kvfile.load(disk, "/d/x.kv", verify=False)  # opted out, only the header is checked (a documented trade-off)
    with pytest.raises(kvfile.CorruptFile, match="hash"):
        kvfile.load(disk, "/d/x.kv")  # verified by default
    disk.truncate("/d/x.kv", start + last.off + last.bytes - 1)
    with pytest.raises(kvfile.CorruptFile, match="outside a file"):  # the header's sizes against the file's
        kvfile.load(disk, "/d/x.kv", verify=False)


def test_identity_mismatch_is_incompatible(tmp_path):
    path = str(tmp_path / "x.kv")
    kvfile.save(RealDisk(), path, META, TOKENS, _fake())
    for other in (
        kvfile.KvMeta(model_id="other", config_fingerprint="fp", tokenizer_hash="tok"),
        kvfile.KvMeta(model_id="m", config_fingerprint="fp2", tokenizer_hash="tok"),
        kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="tok2"),
        kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="tok", ns="other-ns"),
    ):
        with pytest.raises(kvfile.IncompatibleFile):
            kvfile.load(RealDisk(), path, expect=other)


def test_unsupported_cache_kind_is_refused(tmp_path):
    with pytest.raises(kvfile.UnsupportedCache):
        kvfile.save(RealDisk(), str(tmp_path / "x.kv"), META, TOKENS, [ChunkedKVCache(16)])
    assert os.listdir(tmp_path) == []


def test_enospc_aborts_and_removes_the_tmp():
    disk = FaultyDisk(capacity_bytes=20_000)
    disk.makedirs("/d")
    with pytest.raises(OSError) as info:
        kvfile.save(disk, "/d/x.kv", META, TOKENS, _fake(200))
    assert info.value.errno == errno.ENOSPC
    assert disk.listdir("/d") == []


class _Crash(Exception):
    pass


class CrashAt(FaultyDisk):
    """Loses power just before its ``at``-th mutating operation."""

    def __init__(self, at: int, seed: int):
        super().__init__(seed=seed)
        self.at = at
        self.ops = 0
        self.armed = False

    def _tick_op(self) -> None:
        if self.armed:
            self.ops += 1
            if self.ops == self.at:
                self.armed = False
                self.crash()
                raise _Crash()

    def open(self, path, *, write=False):
        if write:
            self._tick_op()
        return super().open(path, write=write)

    def write(self, fh, offset, data):
        self._tick_op()
        return super().write(fh, offset, data)

    def fsync(self, fh):
        self._tick_op()
        return super().fsync(fh)

    def rename(self, src, dst):
        self._tick_op()
        return super().rename(src, dst)

    def fsync_dir(self, path):
        self._tick_op()
        return super().fsync_dir(path)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_file_is_absent_or_complete_after_a_crash_anywhere(seed):
    cache = _fake(300)
    probe = CrashAt(at=10**9, seed=seed)
    probe.makedirs("/d")
    probe.armed = True
    kvfile.save(probe, "/d/x.kv", META, TOKENS, cache)
    n_ops = probe.ops
    assert n_ops >= 7  # open, 4 tensors, header, fsync, rename, dir fsync
    for at in range(1, n_ops + 2):
        disk = CrashAt(at=at, seed=seed * 1000 + at)
        disk.makedirs("/d")
        kvfile.save(disk, "/d/old.kv", META, TOKENS[:5], cache)  # an earlier durable entry
        disk.armed = True
        try:
            kvfile.save(disk, "/d/x.kv", META, TOKENS, cache)
            disk.crash()  # power loss right after save returned: it must hold
            committed = True
        except _Crash:
            committed = False
        files = disk.listdir("/d")
        assert "old.kv" in files
        if committed:
            assert "x.kv" in files
        if "x.kv" in files:
            _, restored = kvfile.load(disk, "/d/x.kv", verify=True)
            for a, b in zip(cache, restored):
                assert np.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])


@pytest.mark.anyio
async def test_streamed_writer_awaits_the_gate_before_every_tensor_step():
    disk = FaultyDisk()
    disk.makedirs("/d")
    cache = _fake(50)
    layers, sources = kvfile.encode_layers(cache)
    writer = kvfile.KvWriter(disk, "/d/x.kv", kvfile.make_header(META, TOKENS, layers, 0.0))
    seen: list[tuple[int, bool]] = []

    async def gate() -> None:
        seen.append((disk.counters["writes"], disk.exists("/d/x.kv")))
        if len(seen) == 2:
            raise RuntimeError("scheduling advice gone wrong")  # swallowed

    await kvfile.write_streamed(writer, sources, wait_turn=gate)
    assert len(sources) == 4
    assert seen == [(0, False), (1, False), (2, False), (3, False), (4, False)]  # n tensors → n + 1 gates
    _, restored = kvfile.load(disk, "/d/x.kv", verify=True)
    assert [r.offset for r in restored] == [50, 50]


@pytest.mark.anyio
async def test_streamed_writer_abort_leaves_no_tmp():
    disk = FaultyDisk()
    disk.makedirs("/d")
    layers, sources = kvfile.encode_layers(_fake(50))
    writer = kvfile.KvWriter(disk, "/d/x.kv", kvfile.make_header(META, TOKENS, layers, 0.0))
    calls = 0

    async def device_run(fn, *args):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise MemoryError("device out of memory")
        return fn(*args)

    with pytest.raises(MemoryError):
        await kvfile.write_streamed(writer, sources, device_run=device_run)
    assert disk.listdir("/d") == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_header_patched_at_commit_is_the_encoding_of_the_final_header(kind):
    """The writer encodes the header once and patches the hash placeholders in
    place: the bytes on disk must be what encoding the final header gives,
    with a namespace that looks like a hash field too."""
    disk = FaultyDisk(seed=1)
    disk.makedirs("/kv")
    meta = kvfile.KvMeta(model_id="m", config_fingerprint="fp", tokenizer_hash="t", ns='"hash":"0000000000000000"')
    header = kvfile.save(disk, "/kv/x.kv", meta, [1, 2, 3], KINDS[kind]())
    raw = _read_all(disk, "/kv/x.kv")
    n = kvfile.PREAMBLE.unpack(raw[: kvfile.PREAMBLE.size])[3]
    body = raw[kvfile.PREAMBLE.size : kvfile.PREAMBLE.size + n]
    assert body == kvfile._encode_header(header)
    assert kvfile.read_header(disk, "/kv/x.kv")[0] == header


def test_faulty_disk_a_write_after_fsync_never_changes_what_was_made_durable():
    """fsync shares the written bytes with the durable image (copy on write):
    an unsynced overwrite after it must leave the durable image alone."""
    outcomes = set()
    for seed in range(24):
        disk = FaultyDisk(seed=seed)
        disk.makedirs("/a")
        fh = disk.open("/a/f", write=True)
        disk.write(fh, 0, b"hello")
        disk.fsync(fh)
        disk.write(fh, 0, b"XXXXX")
        disk.write(fh, 5, b"!")
        assert disk.read(fh, 0, 10) == b"XXXXX!"
        disk.close(fh)
        disk.fsync_dir("/a")
        disk.crash()
        fh = disk.open("/a/f")
        got = disk.read(fh, 0, 10)
        outcomes.add(got[:5])
        k = len(got[:5]) - len(got[:5].lstrip(b"X"))
        assert got[:5] == b"X" * k + b"hello"[k:], got  # each unsynced write dropped, kept or torn
    assert b"hello" in outcomes and b"XXXXX" in outcomes


def test_faulty_disk_semantics():
    disk = FaultyDisk(seed=3)
    disk.makedirs("/a")
    fh = disk.open("/a/f", write=True)
    disk.write(fh, 0, b"hello")
    disk.fsync(fh)
    disk.close(fh)
    disk.crash()
    assert disk.listdir("/a") == []  # the name was never made durable
    fh = disk.open("/a/f", write=True)
    disk.write(fh, 0, b"hello")
    disk.fsync(fh)
    disk.close(fh)
    disk.fsync_dir("/a")
    disk.unlink("/a/f")
    disk.crash()
    assert disk.listdir("/a") == ["f"]  # an unsynced unlink comes back
    fh = disk.open("/a/f")
    assert disk.read(fh, 0, 10) == b"hello"
    flip = FaultyDisk(seed=0, bitflip_prob=1.0)
    flip.makedirs("/a")
    fh = flip.open("/a/g", write=True)
    flip.write(fh, 0, b"\0" * 8)
    assert flip.read(fh, 0, 8) != b"\0" * 8 and flip.read(fh, 0, 8).count(0) == 7
