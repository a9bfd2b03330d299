"""The SSD cold tier: the ColdStore index (engine.kv.cold_store), entry writes
and restores (engine.kv.cold_io) and the ColdTier actor (actors.cold_tier),
over a real folder and over the fault-injecting in-memory disk.

Oracles: a restored cache holds exactly the KV a fresh prefill of the served
prefix produces (the fake GPU's KV is a pure function of the tokens); every
fault is a miss and a deleted file, never an error.
"""

from __future__ import annotations

import logging
import os

import anyio
import mlx.core as mx
import numpy as np
import pytest
from anyio import wait_all_tasks_blocked
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from actors.cold_tier import ColdTier, Demoted, Restore, Store
from actors.events import EngineBusy, EngineIdle
from actors.runtime import ActorRef, inbox
from actors.scheduler import Demote, Restored
from engine.errors import EngineDead
from engine.fake.disk import FaultyDisk
from engine.fake.gpu import FakeBackend, FakeGPUConfig
from engine.fake.kv_cache import FakeKVCache
from engine.kv import kvfile
from engine.kv.cold_io import layer_groups, ungated
from engine.kv.cold_store import ColdEntry, ColdStore, entry_id, ns_folder
from engine.kv.disk import RealDisk
from engine.ports import InlineDevice, LoopClock, ModelInfo, run_inline

BE = FakeBackend()
A = list(range(10, 50))  # 40 tokens


def feed(tokens: list[int]) -> list[FakeKVCache]:
    cache = BE.make_cache()
    BE._feed(cache, tokens)
    return cache


def same_kv(a, b) -> bool:
    return len(a) == len(b) and all(
        x.offset == y.offset
        and np.array_equal(x.keys[..., : x.offset, :], y.keys[..., : y.offset, :])
        and np.array_equal(x.values[..., : x.offset, :], y.values[..., : y.offset, :])
        for x, y in zip(a, b)
    )


class MlxCacheBackend:
    """The cache half of an MLX backend, on mlx-lm's own operations."""

    info = ModelInfo(
        model_id="mlx-stub",
        vocab_size=100,
        context_length=4096,
        config_fingerprint="fp-mlx",
        tokenizer_hash="tok",
        num_layers=1,
    )

    def cache_nbytes(self, cache):
        return kvfile.cache_bytes(cache)

    def trim_cache(self, cache, n):
        return trim_prompt_cache(cache, n)

    def cache_trimmable(self, cache):
        return can_trim_prompt_cache(cache)


@pytest.fixture(params=["real", "faulty"])
def disk_root(request, tmp_path):
    if request.param == "real":
        return RealDisk(), str(tmp_path)
    return FaultyDisk(seed=5), "/ssd"


_made: list[ColdTier] = []


@pytest.fixture(autouse=True)
def _close_inboxes():
    yield
    while _made:  # tiers driven by hand never ran their loop: close their inboxes
        t = _made.pop()
        t._inbox_send.close()
        t._inbox_recv.close()


def tier(
    disk, root, *, backend=BE, max_bytes=1 << 30, verify=False, scheduler=None, demote_idle_s=None, device=None
) -> ColdTier:
    info = backend.info
    store = ColdStore(
        disk,
        root,
        model_id=info.model_id,
        config_fingerprint=info.config_fingerprint,
        tokenizer_hash=info.tokenizer_hash,
        max_bytes=max_bytes,
        verify=verify,
    )
    clock = LoopClock()
    t = ColdTier(
        store,
        backend,
        device or InlineDevice(clock),
        clock,
        io=run_inline,
        scheduler=scheduler,
        demote_idle_s=demote_idle_s,
        wall=lambda: 1.0,
    )
    _made.append(t)
    return t


def scanned(t: ColdTier) -> ColdTier:
    t.store.recover()  # what ColdTier.started does, synchronously
    return t


def files(disk, root) -> list[str]:
    out = []
    for fp in disk.listdir(root):
        for ns in disk.listdir(os.path.join(root, fp)):
            sub = os.path.join(root, fp, ns)
            if disk.stat(sub).is_dir:
                out += [os.path.join(fp, ns, f) for f in disk.listdir(sub)]
    return sorted(out)


def entry_size(tokens=A) -> int:
    layers, _ = kvfile.encode_layers(feed(tokens))
    return kvfile.KvWriter(
        FaultyDisk(),
        "/x.kv",
        kvfile.make_header(kvfile.KvMeta(model_id="", config_fingerprint="", tokenizer_hash=""), tokens, layers, 0),
    ).file_bytes


