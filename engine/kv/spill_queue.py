"""SpillQueue: the bounded, strictly serial line of KV caches waiting for SSD.

"Spill" here is any write to the SSD tier: write-behind snapshots, RAM
evictions and idle demotions all put an item on this line. Each item holds a
RAM entry's own cache object — never a copy: nothing writes an entry's cache
after it was stored, and an evicted entry's cache is no longer the RAM tier's
(docs/durability.md). Tensor writes only advance while the engine is idle, so
under sustained traffic the line can starve; without a bound, the evicted
caches it keeps alive would grow past the RAM tier's cap exactly under the
load that causes evictions. Here the queued bytes are capped: when a new item
takes the total over the cap, the OLDEST item that is neither being written
nor the one just added is dropped and its reference released at once. The
cap is soft — a single item bigger than the cap still goes through alone
rather than never spilling. A dropped spill is a future cache miss, never a
wrong token.

This is a plain class with no awaits (the DurabilityCoordinator drives it and
runs the one writer): ``push`` an item, ``pop_next`` the item to write when
the writer is free, ``finish`` it with the store's outcome. Every item's
cache is released exactly once, whatever path it leaves by: stored, failed,
dropped, or discarded at shutdown.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.transitions import IllegalTransition, check_transition


class ItemState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    STORED = "stored"
    FAILED = "failed"
    DROPPED = "dropped"
    DISCARDED = "discarded"  # still queued or in flight when the queue was closed


ITEM_TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    ItemState.QUEUED: frozenset({ItemState.IN_FLIGHT, ItemState.DROPPED, ItemState.DISCARDED}),
    ItemState.IN_FLIGHT: frozenset({ItemState.STORED, ItemState.FAILED, ItemState.DISCARDED}),
    ItemState.STORED: frozenset(),
    ItemState.FAILED: frozenset(),
    ItemState.DROPPED: frozenset(),
    ItemState.DISCARDED: frozenset(),
}


def _no_release(cache: Any) -> None:
    """A cache is freed by dropping the last reference (numpy and MLX alike)."""


@dataclass(eq=False, slots=True)
class SpillItem:
    """One entry on its way to SSD: the KV cache of ``tokens`` in namespace ``ns``.

    ``kind`` says who produced it (``snapshot``, ``evict``, ``demote``);
    ``release`` is called with the cache exactly once, when the item leaves.
    """

    ns: str
    tokens: list[int]
    cache: Any
    nbytes: int
    kind: str = "snapshot"
    release: Callable[[Any], None] = _no_release
    seq: int = 0
    state: ItemState = ItemState.QUEUED
    released: bool = field(default=False)
    _key: tuple[str, tuple[int, ...]] | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        if self._key is None:  # cached: ``tokens`` never changes once queued
            self._key = (self.ns, tuple(self.tokens))
        return self._key

    def move(self, to: ItemState) -> None:
        check_transition(ITEM_TRANSITIONS, self.state, to, f"spill item {self.seq}")
        self.state = to

    def free(self) -> None:
        """Release the cache; a second call is a bug (a double free of GPU memory)."""
        if self.released:
            raise IllegalTransition(f"spill item {self.seq} released twice")
        self.released = True
        cache, self.cache = self.cache, None
        self.release(cache)


class SpillQueue:
    """Queued bytes capped at ``cap_bytes``; one item in flight at a time."""

    def __init__(self, cap_bytes: int):
        if cap_bytes < 0:
            raise ValueError("the spill queue cap must be >= 0 bytes")
        self.cap_bytes = cap_bytes
        self.items: list[SpillItem] = []  # enqueue order; the in-flight item stays listed
        self.in_flight: SpillItem | None = None
        self.pending_bytes = 0
        self.dropped = 0
        self.failed = 0
        self.stored = 0
        self._seq = 0
        self.closed = False

    @property
    def pending(self) -> int:
        return len(self.items)

    @property
    def drained(self) -> bool:
        return not self.items

    def find(self, key: tuple[str, tuple[int, ...]]) -> SpillItem | None:
        """The newest pending item holding exactly ``key`` (ns, tokens)."""
        for item in reversed(self.items):
            if item.key == key:
                return item
        return None

    def push(self, item: SpillItem) -> list[SpillItem]:
        """Add ``item`` at the tail; return the items dropped to stay under the cap
        (already released)."""
        if self.closed:
            item.move(ItemState.DISCARDED)
            item.free()
            return [item]
        self._seq += 1
        item.seq = self._seq
        self.items.append(item)
        self.pending_bytes += item.nbytes
        dropped: list[SpillItem] = []
        while self.pending_bytes > self.cap_bytes:
            victim = next((i for i in self.items if i is not item and i is not self.in_flight), None)
            if victim is None:
                break  # soft cap: what is left is the new item and the one being written
            self._remove(victim, ItemState.DROPPED)
            self.dropped += 1
            dropped.append(victim)
        return dropped

    def pop_next(self) -> SpillItem | None:
        """The next item for the (single) writer, or None if one is already in
        flight or nothing is queued."""
        if self.in_flight is not None or not self.items:
            return None
        item = self.items[0]
        item.move(ItemState.IN_FLIGHT)
        self.in_flight = item
        return item

    def finish(self, item: SpillItem, ok: bool) -> None:
        """The writer finished ``item``: stored durably (``ok``) or failed."""
        if item is not self.in_flight:
            raise IllegalTransition(f"spill item {item.seq} finished but not in flight")
        self.in_flight = None
        if ok:
            self.stored += 1
        else:
            self.failed += 1
        self._remove(item, ItemState.STORED if ok else ItemState.FAILED)

    def close(self) -> list[SpillItem]:
        """Shutdown: discard (and release) everything still queued or in flight."""
        self.closed = True
        left = list(self.items)
        self.in_flight = None
        for item in left:
            self._remove(item, ItemState.DISCARDED)
        return left

    def _remove(self, item: SpillItem, to: ItemState) -> None:
        item.move(to)
        self.items.remove(item)
        self.pending_bytes -= item.nbytes
        item.free()

    def stats(self) -> dict[str, int]:
        return {
            "pending_spills": self.pending,
            "pending_spill_bytes": self.pending_bytes,
            "dropped_spills": self.dropped,
            "failed_spills": self.failed,
            "stored_spills": self.stored,
        }
