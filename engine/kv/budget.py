"""SsdBudget: one SSD byte cap across the cold tiers of every model a server holds.

Each loaded model has its own ``ColdStore`` (its own folder, index and
writer); with a budget they draw on one cap instead of one each, so a server
that serves N models keeps at most the cap on disk, not N times it (issue #30).

* One recency order: every store takes its sequence numbers from the budget
  (``next_seq``), so "least recently used" compares entries across models.
* ``reserve``/``evict_bytes``/``load_index`` in a store ask ``victims`` for room;
  the victims may belong to another model's store. Each is taken out of its own
  store's index at once (a later lookup there is a miss) and the caller deletes
  its file: the stores share one ``Disk`` (the registry hands every engine the
  same disk port), and a restore already reading a file whose entry went meanwhile
  either reads it whole (an unlinked file stays readable to an open handle) or
  fails and answers a miss (``ColdIO.restore``): never a wrong token. If the
  other model writes the very same key again before the deletion lands, its new
  file goes with it; its restore then fails its read and answers a miss too.
* Files no loaded model indexes (``add_offline``: the folders of the models the
  server can load but has not, left by an earlier run) count against the cap and
  go first, oldest file first; a store adopts its own folder's files when its
  start-up scan indexes them (``attach``).
* A model that unloads leaves its store attached: its files stay on disk for the
  next load (the point of the tier) and stay in the count, evictable by the others.
  The store that the reload builds replaces it (``attach``, keyed by folder).

Index work only (no I/O): it runs on the event loop, as ``ColdStore``'s index does.
"""

from __future__ import annotations

import heapq
import logging
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.kv.disk import Disk

log = logging.getLogger("ember.cold_tier")