# ---------------------------------------------------------------------------
# Store, restart, find, restore.


@pytest.mark.anyio
async def test_store_restart_find_restore(disk_root):
    disk, root = disk_root
    t = scanned(tier(disk, root))
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)
    assert await t.store_entry(A[:5] + [1, 2, 3], "", feed(A[:5] + [1, 2, 3]), wait_turn=ungated)

    t2 = scanned(tier(disk, root))  # a restart: the index comes from the headers
    assert len(t2.store) == 2
    prompt = A[:30] + [7, 7]
    entry, p = t2.store.find(prompt, "")
    assert p == 30 and entry.tokens.size == 40
    cache, n = await t2.restore(prompt, "")
    assert n == 30 and same_kv(cache, feed(A[:30]))  # the divergent tail was trimmed
    cache, n = await t2.restore(A, "")
    assert n == 39 and same_kv(cache, feed(A[:39]))  # an exact repeat leaves one token to feed
    assert cache[0].keys.shape[2] == 256  # landed in step capacity
    s = t2.stats()
    assert s["restores"] == 2 and s["entries"] == 2 and s["corrupt_deleted"] == 0 and s["restore_ms_last"] is not None


@pytest.mark.anyio
async def test_namespaces_are_isolated(disk_root):
    disk, root = disk_root
    t = scanned(tier(disk, root))
    assert await t.store_entry(A, "alice", feed(A), wait_turn=ungated)
    assert t.store.find(A, "bob") == (None, 0)
    assert await t.restore(A + [1], "bob") == (None, 0)
    assert (await t.restore(A + [1], "alice"))[1] == 40
    fp = BE.info.config_fingerprint
    assert files(disk, root) == [os.path.join(fp, ns_folder("alice"), entry_id(np.asarray(A), "alice") + ".kv")]
    assert ns_folder("") == "base"


@pytest.mark.anyio
async def test_scan_reaps_tmp_deletes_corrupt_and_foreign_identity_and_spares_other_fingerprints(disk_root):
    disk, root = disk_root
    t = scanned(tier(disk, root))
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)
    assert await t.store_entry(A[:3] + [9], "", feed(A[:3] + [9]), wait_turn=ungated)
    fp = BE.info.config_fingerprint
    base = os.path.join(root, fp, "base")
    good, bad = sorted(os.path.join(base, f) for f in disk.listdir(base))
    kvfile.read_header(disk, bad)
    fh = disk.open(bad)
    raw = bytearray(disk.read(fh, 0, 1 << 30))
    disk.close(fh)
    raw[25] ^= 0xFF  # inside the header-hash field
    fh = disk.open(bad, write=True)
    disk.write(fh, 0, raw)
    disk.fsync(fh)
    disk.close(fh)
    fh = disk.open(os.path.join(base, "dead.kv.tmp"), write=True)
    disk.write(fh, 0, b"half a write")
    disk.close(fh)
    other_model = kvfile.KvMeta(model_id="another-model", config_fingerprint=fp, tokenizer_hash=BE.info.tokenizer_hash)
    kvfile.save(disk, os.path.join(base, "foreign.kv"), other_model, A, feed(A))
    disk.makedirs(os.path.join(root, "other-fingerprint", "base"))
    kvfile.save(disk, os.path.join(root, "other-fingerprint", "base", "theirs.kv"), other_model, A, feed(A))
    fh = disk.open(os.path.join(root, "other-fingerprint", "base", "junk.tmp"), write=True)
    disk.close(fh)

    t2 = scanned(tier(disk, root))
    s = t2.stats()
    assert (s["entries"], s["corrupt_deleted"], s["mismatch_deleted"], s["tmp_reaped"]) == (1, 1, 1, 1)
    assert sorted(disk.listdir(base)) == [os.path.basename(good)]
    assert sorted(disk.listdir(os.path.join(root, "other-fingerprint", "base"))) == ["junk.tmp", "theirs.kv"]
    assert s["bytes"] == disk.stat(good).size


