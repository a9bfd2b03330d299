"""The SSD tier's folder is untrusted input (issue #23, items 2-4 and 7).

Each case plants something hostile in a real folder and checks that the
startup scan (``ColdStore.recover``, what ``ColdTier.started`` runs) returns
promptly, never follows or deletes anything outside the tier, never serves
what it cannot prove is an entry, and turns every undecodable file into
"corrupt → delete, count, miss".
"""

from __future__ import annotations

import os
import struct
import threading
import tracemalloc

import msgspec
import numpy as np
import pytest

from engine.fake.gpu import FakeBackend
from engine.kv import kvfile
from engine.kv.cold_store import ColdStore, entry_id, ns_folder
from engine.kv.disk import RealDisk

BE = FakeBackend()
INFO = BE.info
A = list(range(10, 50))


def feed(tokens: list[int]) -> list:
    cache = BE.make_cache()
    BE._feed(cache, tokens)
    return cache


def store(root: str, **kw) -> ColdStore:
    return ColdStore(
        RealDisk(),
        root,
        model_id=INFO.model_id,
        config_fingerprint=INFO.config_fingerprint,
        tokenizer_hash=INFO.tokenizer_hash,
        max_bytes=kw.pop("max_bytes", 1 << 30),
        **kw,
    )


def recover_within(s: ColdStore, seconds: float = 10.0) -> None:
    """Run the startup scan on a thread: a scan that blocks (a FIFO opened
    for reading waits for a writer forever) fails the test instead of hanging it."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            s.recover()
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        # unblock the stuck open() so the thread can end: open each FIFO for writing once
        for dirpath, _, names in os.walk(s.root):
            for n in names:
                p = os.path.join(dirpath, n)
                if os.path.exists(p) and not os.path.isfile(p) and not os.path.islink(p):
                    try:
                        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                    except OSError:
                        pass
        pytest.fail(f"the startup scan was still blocked after {seconds} s")
    if err:
        raise err[0]


def ns_dir(root: str, ns: str = "") -> str:
    d = os.path.join(root, INFO.config_fingerprint, ns_folder(ns))
    os.makedirs(d, exist_ok=True)
    return d


def good_entry(root: str, tokens=A) -> str:
    path = os.path.join(ns_dir(root), entry_id(np.asarray(tokens), "") + ".kv")
    kvfile.save(
        RealDisk(),
        path,
        kvfile.KvMeta(
            model_id=INFO.model_id, config_fingerprint=INFO.config_fingerprint, tokenizer_hash=INFO.tokenizer_hash
        ),
        tokens,
        feed(tokens),
    )
    return path


def forged(path: str, body: bytes, *, header_len: int | None = None, size: int | None = None) -> None:
    """A file whose preamble is valid for ``body`` (magic, version, hash):
    only what the header says is hostile."""
    n = len(body) if header_len is None else header_len
    pre = kvfile.PREAMBLE.pack(
        kvfile.MAGIC, kvfile.FORMAT_VERSION, 0, n, kvfile.align_up(kvfile.PREAMBLE.size + n), kvfile._u64_hash(body)
    )
    with open(path, "wb") as f:
        f.write(pre + body)
        if size is not None:
            f.truncate(size)  # sparse: no blocks behind the declared sizes


def rewrite_header(path: str, edit) -> None:
    """Decode an entry's header, let ``edit`` change it, write it back with a valid hash."""
    with open(path, "rb") as f:
        raw = f.read()
    _, _, _, hlen, start, _ = kvfile.PREAMBLE.unpack_from(raw)
    header = msgspec.json.decode(raw[kvfile.PREAMBLE.size : kvfile.PREAMBLE.size + hlen], type=kvfile.KvHeader)
    edit(header)
    body = msgspec.json.encode(header)
    assert kvfile.align_up(kvfile.PREAMBLE.size + len(body)) == start, "the edit must keep the data start"
    pre = kvfile.PREAMBLE.pack(kvfile.MAGIC, kvfile.FORMAT_VERSION, 0, len(body), start, kvfile._u64_hash(body))
    with open(path, "wb") as f:
        f.write(pre + body + raw[kvfile.PREAMBLE.size + len(body) :])


