"""Moving one entry between a KV cache and its SSD file, for the cold tier.

``ColdIO.write`` streams a cache into a new file one tensor at a time,
awaiting the caller's ``wait_turn`` before every tensor step (the durability
coordinator's idle gate: no write competes with a GPU step), commits it
(rename + folder fsync) and indexes it. ``ColdIO.restore`` streams the file of
the longest usable prefix into fresh caches a group of layers at a time
(``RESTORE_HOP_BYTES``) and trims the divergent tail. Neither ever fails a request: a restore that meets a
truncated file, a hash mismatch or an I/O error deletes the file, counts
``corrupt_deleted`` and answers a miss; a write that fails is counted and
answers False.

ENOSPC (the disk filled below the byte cap) evicts the least recently used
entries holding as many bytes as the write and retries it once; if that cannot
help (no entries left) the write is dropped, a warning is logged once, and the
tier keeps serving.

Where work runs is a port too: file I/O goes through an ``IoRunner`` (``engine.ports``)
(``run_in_thread`` off the event loop, ``run_inline`` in virtual time, where no
thread may run) and tensor work through the engine's ``Device``.
"""

from __future__ import annotations

import errno
import logging
import posixpath
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from engine.kv import kvfile
from engine.kv.cold_store import ColdStore
from engine.kv.kvfile import KvReader, KvWriter
from engine.kv.prompt_cache import as_tokens
from engine.ports import Backend, Clock, Device, IoRunner

log = logging.getLogger("ember.cold_tier")

WaitTurn = Callable[[], Awaitable[None]]

# Tensor bytes a restore decodes per hop onto the device thread. A hop waits
# for the step in progress there, so one hop per layer made a restore wait
# ~30 decode steps while others were decoding: a 48-token SmolLM2 prompt took
# 2.2 s to restore and 8 streams of warm prompts ran at a third of the cold
# rate. A group bounds the bytes held twice (file buffers and MLX arrays).
RESTORE_HOP_BYTES = 64 << 20


def layer_groups(layers: list[Any], max_bytes: int) -> list[list[int]]:
    """Consecutive layer indices in groups of at most ``max_bytes`` of tensor
    bytes (a larger layer alone), none empty."""
    groups: list[list[int]] = []
    size = 0
    for i, lh in enumerate(layers):
        n = sum(slot.bytes for slot in lh.tensors)
        if not groups or size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def decode_layers(heads: list[Any], bufs: list[list[bytes]]) -> list[Any]:
    """``kvfile.decode_layer`` over a group, in one device hop."""
    return [kvfile.decode_layer(lh, b) for lh, b in zip(heads, bufs)]


async def ungated() -> None:
    """A ``wait_turn`` that never waits (a write that must not wait for idle)."""