@pytest.mark.anyio
async def test_truncated_tensor_is_a_miss_and_the_file_goes(disk_root):
    disk, root = disk_root
    t = scanned(tier(disk, root))
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)
    (entry,) = t.store.entries()
    size = disk.stat(entry.path).size
    if isinstance(disk, FaultyDisk):
        disk.truncate(entry.path, size - 10)
    else:
        os.truncate(entry.path, size - 10)
    assert await t.restore(A + [1], "") == (None, 0)
    assert t.stats()["corrupt_deleted"] == 1 and len(t.store) == 0
    assert files(disk, root) == []
    assert await t.restore(A + [1], "") == (None, 0)  # and stays a plain miss


@pytest.mark.anyio
async def test_tensor_bit_rot_is_caught_under_verify():
    disk = FaultyDisk()
    t = scanned(tier(disk, "/ssd", verify=True))
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)
    (entry,) = t.store.entries()
    header, start = kvfile.read_header(disk, entry.path)
    disk.corrupt(entry.path, start + header.layers[1].tensors[0].off + 5)
    assert await t.restore(A, "") == (None, 0)
    assert t.stats()["corrupt_deleted"] == 1 and not disk.exists(entry.path)


@pytest.mark.anyio
@pytest.mark.parametrize("fault", [dict(bitflip_prob=1.0), dict(eio_prob=1.0)])
async def test_read_faults_are_misses(fault):
    disk = FaultyDisk(seed=2)
    t = scanned(tier(disk, "/ssd"))
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)
    for k, v in fault.items():
        setattr(disk, k, v)
    assert await t.restore(A, "") == (None, 0)
    assert t.stats()["corrupt_deleted"] == 1 and len(t.store) == 0


# ---------------------------------------------------------------------------
# Byte cap, supersede, ENOSPC.


@pytest.mark.anyio
async def test_cap_evicts_least_recently_used_and_order_survives_restart():
    disk = FaultyDisk()
    size = entry_size()
    t = scanned(tier(disk, "/ssd", max_bytes=int(2.5 * size)))
    x, y, z, w = ([k] + A[1:] for k in (1, 2, 3, 4))
    assert await t.store_entry(x, "", feed(x), wait_turn=ungated)
    assert await t.store_entry(y, "", feed(y), wait_turn=ungated)
    assert (await t.restore(x + [0], ""))[1] == 40  # x is now the most recently used
    assert await t.store_entry(z, "", feed(z), wait_turn=ungated)
    held = lambda tt: sorted(int(e.tokens[0]) for e in tt.store.entries())  # noqa: E731
    assert held(t) == [1, 3] and t.stats()["evictions"] == 1
    assert t.stats()["bytes"] <= t.stats()["max_bytes"]

    t2 = scanned(tier(disk, "/ssd", max_bytes=int(2.5 * size)))
    assert await t2.store_entry(w, "", feed(w), wait_turn=ungated)
    assert held(t2) == [3, 4]  # x was used before z was written


@pytest.mark.anyio
async def test_the_cap_counts_every_file_under_our_folder():
    disk = FaultyDisk()
    size = entry_size()
    root = "/ssd"
    fp = BE.info.config_fingerprint
    disk.makedirs(os.path.join(root, fp, "base"))
    fh = disk.open(os.path.join(root, fp, "base", "notes.txt"), write=True)
    disk.write(fh, 0, b"x" * size)
    disk.close(fh)
    t = scanned(tier(disk, root, max_bytes=int(2.5 * size)))
    assert t.stats()["bytes"] == size
    assert await t.store_entry([1] + A, "", feed([1] + A), wait_turn=ungated)
    assert await t.store_entry([2] + A, "", feed([2] + A), wait_turn=ungated)
    assert len(t.store) == 1 and t.stats()["bytes"] <= int(2.5 * size)


@pytest.mark.anyio
async def test_oversized_entry_is_refused():
    disk = FaultyDisk()
    t = scanned(tier(disk, "/ssd", max_bytes=entry_size() - 1))
    assert not await t.store_entry(A, "", feed(A), wait_turn=ungated)
    assert t.stats()["refused"] == 1 and files(disk, "/ssd") == []


@pytest.mark.anyio
async def test_supersede_and_exact_duplicates(disk_root):
    disk, root = disk_root
    t = scanned(tier(disk, root))
    assert await t.store_entry(A[:10], "", feed(A[:10]), wait_turn=ungated)
    assert await t.store_entry(A[:10], "other", feed(A[:10]), wait_turn=ungated)
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)  # trimmable: supersedes A[:10] in ""
    assert await t.store_entry(A, "", feed(A), wait_turn=ungated)  # exact duplicate: replaces the file
    assert len(t.store) == 2 and len(files(disk, root)) == 2
    assert t.stats()["superseded"] == 1


