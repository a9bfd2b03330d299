"""An append-only log of what the engine did, in (virtual) time.

Tests assert on it (a request admitted mid-batch joins at the next step) and
simulations digest it: the same seed must give the same digest. Listeners run
after every record, which is how invariant checkers watch a simulation.

A recorder may leave one record ``pending`` (``hold``): it is completed and
recorded just before the next record, or when the log is read. The sims'
disk proxy uses it to fold a run of disk calls that nothing else interleaves
into one record: no record, and so no listener call, can fall between them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec


class EventLog:
    def __init__(self, keep: bool = True):
        self.keep = keep
        self.records: list[tuple[str, float, dict[str, Any]]] = []
        self.listeners: list[Callable[[str, float, dict[str, Any]], None]] = []
        self._hash = hashlib.blake2b(digest_size=16)
        self._enc = msgspec.msgpack.Encoder()
        self.count = 0
        self.origin: float | None = None  # times are recorded relative to this
        self._pending: Callable[[], None] | None = None  # records a held record (see ``hold``)

    def start(self, now: float) -> None:
        if self.origin is None:
            self.origin = now

    def hold(self, flush: Callable[[], None]) -> None:
        """``flush`` records a held record, before whatever is recorded next."""
        self._pending = flush

    @property
    def holding(self) -> Callable[[], None] | None:
        return self._pending

    def settle(self) -> None:
        """Record the held record now, if any."""
        flush = self._pending
        if flush is not None:
            self._pending = None
            flush()

    def record(self, kind: str, t: float, **fields: Any) -> None:
        if self._pending is not None:
            self.settle()
        t = round(t - (self.origin or 0.0), 9)
        self._hash.update(self._enc.encode((kind, t, fields)))
        self.count += 1
        if self.keep:
            self.records.append((kind, t, fields))
        for fn in self.listeners:
            fn(kind, t, fields)

    def digest(self) -> str:
        self.settle()
        return self._hash.hexdigest()

    def of(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        self.settle()
        return [(t, f) for k, t, f in self.records if k == kind]
