"""The SSD tier of a distributed engine: every rank persists its own shard.

``ember serve --distributed tensor|pipeline --ssd-cache DIR``: each rank's KV
cache is its shard of the model's (tensor: its KV heads; pipeline: its
layers), so each rank keeps its own files, under ``DIR/rank{r}of{n}/`` with
the single-process layout (``actors.cold_tier``) inside. Rank 0's
``DistributedColdTier`` decides, as the single-process ``ColdTier`` does
(its index, its byte cap, its gate); the files are written and read by every
rank together, on each rank's MLX thread, in the order rank 0 sends them:

* a write (``PersistOp``: the RAM entry's name, its tokens, namespace and
  time) goes on the wire like a step plan; every rank writes its shard of
  the entry of that name (``TrackedCache``: every rank holds it) and fsyncs
  it, then all ranks agree (``RankLink.agree``, an ``all_sum`` of failures).
  The write counts, and a flush reports it durable, only when every rank's
  file is durable; otherwise every rank deletes its file of the entry.
* a restore (``RestoreOp``: the entry's tokens, the prefix to keep, a fresh
  negative name) is decided by rank 0's index; every rank reads, verifies,
  decodes and trims its own file, then all agree. Only when every rank holds
  a valid copy does every rank keep the restored cache (rank 0 hands it to
  the Scheduler as a ``TrackedCache`` of that name; the follower keeps its
  own under the name until the plan that opens the row takes it). A missing,
  truncated or foreign file on any rank is a miss on every rank, and every
  rank deletes its file of that entry: never a step on different caches.

Each rank enforces the byte cap on its own folder with its own index, by
least recent use; the ranks see the same writes and restores, so they evict
alike, and an entry one rank evicted alone is a miss (above), never a wrong
token. The write is one job on rank 0's MLX thread (no step runs meanwhile):
the tier's gate (the engine idle, unless a flush) is awaited once before it,
not before every tensor as in one process, since every rank's write must
happen between the same two steps.
"""

from __future__ import annotations

import logging
import os
import posixpath
import weakref
from typing import Any

import msgspec
import numpy as np

from actors.cold_tier import ColdTier
from engine.kv import kvfile
from engine.kv.cold_store import ColdStore
from engine.kv.kvfile import KvReader, KvWriter
from engine.kv.prompt_cache import as_tokens

log = logging.getLogger("ember.distributed_tier")


class PersistOp(msgspec.Struct, frozen=True, tag=True):
    name: int  # the RAM entry (``TrackedCache.origin``) every rank holds
    tokens: list[int]
    ns: str
    created_at: float


class RestoreOp(msgspec.Struct, frozen=True, tag=True):
    name: int  # < 0: what the restored cache is called until a plan opens a row with it
    tokens: list[int]  # the entry's tokens (its file's name and header)
    ns: str
    keep: int  # the prefix to keep: the rest is trimmed


TierOp = PersistOp | RestoreOp
encode_op = msgspec.msgpack.Encoder().encode
decode_op = msgspec.msgpack.Decoder(TierOp).decode


def rank_root(root: str, rank: int, size: int) -> str:
    """Rank ``rank``'s folder: its shard's files are its own, and a different
    number of ranks shards differently."""
    return os.path.join(os.path.abspath(os.path.expanduser(root)), f"rank{rank}of{size}")


def rank_store(root: str, info: Any, *, rank: int, size: int, max_bytes: int, verify: bool) -> ColdStore:
    from engine.kv.disk import RealDisk

    return ColdStore(
        RealDisk(),
        rank_root(root, rank, size),
        model_id=info.model_id,
        config_fingerprint=info.config_fingerprint,
        tokenizer_hash=info.tokenizer_hash,
        max_bytes=max_bytes,
        verify=verify,
        max_tokens=info.context_length,
    )


# ---------------------------------------------------------------------------
# What every rank does with its own files (synchronous, on its MLX thread).


def prepare_write(store: ColdStore, op: PersistOp, cache: Any) -> tuple[KvWriter, list[Any]] | None:
    """The writer of this rank's file of the entry and its tensors (nothing
    written yet; the file's size is known), or None if the cache cannot be encoded."""
    try:
        layers, sources = kvfile.encode_layers(cache)
        arr = as_tokens(op.tokens)
        header = kvfile.make_header(store.meta_for(op.ns), arr, layers, op.created_at)
        return KvWriter(store.disk, store.path_for(arr, op.ns), header), sources
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be encoded: this rank fails the write
        log.warning("[distributed_tier] cannot persist this cache: %r", exc)
        return None


def commit_write(store: ColdStore, writer: KvWriter, sources: list[Any]) -> bool:
    """Write and fsync the file (room already reserved); False (no ``.tmp``
    left) if it failed. The index is not told: see ``settle_write``."""
    try:
        store.disk.makedirs(posixpath.dirname(writer.path))
        writer.open()
        for i, src in enumerate(sources):
            writer.write(i, src.materialize())
        writer.commit()
    except Exception as exc:  # noqa: BLE001 - I/O, a full disk, a codec: this rank's write failed
        writer.abort()
        store.counters["write_failures"] += 1
        log.warning("[distributed_tier] write of %s failed: %r", writer.path, exc)
        return False
    return True