@pytest.mark.anyio
async def test_untrimmable_longer_entry_is_skipped_by_find_even_after_restart(disk_root):
    disk, root = disk_root
    be = MlxCacheBackend()
    t = scanned(tier(disk, root, backend=be))
    toks = list(range(30))
    mx.random.seed(0)
    plain = KVCache()
    plain.update_and_fetch(mx.random.normal((1, 2, 12, 8)), mx.random.normal((1, 2, 12, 8)))
    ring = RotatingKVCache(max_size=16, keep=2)
    ring.update_and_fetch(mx.random.normal((1, 2, 30, 8)), mx.random.normal((1, 2, 30, 8)))  # wrapped
    assert await t.store_entry(toks[:12], "", [plain], wait_turn=ungated)
    assert await t.store_entry(toks, "", [ring], wait_turn=ungated)  # untrimmable: leaves the prefix entry in place
    for tt in (t, scanned(tier(disk, root, backend=be))):
        assert len(tt.store) == 2
        entry, p = tt.store.find(toks[:20] + [99], "")
        assert p == 12 and entry.tokens.size == 12  # the ring would need a trim
        entry, p = tt.store.find(toks + [99], "")
        assert p == 30 and not entry.trimmable  # as a whole prefix the ring serves
        cache, n = await tt.restore(toks[:20] + [99], "")
        assert n == 12 and cache[0].offset == 12


@pytest.mark.anyio
async def test_disk_full_evicts_the_oldest_entries_and_the_write_succeeds():
    """A disk smaller than the cap: ENOSPC frees the least recently used
    entries and the write is retried, so flushes recover without an operator."""
    size = entry_size()
    disk = FaultyDisk(capacity_bytes=int(2.5 * size))
    t = scanned(tier(disk, "/ssd"))
    for k in (1, 2, 3, 4):
        assert await t.store_entry([k] + A[1:], "", feed([k] + A[1:]), wait_turn=ungated)
    s = t.stats()
    assert s["enospc"] == 2 and s["enospc_evictions"] == 2 and s["entries"] == 2
    assert not any(f.endswith(".tmp") for f in files(disk, "/ssd"))
    assert await t.restore([1] + A[1:] + [0], "") == (None, 0)  # the oldest went
    cache, n = await t.restore([4] + A[1:] + [0], "")
    assert n == 40 and same_kv(cache, feed([4] + A[1:]))


@pytest.mark.anyio
async def test_disk_full_of_other_data_drops_the_write_warns_once_and_keeps_serving(caplog):
    size = entry_size()
    disk = FaultyDisk(capacity_bytes=int(2.5 * size))
    fh = disk.open("/other-data", write=True)  # someone else's file: less than an entry is left
    disk.write(fh, 0, b"x" * int(1.6 * size))
    disk.close(fh)
    t = scanned(tier(disk, "/ssd"))
    with caplog.at_level(logging.WARNING, logger="ember.cold_tier"):
        assert not await t.store_entry([2] + A[1:], "", feed([2] + A[1:]), wait_turn=ungated)
        assert not await t.store_entry([3] + A[1:], "", feed([3] + A[1:]), wait_turn=ungated)
    assert t.stats()["enospc"] == 2 and t.stats()["entries"] == 0  # nothing of ours to evict
    assert await t.restore([2] + A[1:], "") == (None, 0)
    assert sum("dropping writes" in r.getMessage() for r in caplog.records) == 1
    assert not any(f.endswith(".tmp") for f in files(disk, "/ssd"))


# ---------------------------------------------------------------------------
# The actor: messages, the idle gate, durability, demotion timer.


@pytest.fixture
def capture():
    """A stand-in Scheduler inbox: what the tier tells it, in order."""
    send, recv = inbox(100)
    yield ActorRef("scheduler", send), recv
    send.close()
    recv.close()


def drain(recv) -> list:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait().msg)
        except anyio.WouldBlock:
            return out


@pytest.mark.anyio
async def test_store_ask_answers_once_durable_and_survives_a_crash():
    disk = FaultyDisk(seed=9)
    t = tier(disk, "/ssd")
    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        assert await t.ref.ask(Store(tokens=A, ns="", cache=feed(A), wait_turn=ungated)) is True
        t.stop()
    disk.crash()
    t2 = scanned(tier(disk, "/ssd"))
    cache, n = await t2.restore(A, "")
    assert n == 39 and same_kv(cache, feed(A[:39]))