class ColdIO:
    """Writes and restores of single entries against one ``ColdStore``."""

    def __init__(
        self,
        store: ColdStore,
        backend: Backend,
        device: Device,
        clock: Clock,
        *,
        io: IoRunner,
        wall: Callable[[], float],
    ):
        self.store = store
        self.backend = backend
        self.device = device
        self.clock = clock
        self.io = io
        self.wall = wall  # the file header's creation time (wall clock, not the engine's)
        self._warned_enospc = False

    async def write(self, tokens: list[int], ns: str, cache: Any, wait_turn: WaitTurn) -> bool:
        """Write one entry, awaiting ``wait_turn`` before every tensor step;
        True once it is durable (renamed, folder fsynced)."""
        store = self.store
        try:
            layers, sources = await self.device.run(kvfile.encode_layers, cache)
        except Exception as exc:
            log.warning("[cold_tier] cannot persist this cache: %r", exc)
            store.counters["write_failures"] += 1
            return False
        arr = as_tokens(tokens)  # once, for the header, the file name and the index
        header = kvfile.make_header(store.meta_for(ns), arr, layers, self.wall())
        path = store.path_for(arr, ns)
        writer = KvWriter(store.disk, path, header)
        victims = store.reserve(path, writer.file_bytes)
        if victims is None:
            log.warning(
                "[cold_tier] entry of %d bytes exceeds the cap of %d: not stored", writer.file_bytes, store.max_bytes
            )
            return False
        try:
            if victims:
                await self.io(store.delete_files, [v.path for v in victims])
            await self.io(store.disk.makedirs, posixpath.dirname(path))
            for attempt in (0, 1):
                try:
                    await kvfile.write_streamed(
                        writer, sources, wait_turn=wait_turn, device_run=self.device.run, io_run=self.io
                    )
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    store.counters["enospc"] += 1
                    # The disk filled below our cap (other data, a smaller
                    # volume): free the least recently used entries, as many
                    # bytes as this file, and try once more, so a full disk
                    # recovers instead of failing every flush until an
                    # operator frees space.
                    freed = store.evict_bytes(writer.file_bytes, keep=path) if attempt == 0 else []
                    if not freed:
                        raise
                    log.warning("[cold_tier] disk full: evicted %d entries to make room, retrying", len(freed))
                    await self.io(store.delete_files, [v.path for v in freed])
                    writer = KvWriter(store.disk, path, header)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                if not self._warned_enospc:
                    self._warned_enospc = True
                    log.warning("[cold_tier] disk full: dropping writes until space frees (%s)", exc)
            else:
                store.counters["write_failures"] += 1
                log.warning("[cold_tier] write of %s failed: %r", path, exc)
            return False
        except Exception as exc:  # a bug in a codec must not take serving down
            store.counters["write_failures"] += 1
            log.warning("[cold_tier] write of %s failed: %r", path, exc)
            return False
        finally:
            store.release(writer.file_bytes)
        gone = store.indexed(path, header, writer.file_bytes, arr)
        if gone:
            await self.io(store.delete_files, [g.path for g in gone])
        store.counters["spills"] += 1  # every entry written, whoever asked (mlx-bun's count)
        return True

    async def restore(self, tokens: list[int], ns: str, *, min_len: int = 0) -> tuple[Any, int]:
        """A fresh cache trimmed to the longest usable prefix longer than
        ``min_len``, and its length; ``(None, 0)`` on a miss or any failure."""
        store = self.store
        entry, p = store.find(tokens, ns)
        if entry is None or p <= min_len:
            store.counters["misses"] += 1
            return None, 0
        t0 = self.clock.now()
        try:
            reader = await self.io(
                lambda: KvReader(store.disk, entry.path, verify=store.verify, max_tokens=store.max_tokens, entry=True)
            )
            header = reader.header
            if not header.matches(store.meta_for(ns)) or not np.array_equal(as_tokens(header.tokens), entry.tokens):
                raise kvfile.IncompatibleFile(f"{entry.path}: header does not match the index")
            layers = []
            for group in layer_groups(header.layers, RESTORE_HOP_BYTES):
                bufs = await self.io(lambda g=group: [reader.read_layer(i) for i in g])
                heads = [header.layers[i] for i in group]
                layers.extend(await self.device.run(decode_layers, heads, bufs))
            excess = entry.tokens.size - p
            if excess and await self.device.run(self.backend.trim_cache, layers, excess) != excess:
                raise kvfile.IncompatibleFile(f"{entry.path}: could not trim {excess} tokens")
        except Exception as exc:
            if store.forget(entry):  # still ours (not evicted meanwhile): the file is bad
                store.counters["corrupt_deleted"] += 1
                log.warning("[cold_tier] restore of %s failed, deleting it: %r", entry.path, exc)
                await self.io(store.delete_files, [entry.path])
            store.counters["misses"] += 1
            return None, 0
        store.used(entry)
        await self.io(store.touch, entry.path)
        store.counters["restores"] += 1
        store.restore_ms_last = round((self.clock.now() - t0) * 1000.0, 3)
        return layers, p
