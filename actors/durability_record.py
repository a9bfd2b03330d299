"""The durability coordinator's per-key record: an enum plus a transition
table (h11's ``_state.py`` style); an illegal move raises ``IllegalTransition``.

A key is a namespace plus the exact token sequence of a RAM entry, so two
conversations of the same length never cancel each other. The table is the
one in docs/durability.md ("Per-key record").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.kv.prompt_cache import token_bytes
from engine.kv.spill_queue import SpillItem
from engine.transitions import check_transition


class RecState(enum.Enum):
    ARMED = "armed"  # debounce timer running
    BUSY_REARMED = "busy_rearmed"  # the timer fired while busy; retry timer running
    SNAPSHOTTING = "snapshotting"  # Snapshot asked of the Scheduler
    QUEUED = "queued"  # the entry's cache is on the spill queue
    STORING = "storing"  # the cold tier is writing it
    FAILED = "failed"  # dropped or store failed: dirty, retryable
    COVERED = "covered"  # superseded in RAM by a longer entry whose record is still dirty
    DURABLE = "durable"  # on SSD (renamed + dir fsynced): the record retires
    MISSING = "missing"  # gone from RAM and not on SSD: the record retires


ATTEMPTABLE = frozenset({RecState.ARMED, RecState.BUSY_REARMED, RecState.FAILED})
IN_FLIGHT = frozenset({RecState.SNAPSHOTTING, RecState.QUEUED, RecState.STORING})

REC_TRANSITIONS: dict[RecState, frozenset[RecState]] = {
    # a spill of the same entry (eviction) can carry a dirty key straight to the queue
    RecState.ARMED: frozenset(
        {RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}
    ),
    RecState.BUSY_REARMED: frozenset(
        {RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}
    ),
    RecState.FAILED: frozenset(
        {RecState.ARMED, RecState.BUSY_REARMED, RecState.SNAPSHOTTING, RecState.QUEUED, RecState.DURABLE}
    ),
    RecState.SNAPSHOTTING: frozenset(
        {RecState.QUEUED, RecState.STORING, RecState.DURABLE, RecState.MISSING, RecState.FAILED, RecState.COVERED}
    ),
    # the longer entry, once durable, serves this prefix by trimming (RAM only supersedes for trimmable ones)
    RecState.COVERED: frozenset({RecState.ARMED, RecState.DURABLE, RecState.MISSING}),
    RecState.QUEUED: frozenset({RecState.STORING, RecState.FAILED}),
    RecState.STORING: frozenset({RecState.DURABLE, RecState.FAILED}),
    RecState.DURABLE: frozenset(),
    RecState.MISSING: frozenset(),
}


Key = tuple[str, tuple[int, ...]]


@dataclass(eq=False, slots=True)
class Record:
    ns: str
    tokens: list[int]
    seq: int
    state: RecState = RecState.ARMED
    due: float | None = None
    item: SpillItem | None = None
    attempts: int = 0
    _key: Key | None = None
    _kb: bytes | None = None

    @property
    def key(self) -> Key:
        # cached: looked up many times per record, and ``tokens`` never changes
        if self._key is None:
            self._key = (self.ns, tuple(self.tokens))
        return self._key

    @property
    def token_bytes(self) -> bytes:
        """``tokens`` as int64 bytes (cached): one list starts with another
        exactly when its bytes do, compared in C without slicing a list."""
        if self._kb is None:
            self._kb = token_bytes(self.tokens)
        return self._kb

    def move(self, to: RecState) -> None:
        check_transition(REC_TRANSITIONS, self.state, to, f"durability record {self.seq} ({len(self.tokens)} tokens)")
        self.state = to