def settle_write(store: ColdStore, writer: KvWriter, mine_ok: bool, agreed: bool) -> list[Any]:
    """After the ranks agreed (the room ``writer`` reserved is released):
    index this rank's file, returning the entries it superseded (their files
    are to be deleted), or, if some rank failed, delete it."""
    store.release(writer.file_bytes)
    if not agreed:
        _drop(store, writer.path)  # also an older file of the same key: it may not be on every rank now
        return []
    store.counters["spills"] += 1
    return store.indexed(writer.path, writer.header, writer.file_bytes, as_tokens(writer.header.tokens))


def _drop(store: ColdStore, path: str) -> None:
    e = next((e for e in store.entries() if e.path == path), None)
    if e is not None:
        store.forget(e)
    store.delete_files([path])


def read_shard(store: ColdStore, op: RestoreOp) -> list[Any]:
    """This rank's cache of the entry, trimmed to ``op.keep``; raises on any fault."""
    arr = as_tokens(op.tokens)
    path = store.path_for(arr, op.ns)
    reader = KvReader(store.disk, path, verify=store.verify, max_tokens=store.max_tokens, entry=True)
    header = reader.header
    if not header.matches(store.meta_for(op.ns)) or not np.array_equal(as_tokens(header.tokens), arr):
        raise kvfile.IncompatibleFile(f"{path}: not this entry's file")
    layers = [kvfile.decode_layer(lh, reader.read_layer(i)) for i, lh in enumerate(header.layers)]
    excess = arr.size - op.keep
    if excess < 0 or (excess and _trim(layers, excess) != excess):
        raise kvfile.IncompatibleFile(f"{path}: could not trim {excess} tokens")
    return layers


def _trim(cache: list[Any], n: int) -> int:
    from mlx_lm.models.cache import trim_prompt_cache

    return trim_prompt_cache(cache, n)


def settle_restore(store: ColdStore, op: RestoreOp, mine_ok: bool, agreed: bool) -> None:
    """After the ranks agreed on a restore: recency, or every rank deletes its file."""
    arr = as_tokens(op.tokens)
    path = store.path_for(arr, op.ns)
    if agreed:
        e = next((e for e in store.entries() if e.path == path), None)
        if e is not None:
            store.used(e)
        store.touch(path)
        return
    if not mine_ok:
        store.counters["corrupt_deleted"] += 1
    _drop(store, path)


# ---------------------------------------------------------------------------
# Ranks 1..N-1: ``run_follower`` hands each tier message here.


def follower_tier(config: Any, backend: Any, link: Any) -> FollowerTier:
    """This follower's side of the SSD tier (``run_follower``'s ``make_tier``)."""
    store = None
    if config.ssd_cache_dir:
        grp = link.group
        store = rank_store(
            config.ssd_cache_dir,
            backend.info,
            rank=grp.rank(),
            size=grp.size(),
            max_bytes=int(config.ssd_cache_max_gib * (1 << 30)),
            verify=config.ssd_cache_verify,
        )
    return FollowerTier(store, link)


class FollowerTier:
    """A follower's side of the tier: its store (None without ``--ssd-cache``:
    it then fails every write and restore, which makes them misses on every rank)."""

    def __init__(self, store: ColdStore | None, link: Any):
        self.store = store
        self.link = link
        if store is not None:
            store.recover()  # reap temps, delete corrupt files, index the rest, trim to the cap

    def handle(self, data: bytes, stored: dict[int, Any]) -> None:
        op = decode_op(data)
        store = self.store
        if isinstance(op, PersistOp):
            cache = stored.get(op.name)  # always held (rank 0 keeps it alive until written); else fail
            prepared = prepare_write(store, op, cache) if store is not None and cache is not None else None
            ok = False
            if store is not None and prepared is not None:
                writer, sources = prepared
                victims = store.reserve(writer.path, writer.file_bytes)
                if victims is None:  # over this rank's cap
                    prepared = None
                else:
                    store.delete_files([v.path for v in victims])
                    ok = commit_write(store, writer, sources)
            agreed = self.link.agree(ok)
            if store is not None and prepared is not None:
                store.delete_files([g.path for g in settle_write(store, prepared[0], ok, agreed)])
            elif store is not None:
                _drop(store, store.path_for(as_tokens(op.tokens), op.ns))
            return
        layers = None
        if store is not None:
            try:
                layers = read_shard(store, op)
            except Exception as exc:  # noqa: BLE001 - missing, truncated, foreign: a miss on every rank
                log.warning("[distributed_tier] restore of my shard failed: %r", exc)
        agreed = self.link.agree(layers is not None)
        if store is not None:
            settle_restore(store, op, layers is not None, agreed)
        if agreed:
            stored[op.name] = layers


# ---------------------------------------------------------------------------
# Rank 0.