@pytest.mark.anyio
async def test_restore_message_answers_restored_and_failures_are_misses(capture):
    disk = FaultyDisk()
    sched, inbox = capture
    t = tier(disk, "/ssd", scheduler=sched)
    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        assert await t.ref.ask(Store(tokens=A, ns="", cache=feed(A), wait_turn=ungated))
        t.ref.tell_nowait(Restore(rid=1, tokens=A[:20] + [3], ns="", min_len=0))
        t.ref.tell_nowait(Restore(rid=2, tokens=A[:20] + [3], ns="", min_len=20))  # RAM already has 20: not longer
        t.ref.tell_nowait(Restore(rid=3, tokens=A, ns="x"))
        await wait_all_tasks_blocked()
        got = {m.rid: m for m in drain(inbox)}
        assert isinstance(got[1], Restored) and got[1].cached == 20 and same_kv(got[1].cache, feed(A[:20]))
        assert (got[2].cache, got[2].cached) == (None, 0)
        assert (got[3].cache, got[3].cached) == (None, 0)
        (entry,) = t.store.entries()
        disk.truncate(entry.path, 100)
        t.ref.tell_nowait(Restore(rid=4, tokens=A, ns=""))
        await wait_all_tasks_blocked()
        (m,) = drain(inbox)
        assert (m.rid, m.cache, m.cached) == (4, None, 0) and t.stats()["corrupt_deleted"] == 1
        t.stop()


class BusyDevice:
    """A device thread busy with a decode step: each call waits until the step
    ends (``free``), as a call queued behind ``MLXThread``'s step does."""

    def __init__(self) -> None:
        self.free = anyio.Event()
        self.calls = 0

    async def run(self, fn, *args, cost_s: float = 0.0):
        self.calls += 1
        await self.free.wait()
        return fn(*args)


@pytest.mark.anyio
async def test_restores_queued_together_wait_for_one_device_step_not_one_per_layer_each(capture):
    """Each hop onto the device waits for the step in progress there. A restore
    that hopped once per layer, and restores taken one at a time, made eight warm
    prompts wait ~30 steps each in turn (SmolLM2: 2.2 s a 48-token restore under
    load, 8 streams at a third of the cold rate). Three restores of a
    many-layer entry must all reach the device before any step ends, one hop each."""
    be = FakeBackend(FakeGPUConfig(num_layers=8))

    def fed(tokens):
        cache = be.make_cache()
        be._feed(cache, tokens)
        return cache

    disk = FaultyDisk()
    sched, inbox = capture
    dev = BusyDevice()
    t = tier(disk, "/ssd", backend=be, scheduler=sched, device=dev)
    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        dev.free.set()
        assert await t.ref.ask(Store(tokens=A, ns="", cache=fed(A), wait_turn=ungated))
        dev.free, dev.calls = anyio.Event(), 0
        for rid in (1, 2, 3):
            t.ref.tell_nowait(Restore(rid=rid, tokens=A[: 20 + rid], ns="", min_len=0))
        await wait_all_tasks_blocked()
        assert dev.calls == 3 and not drain(inbox)  # all three waiting on the one step: one hop each
        dev.free.set()
        await wait_all_tasks_blocked()
        got = {m.rid: m for m in drain(inbox)}
        for rid in (1, 2, 3):
            n = 19 + rid  # all but the last token, which the row must feed
            assert got[rid].cached == n and same_kv(got[rid].cache, fed(A[:n]))
        t.stop()


def test_layer_groups_bound_the_bytes_of_a_hop():
    layers, _ = kvfile.encode_layers(feed(A))
    per = [sum(s.bytes for s in lh.tensors) for lh in layers]
    assert layer_groups(layers, 1 << 30) == [list(range(len(layers)))]
    for cap in (1, per[0], 2 * per[0] + 1, 3 * per[0]):
        groups = layer_groups(layers, cap)
        assert [i for g in groups for i in g] == list(range(len(layers)))  # every layer once, in order
        assert all(g and (len(g) == 1 or sum(per[i] for i in g) <= cap) for g in groups)