class Victim(Protocol):
    """What eviction reads of an indexed file (``ColdEntry``; ``OfflineFile`` too)."""

    @property
    def path(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


class Indexed(Victim, Protocol):
    @property
    def seq(self) -> int: ...  # the shared recency order (``SsdBudget.next_seq``)


class Member(Protocol):
    """What the budget reads and calls on a ``ColdStore`` (typed here, not
    imported: the store imports the budget)."""

    counters: dict[str, int]

    @property
    def dir(self) -> str: ...

    @property
    def bytes(self) -> int: ...

    @property
    def other_bytes(self) -> int: ...

    @property
    def reserved(self) -> int: ...

    @property
    def meta(self) -> Any: ...

    def entries(self) -> Iterable[Indexed]: ...

    def forget(self, entry: Any) -> object: ...


@dataclass(slots=True)
class OfflineFile:
    """A ``.kv`` file in a known model folder that no attached store indexes.
    Quacks like a ``ColdEntry`` where a victim is deleted (``path``, ``nbytes``)."""

    path: str
    nbytes: int
    mtime: float


class SsdBudget:
    """The byte cap shared by several ``ColdStore``s (see the module doc)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._stores: dict[str, Member] = {}  # by fingerprint folder (ColdStore.dir)
        self._offline: dict[str, OfflineFile] = {}  # by path
        self.offline_bytes = 0
        self._seq = 0
        self.counters = {"evictions": 0, "evicted_across": 0, "offline_evicted": 0}

    # ---- membership ------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def attach(self, store: Member) -> None:
        """``store`` counts from now on (its start-up scan is indexed): it replaces
        an earlier store of the same folder (a reloaded model) and adopts the
        offline files under its folder."""
        self._stores[store.dir] = store
        prefix = store.dir.rstrip("/") + "/"
        for path in [p for p in self._offline if p.startswith(prefix)]:
            self.offline_bytes -= self._offline.pop(path).nbytes

    def stores(self) -> list[Member]:
        return list(self._stores.values())

    def add_offline(self, files: list[OfflineFile]) -> None:
        """Count files left by an earlier run in folders no store has attached yet."""
        attached = [s.dir.rstrip("/") + "/" for s in self._stores.values()]
        for f in files:
            if f.path in self._offline or any(f.path.startswith(a) for a in attached):
                continue
            self._offline[f.path] = f
            self.offline_bytes += f.nbytes

    # ---- accounting --------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return self.offline_bytes + sum(s.bytes for s in self._stores.values())

    def pinned_bytes(self) -> int:
        """Bytes no eviction can free: unknown files in the stores' folders, writes in flight."""
        return sum(s.other_bytes + s.reserved for s in self._stores.values())

    def _lru(self) -> Iterator[tuple[Member | None, Any]]:
        """Every evictable file, least recently used first: offline files (oldest
        mtime first), then all stores' entries merged by their shared ``seq``."""
        for f in sorted(self._offline.values(), key=lambda f: (f.mtime, f.path)):
            yield None, f
        streams = [_stream(i, s) for i, s in enumerate(self._stores.values())]
        for _, _, s, e in heapq.merge(*streams):
            yield s, e

    def victims(
        self, nbytes: int, *, asker: Member, keep: str = ""
    ) -> list[Any]:  # the stores' own entries, or OfflineFile
        """The least recently used files holding at least ``nbytes`` (fewer if
        there are not enough), any store's, never the file at ``keep``; each is out
        of its store's index (or the offline list) on return and is the caller's
        to delete."""
        picked: list[tuple[Member | None, Any]] = []
        freed = 0
        for owner, e in self._lru():  # collected first: the walk reads the indexes it would change
            if freed >= nbytes:
                break
            if e.path == keep:
                continue
            picked.append((owner, e))
            freed += e.nbytes
        out: list[Any] = []
        for owner, e in picked:
            if owner is None:
                self.offline_bytes -= self._offline.pop(e.path).nbytes
                self.counters["offline_evicted"] += 1
            else:
                owner.forget(e)
                owner.counters["evictions"] += 1
                if owner is not asker:
                    owner.counters["evicted_by_others"] += 1
                    self.counters["evicted_across"] += 1
            self.counters["evictions"] += 1
            out.append(e)
        if any(o is not asker for o, _ in picked):
            log.info(
                "[cold_tier] shared cap: %s evicts %d files (%d of other models) bytes=%d max=%d",
                asker.meta.model_id,
                len(picked),
                sum(1 for o, _ in picked if o is not asker),
                freed,
                self.max_bytes,
            )
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "max_bytes": self.max_bytes,
            "bytes": self.bytes,
            "stores": len(self._stores),
            "offline_files": len(self._offline),
            "offline_bytes": self.offline_bytes,
            **self.counters,
        }


def _stream(i: int, store: Member) -> Iterator[tuple[int, int, Member, Indexed]]:
    """One store's entries in its LRU order, keyed for the merge (its own
    function: a generator expression in a loop would bind the last store)."""
    for e in store.entries():
        yield e.seq, i, store, e


def scan_offline(disk: Disk, model_dirs: list[str]) -> list[OfflineFile]:
    """The ``<model dir>/<fingerprint>/<ns>/<id>.kv`` files under each folder (I/O:
    run it off the loop). Names are ``lstat``ed and only regular files listed, as
    the stores' own scans do: a symlink or a FIFO is never counted or deleted.
    A folder that is missing or unreadable holds nothing."""
    out: list[OfflineFile] = []

    def dirs(path: str) -> list[str]:
        try:
            names = disk.listdir(path)
        except OSError:
            return []
        keep = []
        for n in names:
            try:
                if disk.stat(posixpath.join(path, n)).is_dir:
                    keep.append(posixpath.join(path, n))
            except OSError:
                continue
        return keep

    for root in model_dirs:
        for fp in dirs(root):
            for ns in dirs(fp):
                try:
                    names = disk.listdir(ns)
                except OSError:
                    continue
                for n in names:
                    if not n.endswith(".kv"):
                        continue
                    path = posixpath.join(ns, n)
                    try:
                        st = disk.stat(path)
                    except OSError:
                        continue
                    if st.is_file:
                        out.append(OfflineFile(path, st.size, st.mtime))
    return out