class DistributedColdTier(ColdTier):
    """Rank 0's ``ColdTier``: the same decisions, every rank's files (module docstring).

    ``backend`` is the ``LeaderBackend``: its link reaches the followers, and a
    restored cache becomes a ``TrackedCache`` whose drop it sends."""

    def __init__(self, store: ColdStore, backend: Any, *args: Any, **kw: Any):
        super().__init__(store, backend, *args, **kw)
        self.leader = backend  # the LeaderBackend (``self.backend`` is typed as any Backend)
        self._restore_names = 0
        for key in ("unshared", "shard_misses", "shard_write_failures"):
            store.counters.setdefault(key, 0)

    # ---- writes --------------------------------------------------------------------
    async def store_entry(self, tokens: list[int], ns: str, cache: Any, *, wait_turn: Any = None) -> bool:
        from engine.mlx.distributed import TrackedCache

        store = self.store
        if not isinstance(cache, TrackedCache):  # not an entry every rank holds: never a lone shard on disk
            store.counters["unshared"] += 1
            return False
        try:
            if wait_turn is not None:
                await wait_turn()
        except Exception:  # noqa: BLE001 - scheduling advice gone wrong; write anyway (kvfile._gate)
            pass
        op = PersistOp(cache.origin, list(tokens), ns, self.files.wall())
        prepared = await self.files.device.run(prepare_write, store, op, cache)
        if prepared is None:  # nothing sent: no rank writes
            store.counters["write_failures"] += 1
            return False
        writer, sources = prepared
        victims = store.reserve(writer.path, writer.file_bytes)
        if victims is None:
            log.warning("[distributed_tier] entry of %d bytes exceeds the cap: not stored", writer.file_bytes)
            return False
        try:
            if victims:
                await self.io(store.delete_files, [v.path for v in victims])
            ok, agreed = await self.files.device.run(self._persist, op, writer, sources)
        except Exception as exc:  # the group failed (the engine is dead) or a bug: not durable
            store.release(writer.file_bytes)
            log.warning("[distributed_tier] write failed: %r", exc)
            return False
        gone = settle_write(store, writer, ok, agreed)
        if gone:
            await self.io(store.delete_files, [g.path for g in gone])
        if ok and not agreed:
            store.counters["shard_write_failures"] += 1  # another rank's write failed
        return agreed

    def _persist(self, op: PersistOp, writer: KvWriter, sources: list[Any]) -> tuple[bool, bool]:
        """On rank 0's MLX thread: every rank writes its shard, then all agree."""
        self._send(op)
        ok = commit_write(self.store, writer, sources)
        return ok, self._agree(ok)

    # ---- restores ------------------------------------------------------------------
    async def restore(self, tokens: list[int], ns: str, *, min_len: int = 0) -> tuple[Any, int]:
        store = self.store
        entry, p = store.find(tokens, ns)
        if entry is None or p <= min_len:
            store.counters["misses"] += 1
            return None, 0
        self._restore_names += 1
        op = RestoreOp(-self._restore_names, entry.tokens.tolist(), ns, p)
        t0 = self.clock.now()
        try:
            cache, mine_ok = await self.files.device.run(self._restore_all, op)
        except Exception as exc:  # the group failed (the engine is dead) or a bug: a miss
            log.warning("[distributed_tier] restore failed: %r", exc)
            return None, 0
        if cache is None:
            if store.forget(entry):  # every rank deletes its file of the entry
                store.counters["corrupt_deleted" if not mine_ok else "shard_misses"] += 1
                await self.io(store.delete_files, [entry.path])
            store.counters["misses"] += 1
            return None, 0
        store.used(entry)
        await self.io(store.touch, entry.path)
        store.counters["restores"] += 1
        store.restore_ms_last = round((self.clock.now() - t0) * 1000.0, 3)
        return cache, p

    def _restore_all(self, op: RestoreOp) -> tuple[Any, bool]:
        """On rank 0's MLX thread: every rank reads its shard, then all agree.
        Touches no index state (the loop's lookups read it meanwhile)."""
        from engine.mlx.distributed import TrackedCache

        self._send(op)
        layers = None
        try:
            layers = read_shard(self.store, op)
        except Exception as exc:  # noqa: BLE001 - a miss on every rank
            log.warning("[distributed_tier] restore of rank 0's shard failed: %r", exc)
        agreed = self._agree(layers is not None)
        if layers is None or not agreed:
            return None, layers is not None
        tracked = TrackedCache(layers)
        tracked.origin = op.name
        weakref.finalize(tracked, self.leader._dropped.append, op.name)
        return tracked, True

    # ---- the wire ------------------------------------------------------------------
    def _send(self, op: TierOp) -> None:
        try:
            self.leader.link.send(encode_op(op), tier=True)
        except RuntimeError as exc:
            self.leader._lose(exc)
            raise

    def _agree(self, ok: bool) -> bool:
        try:
            return self.leader.link.agree(ok)
        except RuntimeError as exc:
            self.leader._lose(exc)
            raise