@pytest.mark.anyio
async def test_demotion_sweeps_on_idle_and_on_its_timer_until_busy(capture):
    sched, inbox = capture
    t = tier(FaultyDisk(), "/ssd", scheduler=sched, demote_idle_s=10.0)
    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        t.ref.tell_nowait(EngineIdle(at=anyio.current_time()))
        await wait_all_tasks_blocked()
        assert drain(inbox) == [Demote(idle_s=10.0)]
        t0 = anyio.current_time()
        t.ref.tell_nowait(Demoted(n=2, next_due=t0 + 7.0))
        await anyio.sleep(6.9)
        assert drain(inbox) == []
        await anyio.sleep(0.2)
        await wait_all_tasks_blocked()
        assert drain(inbox) == [Demote(idle_s=10.0)]
        t.ref.tell_nowait(Demoted(n=1, next_due=anyio.current_time() + 5.0))
        await wait_all_tasks_blocked()
        t.ref.tell_nowait(EngineBusy(at=anyio.current_time()))
        await anyio.sleep(20)
        assert drain(inbox) == []  # busy cancelled the timer
        assert t.stats()["demotions"] == 3
        t.stop()


@pytest.mark.anyio
async def test_a_crash_mid_write_leaves_nothing_behind_after_restart():
    disk = FaultyDisk(seed=4)
    t = tier(disk, "/ssd")
    held = anyio.Event()  # never set: the engine never goes idle again
    turns = []

    async def busy_turn():
        turns.append(1)
        if len(turns) > 1:  # the first tensor step is written, then the write waits
            await held.wait()

    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        assert await t.ref.ask(Store(tokens=A[:10], ns="", cache=feed(A[:10]), wait_turn=ungated))
        tg.start_soon(t.ref.ask, Store(tokens=A, ns="", cache=feed(A), wait_turn=busy_turn))
        await wait_all_tasks_blocked()
        assert len(turns) == 2 and any(f.endswith(".tmp") for f in files(disk, "/ssd"))
        disk.crash()  # the write is parked on its gate with its .tmp open
        tg.cancel_scope.cancel()
    t2 = scanned(tier(disk, "/ssd"))
    assert [e.tokens.size for e in t2.store.entries()] == [10]
    assert not any(f.endswith(".tmp") for f in files(disk, "/ssd"))


@pytest.mark.anyio
async def test_stopping_fails_the_store_asks_it_will_not_write():
    t = tier(FaultyDisk(), "/ssd")
    outcomes = []

    never = anyio.Event()

    async def busy_turn():  # the writes wait for idle, which never comes
        await never.wait()

    async def ask(tokens):
        try:
            outcomes.append(await t.ref.ask(Store(tokens=tokens, ns="", cache=feed(tokens), wait_turn=busy_turn)))
        except EngineDead as exc:
            outcomes.append(type(exc).__name__)

    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        tg.start_soon(ask, A)
        tg.start_soon(ask, A[:10])
        await wait_all_tasks_blocked()
        t.stop()
    assert outcomes == ["EngineDead", "EngineDead"]