# ---------------------------------------------------------------------------


def test_a_fifo_named_kv_does_not_block_startup_and_is_left_alone(tmp_path):
    root = str(tmp_path)
    keep = good_entry(root)
    fifo = os.path.join(ns_dir(root), "f" * 24 + ".kv")
    os.mkfifo(fifo)
    top_fifo = os.path.join(root, INFO.config_fingerprint, "top.tmp")
    os.mkfifo(top_fifo)
    s = store(root)
    recover_within(s)
    assert len(s) == 1 and s.counters["skipped"] == 2
    assert os.path.exists(fifo) and os.path.exists(top_fifo) and os.path.exists(keep)


def test_a_symlink_to_a_device_or_a_fifo_is_never_opened(tmp_path):
    root = str(tmp_path)
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.mkdir()
    os.mkfifo(outside / "pipe")
    d = ns_dir(root)
    os.symlink("/dev/zero", os.path.join(d, "a" * 24 + ".kv"))
    os.symlink(outside / "pipe", os.path.join(d, "b" * 24 + ".kv"))
    s = store(root)
    recover_within(s)
    assert len(s) == 0 and s.counters["skipped"] == 2 and s.counters["corrupt_deleted"] == 0
    assert sorted(os.listdir(d)) == ["a" * 24 + ".kv", "b" * 24 + ".kv"]  # links are not ours to delete


def test_a_symlinked_folder_is_not_followed_and_files_outside_survive(tmp_path):
    root = str(tmp_path / "cache")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "decoy.kv").write_bytes(b"not a kv file")
    (outside / "decoy.kv.tmp").write_bytes(b"half a write")
    fp = os.path.join(root, INFO.config_fingerprint)
    os.makedirs(fp)
    os.symlink(outside, os.path.join(fp, "base"))
    s = store(root)
    recover_within(s)
    assert sorted(os.listdir(outside)) == ["decoy.kv", "decoy.kv.tmp"]
    assert s.counters["corrupt_deleted"] == 0 and s.counters["tmp_reaped"] == 0 and s.counters["skipped"] == 1


def test_a_kv_symlink_to_a_valid_entry_elsewhere_is_not_served(tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    target = good_entry(elsewhere)
    root = str(tmp_path / "cache")
    link = os.path.join(ns_dir(root), os.path.basename(target))
    os.symlink(target, link)
    s = store(root)
    recover_within(s)
    assert len(s) == 0 and s.find(A + [1], "") == (None, 0)
    assert os.path.exists(target) and os.path.islink(link)
    # and a restore path that meets a link (planted after the scan) refuses to open it
    with pytest.raises(OSError):
        kvfile.KvReader(RealDisk(), link)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"this is not JSON, but its hash is valid", id="not-json"),
        pytest.param(b'{"format_version":1,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="100k-deep"),
        pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="100k-deep-objects"),
        pytest.param(
            b'{"format_version":1,"created_at":0,"model_id":"m","config_fingerprint":"f","ns":"","tokenizer_hash":"t","tokens":[99999999999999999999],"layers":[]}',
            id="token-overflow",
        ),
    ],
)
def test_a_hash_valid_header_that_does_not_decode_is_deleted_and_startup_goes_on(tmp_path, body):
    root = str(tmp_path)
    keep = good_entry(root)
    bad = os.path.join(ns_dir(root), "c" * 24 + ".kv")
    forged(bad, body)
    s = store(root)
    recover_within(s)
    assert len(s) == 1 and s.counters["corrupt_deleted"] == 1
    assert not os.path.exists(bad) and os.path.exists(keep)


def test_a_header_listing_more_tokens_than_its_kv_holds_is_corrupt(tmp_path):
    root = str(tmp_path)
    path = good_entry(root)

    def longer(h: kvfile.KvHeader) -> None:
        h.tokens = h.tokens + [7] * 5  # the KV still holds 40

    rewrite_header(path, longer)
    s = store(root)
    recover_within(s)
    assert len(s) == 0 and s.counters["corrupt_deleted"] == 1 and not os.path.exists(path)