@pytest.mark.anyio
@pytest.mark.parametrize("seed", range(8))
async def test_under_random_faults_a_restore_is_exact_or_a_miss(seed):
    """Stores, restores, crashes, restarts, truncation, ENOSPC and read errors
    in a seeded random order — plus bit rot and read bit flips when
    ``ssd_cache_verify`` is on (without it only the header is checked, the
    documented trade-off): every restore either misses or returns exactly the
    KV of the prefix it claims, and the cap always holds."""
    import random

    rng = random.Random(seed)
    disk = FaultyDisk(seed=seed, capacity_bytes=6 * entry_size())
    cap = 4 * entry_size()
    verify = seed % 2 == 0
    t = scanned(tier(disk, "/ssd", max_bytes=cap, verify=verify))
    stems = [[rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    hits = misses = 0
    for _ in range(60):
        op = rng.random()
        stem = rng.choice(stems)
        if op < 0.35:
            toks = stem + [rng.randrange(256) for _ in range(rng.randrange(0, 5))]
            await t.store_entry(toks, rng.choice(["", "x"]), feed(toks), wait_turn=ungated)
        elif op < 0.7:
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(256) for _ in range(rng.randrange(0, 4))]
            disk.eio_prob = 0.2 if rng.random() < 0.2 else 0.0
            disk.bitflip_prob = 0.2 if verify and rng.random() < 0.2 else 0.0
            cache, n = await t.restore(prompt, rng.choice(["", "x"]))
            disk.eio_prob = disk.bitflip_prob = 0.0
            if cache is not None:
                assert 0 < n < len(prompt) and same_kv(cache, feed(prompt[:n]))
                hits += 1
            else:
                misses += 1
        elif op < 0.8 and t.store.entries():
            e = rng.choice(t.store.entries())
            if rng.random() < 0.5 or not verify:
                disk.truncate(e.path, rng.randrange(disk.stat(e.path).size))
            else:
                disk.corrupt(e.path, rng.randrange(disk.stat(e.path).size))
        elif op < 0.9:
            disk.crash()
            t = scanned(tier(disk, "/ssd", max_bytes=cap, verify=verify))
        assert t.store.bytes <= cap
    # "exact or a miss" must not pass by always missing: restores hit, and faults made some miss
    assert hits > 0 and misses > 0, (hits, misses)
    # after the faults the tier still works: a fresh entry, with no fault, restores exactly
    disk.eio_prob = disk.bitflip_prob = 0.0
    toks = [7, 7, 7] + stems[0]
    await t.store_entry(toks, "", feed(toks), wait_turn=ungated)
    cache, n = await t.restore(toks + [1], "")
    assert cache is not None and n == len(toks) and same_kv(cache, feed(toks))


def test_faulty_disk_forgets_files_no_name_can_bring_back():
    """A long run without crashes must not keep every file it ever wrote, yet
    an unlink not made durable by a folder fsync still comes back at a crash."""
    disk = FaultyDisk(seed=0)
    disk.makedirs("/d")

    def put(path: str) -> None:
        fh = disk.open(path, write=True)
        disk.write(fh, 0, b"x" * 100)
        disk.fsync(fh)
        disk.close(fh)

    put("/d/keep")
    disk.fsync_dir("/d")
    for i in range(300):  # write, make durable, unlink, make the unlink durable
        put(f"/d/f{i}")
        disk.fsync_dir("/d")
        disk.unlink(f"/d/f{i}")
        disk.fsync_dir("/d")
    assert len(disk._inodes) < 100  # swept, not 301
    put("/d/late")
    disk.fsync_dir("/d")
    disk.unlink("/d/late")  # not durable: a crash brings the name back
    for i in range(200):
        disk.unlink(f"/d/g{i}") if disk.exists(f"/d/g{i}") else put(f"/d/g{i}")
    assert disk.listdir("/d") == sorted(["keep"] + [f"g{i}" for i in range(200)])
    disk.crash()
    assert disk.listdir("/d") == ["keep", "late"]
    fh = disk.open("/d/late")
    assert disk.read(fh, 0, 100) == b"x" * 100


@pytest.mark.parametrize("seed", range(3))
def test_faulty_disk_names_follow_the_folder_fsync_rules(seed):
    """Names against a two-dict model (volatile, durable): a folder fsync makes
    exactly that folder's current names durable, a crash brings back exactly
    the durable ones; creates, renames over names, unlinks in two folders."""
    import posixpath
    import random

    rng = random.Random(seed)
    disk = FaultyDisk(seed=seed)
    for d in ("/a", "/b"):
        disk.makedirs(d)
    vol: dict[str, int] = {}
    dur: dict[str, int] = {}
    names = [f"/{d}/{i}" for d in "ab" for i in range(6)]
    for step in range(400):
        op = rng.random()
        if op < 0.3:
            p = rng.choice(names)
            fh = disk.open(p, write=True)
            disk.write(fh, 0, bytes([step % 256]))
            disk.fsync(fh)
            disk.close(fh)
            vol.setdefault(p, step)
        elif op < 0.45 and vol:
            src, dst = rng.choice(sorted(vol)), rng.choice(names)
            if posixpath.dirname(src) == posixpath.dirname(dst) and src != dst:
                disk.rename(src, dst)
                vol[dst] = vol.pop(src)
        elif op < 0.6 and vol:
            p = rng.choice(sorted(vol))
            disk.unlink(p)
            del vol[p]
        elif op < 0.9:
            d = rng.choice(["/a", "/b"])
            disk.fsync_dir(d)
            dur = {k: v for k, v in dur.items() if posixpath.dirname(k) != d} | {
                k: v for k, v in vol.items() if posixpath.dirname(k) == d
            }
        else:
            disk.crash()
            vol = dict(dur)
        assert disk.files() == sorted(vol)
        for d in ("/a", "/b"):
            assert disk.listdir(d) == sorted(posixpath.basename(k) for k in vol if posixpath.dirname(k) == d)


@pytest.mark.anyio
async def test_store_now_writes_on_the_callers_task_or_queues_behind_the_tier_writer():
    disk = FaultyDisk(seed=11)
    t = tier(disk, "/ssd")
    gate = anyio.Event()
    turns = []

    async def held_turn():  # holds a queued Store's write at its first tensor step
        turns.append("spill")
        await gate.wait()

    async with anyio.create_task_group() as tg:
        await tg.start(t.run)
        # idle writer: the write runs here, durable when store_now returns
        assert await t.store_now(A, "", feed(A), ungated) is True
        assert t.store.holds(A, "") and t._in_flight is None
        # the writer busy with a Store ask: store_now queues behind it
        tg.start_soon(t.ref.ask, Store(tokens=A[:20], ns="", cache=feed(A[:20]), wait_turn=held_turn))
        while not turns:
            await anyio.sleep(0)
        done = []

        async def later():
            done.append(await t.store_now(A[:30], "", feed(A[:30]), ungated))

        tg.start_soon(later)
        for _ in range(5):
            await anyio.sleep(0)
        assert done == [] and len(t._jobs) == 2  # waiting its turn, not writing beside it
        gate.set()
        while not done:
            await anyio.sleep(0)
        assert done == [True]
        t.stop()
    with pytest.raises(EngineDead):
        await t.store_now(A, "", feed(A), ungated)


def test_the_durability_ports_holds_answers_as_the_index_does_under_adds_and_evictions():
    """ColdTierPort.holds keeps a "no" per token list and, once entries were
    indexed since, looks only at those (``ColdStore.added_since``): its
    answers must be the index's own through random adds, removals and a
    window of adds that outgrows what the store keeps."""
    import random

    from actors.cold_tier import ColdTierPort

    store = ColdStore(FaultyDisk(), "/c", model_id="m", config_fingerprint="f", tokenizer_hash="t", max_bytes=1 << 30)

    class Tier:
        pass

    tier = Tier()
    tier.store = store
    port = ColdTierPort(tier)  # type: ignore[arg-type]
    rng = random.Random(7)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(1, 6))] for _ in range(12)]
    keys = [(ns, s[:n]) for s in stems for n in range(1, len(s) + 1) for ns in ("", "b")]
    asked = [(list(t), ns) for ns, t in keys]  # fixed lists: the port caches by list identity
    paths = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.3:
            ns, t = rng.choice(keys)
            paths += 1
            store._add(ColdEntry(f"/c/{paths}", ns, np.asarray(t, np.int64), 1, rng.random() < 0.8, store._next_seq()))
        elif r < 0.45 and len(store):
            store.forget(rng.choice(store.entries()))
        else:
            tokens, ns = rng.choice(asked)
            assert port.holds(tokens, ns) == store.holds(tokens, ns), (step, tokens, ns)
    assert store.adds > 300  # past the kept window of adds at least once