def test_tensor_bytes_that_disagree_with_shape_times_dtype_are_corrupt(tmp_path):
    root = str(tmp_path)
    path = good_entry(root)

    def lie(h: kvfile.KvHeader) -> None:
        h.layers[0].tensors[0].bytes -= 4  # fewer bytes than the shape holds

    rewrite_header(path, lie)
    with pytest.raises(kvfile.CorruptFile, match="bytes for shape"):
        kvfile.read_header(RealDisk(), path)


def test_a_header_longer_than_the_context_is_corrupt(tmp_path):
    root = str(tmp_path)
    path = good_entry(root)
    s = store(root, max_tokens=len(A) - 1)
    recover_within(s)
    assert len(s) == 0 and s.counters["corrupt_deleted"] == 1 and not os.path.exists(path)


def test_huge_declared_sizes_in_a_sparse_file_allocate_nothing(tmp_path):
    """A 600 MiB sparse file declaring a 512 MiB header, and one whose valid
    header declares a 1 GiB tensor inside a 1 GiB sparse file: both are
    rejected from their declared sizes, before anything that large is read."""
    root = str(tmp_path)
    d = ns_dir(root)
    big_header = os.path.join(d, "d" * 24 + ".kv")
    forged(big_header, b"{}", header_len=512 << 20, size=600 << 20)
    # valid header hash, tensor slot declaring 1 GiB with a matching shape
    huge_tensor = os.path.join(d, "e" * 24 + ".kv")
    slot = {
        "off": 0,
        "bytes": 1 << 30,
        "shape": [1, 1, len(A), (1 << 30) // (4 * len(A))],
        "dtype": "float32",
        "hash": "0" * 16,
    }
    slot["bytes"] = int(np.prod(slot["shape"])) * 4
    header = {
        "format_version": 1,
        "created_at": 0.0,
        "model_id": INFO.model_id,
        "config_fingerprint": INFO.config_fingerprint,
        "ns": "",
        "tokenizer_hash": INFO.tokenizer_hash,
        "tokens": A,
        "layers": [
            {"kind": "FakeKVCache", "offset": len(A), "tensors": [slot, dict(slot, off=kvfile.align_up(slot["bytes"]))]}
        ],
    }
    body = msgspec.json.encode(header)
    forged(
        huge_tensor, body, size=kvfile.align_up(kvfile.PREAMBLE.size + len(body)) + 2 * kvfile.align_up(slot["bytes"])
    )
    s = store(root, max_bytes=256 << 20)
    tracemalloc.start()
    try:
        recover_within(s)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak traced allocation during the scan: {peak / 2**20:.1f} MiB")
    assert peak < 64 << 20
    assert len(s) == 0 and s.counters["corrupt_deleted"] == 2
    assert not os.path.exists(big_header) and not os.path.exists(huge_tensor)


def test_restore_revalidates_a_file_swapped_after_the_scan(tmp_path):
    """The index came from a good file; a FIFO that took its name since is
    neither opened blocking nor deleted: a miss."""
    import anyio

    from actors.cold_tier import ColdTier
    from engine.ports import InlineDevice, LoopClock, run_inline

    root = str(tmp_path)
    path = good_entry(root)
    s = store(root)
    recover_within(s)
    assert len(s) == 1
    os.unlink(path)
    os.mkfifo(path)
    clock = LoopClock()
    t = ColdTier(s, BE, InlineDevice(clock), clock, io=run_inline)
    try:
        got = anyio.run(lambda: t.restore(A + [1], ""))
    finally:
        t._inbox_send.close()
        t._inbox_recv.close()
    assert got == (None, 0) and os.path.exists(path) and len(s) == 0


def test_preamble_layout_unchanged():
    # the forged files above rely on it
    assert kvfile.PREAMBLE.size == 28 and struct.calcsize("<8sHHIIQ") == 28