def test_find_picks_what_a_scan_of_every_entry_picks():
    """ColdStore.find reads the prefix index's run (every entry of it serving
    the same prefix) instead of comparing each: the entry and length must be
    a full scan's (longest usable prefix, then least to trim, then most recent)."""
    import random

    from engine.kv.prompt_cache import usable_prefix

    rng = random.Random(11)
    store = ColdStore(FaultyDisk(), "/c", model_id="m", config_fingerprint="f", tokenizer_hash="t", max_bytes=1 << 30)
    stems = [[rng.randrange(3) for _ in range(rng.randrange(1, 9))] for _ in range(10)]
    for i in range(400):
        s = rng.choice(stems)
        t = s[: rng.randrange(1, len(s) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        ns = rng.choice(["", "x"])
        if rng.random() < 0.6:
            store._add(ColdEntry(f"/c/{i}", ns, np.asarray(t, np.int64), 1, rng.random() < 0.85, store._next_seq()))
        elif len(store) and rng.random() < 0.3:
            store.forget(rng.choice(store.entries()))
        prompt = rng.choice(stems)[: rng.randrange(1, 9)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        want, want_p = None, 0
        for e in store.entries():
            p = usable_prefix(e.tokens, e.trimmable, np.asarray(prompt, np.int64)) if e.ns == ns else 0
            if p > 0 and (
                want is None or (p, -(e.tokens.size - p), e.seq) > (want_p, -(want.tokens.size - want_p), want.seq)
            ):
                want, want_p = e, p
        got, got_p = store.find(prompt, ns)
        assert (got, got_p) == (want, want_p), (i, prompt, ns)
