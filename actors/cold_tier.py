"""ColdTier: the SSD tier of the prompt cache ("files are the database").

Layout ``<dir>/<config_fingerprint>/<ns_hash>/<id>.kv``, one ``engine.kv.kvfile``
file per entry; the token prefix lives in each file's header, and the index
is rebuilt at startup by reading headers only. ``ColdStore`` is the sync core
(index, lookup, byte cap, naming; its I/O methods touch no index state so
they can run on a worker thread); ``ColdTier`` is the thin actor around it:

* ``Restore`` (from the Scheduler, for a row parked in RESTORING) → find the
  longest usable prefix, stream the file into fresh caches one layer at a
  time, trim the divergent tail, answer ``Restored``. Any failure — truncated
  file, hash mismatch, I/O error — deletes the file, counts
  ``corrupt_deleted`` and answers a miss: never an error for the request.
* ``Spill`` (RAM eviction or idle demotion) and ``Store`` (an ask that
  answers after rename + folder fsync) → one writer task writes entries one
  tensor at a time, awaiting a gate before every tensor step: by default
  "the engine is idle" (``EngineIdle``/``EngineBusy`` from the Scheduler).
* Idle demotion: on ``EngineIdle`` the tier asks the Scheduler to ``Demote``;
  the Scheduler answers how many entries it spilled and when the next falls
  due, and a timer message (``DemoteDue``) repeats the sweep then — only while
  the engine stays idle.

The byte cap counts every file under our fingerprint folder and is enforced
at write time by evicting the least recently used entries first. ENOSPC (the
disk filled below the cap) evicts the least recently used entries holding as
many bytes as the write and retries it once; if that cannot help (no entries
left) the write is dropped, a warning is logged once, and the tier keeps
serving.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import logging
import posixpath
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, assert_never

import anyio
import msgspec
import numpy as np

from actors.events import EngineBusy, EngineIdle
from actors.runtime import DEFER, Actor, ActorRef, Envelope, Failure
from actors.scheduler import Demote, Restored
from engine.errors import EngineDead
from engine.kv import kvfile
from engine.kv.disk import Disk, FileStat, NotRegularFile
from engine.kv.kvfile import KvHeader, KvMeta, KvReader, KvWriter
from engine.kv.prompt_cache import PrefixIndex, as_tokens, token_bytes, usable_prefix
from engine.ports import Backend, Clock, Device, IoRunner, run_in_thread, run_inline  # noqa: F401 - run_inline: the name tests import from here

log = logging.getLogger("ember.cold_tier")

GIB = 1 << 30


# ---------------------------------------------------------------------------
# Messages the ColdTier accepts.


class Restore(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler → ColdTier: row ``rid`` waits in RESTORING; restore the longest
    usable prefix of ``tokens`` if it is longer than ``min_len`` (the RAM
    candidate). Always answered with ``Restored`` to the Scheduler."""

    rid: int
    tokens: list[int]
    ns: str = ""
    min_len: int = 0


class Spill(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler (its RAM tier evicting or demoting) → ColdTier: persist this
    entry; ownership of ``cache`` (a live GPU object) passes to the tier."""

    tokens: list[int]
    ns: str
    cache: Any


class Store(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Any actor → ColdTier (ask): persist ``cache`` (an owned clone); the reply
    is True once the file is renamed and its folder fsynced, False if the
    write was refused or failed. ``wait_turn`` is awaited before every tensor
    step (None: wait until the engine is idle; ``ungated``: never wait)."""

    tokens: list[int]
    ns: str
    cache: Any
    wait_turn: Any = None


class Demoted(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Scheduler → ColdTier: a demotion sweep spilled ``n`` entries; the next
    entry falls due at ``next_due`` (engine clock; None: none left)."""

    n: int
    next_due: float | None = None


class DemoteDue(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """ColdTier's timer → ColdTier: a RAM entry falls due for demotion now."""

    at: float


Inbox = Restore | Spill | Store | Demoted | DemoteDue | EngineIdle | EngineBusy


async def ungated() -> None:
    """A ``wait_turn`` that never waits (a flush that must not wait for idle)."""


# ---------------------------------------------------------------------------
# The sync core.


@dataclass(slots=True, eq=False)
class ColdEntry:
    path: str
    ns: str
    tokens: np.ndarray
    nbytes: int  # file size
    trimmable: bool
    seq: int  # last use, in this store's order: the lowest is evicted first
    key: bytes = b""  # ``tokens.tobytes()``, set when indexed (the prefix index's sort key)


@dataclass(slots=True)
class ScanResult:
    found: list[tuple[str, KvHeader, int, float]] = field(default_factory=list)  # path, header, size, mtime
    other_bytes: int = 0  # files under our folder that are not entries (counted against the cap)
    reaped_tmp: int = 0
    corrupt_deleted: int = 0
    mismatch_deleted: int = 0
    skipped: int = 0  # names that are neither a regular file nor a folder (symlinks, FIFOs, devices)


def ns_folder(ns: str) -> str:
    return "base" if ns == "" else hashlib.blake2b(ns.encode(), digest_size=8).hexdigest()


def entry_id(tokens: np.ndarray, ns: str) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(ns.encode() + b"\0")
    h.update(tokens.astype("<i8").tobytes())
    return h.hexdigest()


class ColdStore:
    """The SSD index and the file-level operations behind it.

    Index methods (``find``, ``reserve``, ``indexed``, ``forget``…) never do
    I/O and run on the event loop, next to the Scheduler's synchronous
    ``find``; I/O methods (``scan_files``, ``delete_files``, ``touch``) never
    touch the index, so the actor can run them on a worker thread.
    """

    def __init__(
        self,
        disk: Disk,
        root: str,
        *,
        model_id: str,
        config_fingerprint: str,
        tokenizer_hash: str,
        max_bytes: int,
        verify: bool = True,
        max_tokens: int | None = None,
    ):
        self.disk = disk
        self.root = root
        self.dir = posixpath.join(root, config_fingerprint)
        self.meta = KvMeta(model_id=model_id, config_fingerprint=config_fingerprint, tokenizer_hash=tokenizer_hash)
        self.max_bytes = int(max_bytes)
        self.verify = verify
        self.max_tokens = max_tokens  # the model's context: no entry can hold more
        self._by_ns: dict[str, dict[str, ColdEntry]] = {}
        self._paths: dict[str, ColdEntry] = {}  # in ``seq`` order: least recently used first
        self._index = PrefixIndex()
        self.entry_bytes = 0
        self.other_bytes = 0
        self.reserved = 0
        self._seq = 0
        self.adds = 0  # entries indexed so far: a ``holds`` that was False stays False until this moves
        # the latest adds, (ns, key, trimmable), the oldest being add number ``_added_base + 1``:
        # a ``holds`` that was False at add n only needs the entries added since (``added_since``)
        self._added: list[tuple[str, bytes, bool]] = []
        self._added_base = 0
        self.counters = {
            "restores": 0,
            "spills": 0,  # entries written
            "demotions": 0,
            "corrupt_deleted": 0,
            "mismatch_deleted": 0,
            "skipped": 0,
            "tmp_reaped": 0,
            "evictions": 0,
            "superseded": 0,
            "refused": 0,
            "enospc": 0,
            "enospc_evictions": 0,  # entries evicted to recover from a full disk
            "write_failures": 0,
            "misses": 0,
        }
        self.restore_ms_last: float | None = None

    # ---- naming ------------------------------------------------------------
    def meta_for(self, ns: str) -> KvMeta:
        return msgspec.structs.replace(self.meta, ns=ns)

    def path_for(self, tokens: Sequence[int] | np.ndarray, ns: str) -> str:
        return posixpath.join(self.dir, ns_folder(ns), entry_id(as_tokens(tokens), ns) + ".kv")

    # ---- I/O (no index state) ------------------------------------------------
    def scan_files(self) -> ScanResult:
        """Header-only scan of our fingerprint folder (never another's):
        reap ``*.tmp``, delete corrupt or foreign-identity files.

        The folder is untrusted input: every name is ``lstat``ed, only regular
        files are opened (``O_NOFOLLOW | O_NONBLOCK``: a FIFO or a device
        cannot block the scan), only real folders are entered (a symlinked
        folder is never followed out of the tier), and only regular files are
        ever deleted. Anything else is skipped, counted and left alone. No
        file's contents can stop the scan: every failure to read or decode one
        is "corrupt → delete"."""
        disk, res = self.disk, ScanResult()
        disk.makedirs(self.dir)
        top = disk.stat(self.dir)
        if not top.is_dir:  # e.g. a symlink where our folder should be
            log.warning(
                "[cold_tier] %s is not a plain folder: the SSD tier starts empty and does not read it", self.dir
            )
            res.skipped += 1
            return res
        for name in disk.listdir(self.dir):
            sub = posixpath.join(self.dir, name)
            st = self._lstat(sub)
            if st is None or not (st.is_dir or st.is_file):
                self._skip(sub, res)
                continue
            if not st.is_dir:
                if name.endswith(".tmp"):
                    self._quiet_unlink(sub)
                    res.reaped_tmp += 1
                else:
                    res.other_bytes += st.size
                continue
            for fname in disk.listdir(sub):
                path = posixpath.join(sub, fname)
                fst = self._lstat(path)
                if fst is None or not fst.is_file:
                    if fst is None or not fst.is_dir:
                        self._skip(path, res)
                    continue
                if fname.endswith(".tmp"):  # a write that never committed
                    self._quiet_unlink(path)
                    res.reaped_tmp += 1
                    continue
                if not fname.endswith(".kv"):
                    res.other_bytes += fst.size
                    continue
                try:
                    if fst.size > self.max_bytes:
                        raise kvfile.CorruptFile(f"{path}: {fst.size} bytes, over the cap of {self.max_bytes}")
                    header = KvReader(disk, path, max_tokens=self.max_tokens, entry=True).header
                except NotRegularFile as exc:  # swapped for a FIFO or a device since the lstat
                    self._skip(path, res, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - whatever the bytes do, it is a corrupt file
                    log.warning("[cold_tier] scan deletes %s: %s", path, exc)
                    self._quiet_unlink(path)
                    res.corrupt_deleted += 1
                    continue
                if not header.matches(self.meta, ns=False) or ns_folder(header.ns) != name:
                    log.warning("[cold_tier] scan deletes %s: written for another model/tokenizer", path)
                    self._quiet_unlink(path)
                    res.mismatch_deleted += 1
                    continue
                res.found.append((path, header, fst.size, fst.mtime))
        return res

    def _lstat(self, path: str) -> FileStat | None:
        try:
            return self.disk.stat(path)
        except OSError:
            return None  # gone meanwhile, or unreadable

    @staticmethod
    def _skip(path: str, res: ScanResult, why: Any = "not a regular file or folder") -> None:
        log.warning("[cold_tier] scan skips %s: %s (left alone, not served)", path, why)
        res.skipped += 1

    def delete_files(self, paths: Sequence[str]) -> None:
        for p in paths:
            self._quiet_unlink(p)

    def touch(self, path: str) -> None:
        try:
            self.disk.touch(path)  # recency that survives a restart
        except OSError:
            pass

    def _quiet_unlink(self, path: str) -> None:
        """Delete ``path`` if it is a regular file: a symlink, FIFO or folder
        that took its name is left alone (never an unlink across a link)."""
        try:
            if not self.disk.stat(path).is_file:
                log.warning("[cold_tier] not deleting %s: not a regular file", path)
                return
            self.disk.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("[cold_tier] cannot delete %s: %r", path, exc)

    # ---- the index (no I/O) --------------------------------------------------
    def load_index(self, scan: ScanResult) -> list[ColdEntry]:
        """Rebuild the index from a scan; returns the least recently used
        entries evicted to fit the cap (their files are to be deleted). A
        crash can bring back unlinks that were never made durable, so the
        folder may hold more than the cap at startup."""
        self._by_ns.clear()
        self._paths.clear()
        self._index.clear()
        self.entry_bytes = 0
        self.other_bytes = scan.other_bytes
        self.counters["tmp_reaped"] += scan.reaped_tmp
        self.counters["corrupt_deleted"] += scan.corrupt_deleted
        self.counters["mismatch_deleted"] += scan.mismatch_deleted
        self.counters["skipped"] += scan.skipped
        for path, header, size, _ in sorted(scan.found, key=lambda f: (f[3], f[0])):  # oldest use first
            self._add(ColdEntry(path, header.ns, as_tokens(header.tokens), size, header.trimmable(), self._next_seq()))
        victims: list[ColdEntry] = []
        for e in self.entries():
            if self.bytes <= self.max_bytes:
                break
            self._remove_path(e.path)
            victims.append(e)
        self.counters["evictions"] += len(victims)
        return victims

    def recover(self) -> None:
        """Scan, index and trim to the cap in one synchronous call (tools, tests)."""
        self.delete_files([v.path for v in self.load_index(self.scan_files())])

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _add(self, e: ColdEntry) -> None:
        """Index ``e``, which must carry the newest ``seq`` (it goes last in LRU order)."""
        self._remove_path(e.path)
        self._by_ns.setdefault(e.ns, {})[e.path] = e
        self._paths[e.path] = e
        e.key = e.tokens.tobytes()
        self._index.add(e.ns, e.key, e, e.trimmable)
        self.adds += 1
        self._added.append((e.ns, e.key, e.trimmable))
        if len(self._added) > 256:
            del self._added[:128]
            self._added_base += 128
        self.entry_bytes += e.nbytes

    def _remove_path(self, path: str) -> ColdEntry | None:
        e = self._paths.pop(path, None)
        if e is not None:
            del self._by_ns[e.ns][e.path]
            self._index.remove(e.ns, e.key, e, e.trimmable)
            self.entry_bytes -= e.nbytes
        return e

    @property
    def bytes(self) -> int:
        return self.entry_bytes + self.other_bytes + self.reserved

    def __len__(self) -> int:
        return len(self._paths)

    def entries(self) -> list[ColdEntry]:
        """Least recently used first (``_paths`` is kept in ``seq`` order)."""
        return list(self._paths.values())

    def contains(self, entry: ColdEntry) -> bool:
        return self._paths.get(entry.path) is entry

    def find(self, tokens: Sequence[int], ns: str) -> tuple[ColdEntry | None, int]:
        """The entry with the longest usable prefix (longer entries that cannot
        be trimmed are skipped); ties prefer less to trim, then the most recent."""
        prompt = as_tokens(tokens)
        best, best_p, best_trim, best_seq = None, 0, 0, -1
        for e in self._index.rigid(ns):
            p = usable_prefix(e.tokens, e.trimmable, prompt)
            if p <= 0:
                continue
            trim = e.tokens.size - p
            if (p, -trim, e.seq) > (best_p, -best_trim, best_seq):
                best, best_p, best_trim, best_seq = e, p, trim, e.seq
        run, p = self._index.run(ns, prompt)  # every one of them serves p (> 0) tokens
        for e in run:
            trim = e.tokens.size - p
            if (p, -trim, e.seq) > (best_p, -best_trim, best_seq):
                best, best_p, best_trim, best_seq = e, p, trim, e.seq
        return best, best_p

    def longest(self, tokens: Sequence[int], ns: str) -> int:
        return self.find(tokens, ns)[1]

    def holds(self, tokens: Sequence[int], ns: str) -> bool:
        """True if an entry covers exactly ``tokens``: equal, or longer and trimmable."""
        return self.holds_key(token_bytes(tokens), ns)

    def holds_key(self, key: builtins.bytes, ns: str) -> bool:  # builtins: the class has a `bytes` property
        """``holds`` for tokens already as ``token_bytes``."""
        if self._index.extending(ns, key):
            return True
        return any(e.key == key for e in self._index.rigid(ns))

    def added_since(self, n: int) -> list[tuple[str, builtins.bytes, bool]] | None:
        """The entries indexed after add number ``n`` as (ns, key, trimmable),
        whether still indexed or not; None if they are no longer all kept."""
        if n < self._added_base:
            return None
        return self._added[n - self._added_base :]

    def longest_entry(self) -> int:
        return max((int(e.tokens.size) for e in self._paths.values()), default=0)

    def used(self, entry: ColdEntry) -> None:
        entry.seq = self._next_seq()
        if self._paths.get(entry.path) is entry:
            self._paths[entry.path] = self._paths.pop(entry.path)  # to the end: most recently used

    def reserve(self, path: str, nbytes: int) -> list[ColdEntry] | None:
        """Make room for a file of ``nbytes`` at ``path``: the least recently
        used entries to evict (already out of the index), or None when it
        cannot fit even in an empty tier (the write is refused)."""
        replaced = self._paths.get(path)
        base = self.bytes - (replaced.nbytes if replaced else 0)  # a rename replaces the same-key file
        if nbytes > self.max_bytes - self.other_bytes - self.reserved:
            self.counters["refused"] += 1
            return None
        victims: list[ColdEntry] = []
        for e in self._paths.values():  # least recently used first; removed after the walk
            if base + nbytes <= self.max_bytes:
                break
            if e.path == path:
                continue
            victims.append(e)
            base -= e.nbytes
        for e in victims:
            self._remove_path(e.path)
        self.counters["evictions"] += len(victims)
        self.reserved += nbytes
        return victims

    def evict_bytes(self, nbytes: int, *, keep: str = "") -> list[ColdEntry]:
        """The least recently used entries holding at least ``nbytes`` (all of
        them if fewer), out of the index; their files are to be deleted. For a
        disk that filled below the cap (ENOSPC)."""
        victims: list[ColdEntry] = []
        freed = 0
        for e in self._paths.values():  # least recently used first
            if freed >= nbytes:
                break
            if e.path != keep:
                victims.append(e)
                freed += e.nbytes
        for e in victims:
            self._remove_path(e.path)
        self.counters["evictions"] += len(victims)
        self.counters["enospc_evictions"] += len(victims)
        return victims

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def indexed(self, path: str, header: KvHeader, nbytes: int, tokens: np.ndarray | None = None) -> list[ColdEntry]:
        """Index a committed file; returns the entries it supersedes (their
        files are to be deleted): strict prefixes in the same namespace, only
        when the new entry can be trimmed (it then serves all of them).
        ``tokens``: ``header.tokens`` as int64, when the caller has them."""
        arr = as_tokens(header.tokens) if tokens is None else tokens
        e = ColdEntry(path, header.ns, arr, nbytes, header.trimmable(), self._next_seq())
        self._add(e)
        gone: list[ColdEntry] = []
        if e.trimmable:
            gone = self._index.prefixes_of(e.ns, e.key)
            if len(gone) > 1:  # deleted in index order, as the scan this replaced did (the digest sees it)
                at = {path: i for i, path in enumerate(self._by_ns[e.ns])}
                gone.sort(key=lambda g: at[g.path])
            for other in gone:
                self._remove_path(other.path)
        self.counters["superseded"] += len(gone)
        return gone

    def forget(self, entry: ColdEntry) -> bool:
        """Drop an entry from the index; False if it was already gone."""
        if not self.contains(entry):
            return False
        self._remove_path(entry.path)
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "dir": self.dir,
            "entries": len(self._paths),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "restore_ms_last": self.restore_ms_last,
            **self.counters,
        }


# ---------------------------------------------------------------------------
# Where work runs.

Runner = IoRunner  # run_inline / run_in_thread live with the other ports (engine.ports)


class ColdLink:
    """The Scheduler's handle on the cold tier (``actors.scheduler.ColdLookup``)."""

    def __init__(self, store: ColdStore, ref: ActorRef[Inbox]):
        self.store = store
        self.ref = ref

    def longest(self, tokens: list[int], ns: str) -> int:
        return self.store.longest(tokens, ns)

    def request_restore(self, rid: int, tokens: list[int], ns: str, min_len: int) -> None:
        self.ref.tell_nowait(Restore(rid=rid, tokens=tokens, ns=ns, min_len=min_len))

    def demoted(self, n: int, next_due: float | None) -> None:
        try:
            self.ref.tell_nowait(Demoted(n=n, next_due=next_due))
        except Exception:  # a lost timer edge: the next EngineIdle re-arms it
            log.warning("[cold_tier] missed a Demoted report")

    def spill(self, tokens: list[int], ns: str, cache: Any) -> None:
        """``PromptCache.on_spill``: hand an evicted entry over without blocking
        (a full inbox raises, and the RAM tier drops the entry instead)."""
        self.ref.tell_nowait(Spill(tokens=tokens, ns=ns, cache=cache))


@dataclass(slots=True, eq=False)
class _Job:
    tokens: list[int]
    ns: str
    cache: Any
    nbytes: int
    wait_turn: Any = None
    env: Envelope[Any] | None = None  # a Store ask, answered when durable


class ColdTier(Actor[Inbox]):
    name = "cold_tier"
    inbox_size = 1024

    def __init__(
        self,
        store: ColdStore,
        backend: Backend,
        device: Device,
        clock: Clock,
        *,
        io: Runner = run_in_thread,
        scheduler: ActorRef[Any] | None = None,
        demote_idle_s: float | None = None,
        spill_queue_bytes: int = 2 * GIB,
        wall: Callable[[], float] = time.time,
    ):
        super().__init__()
        self.store = store
        self.backend = backend
        self.device = device
        self.clock = clock
        self.io = io
        self.scheduler = scheduler
        self.demote_idle_s = demote_idle_s or None
        self.spill_queue_bytes = spill_queue_bytes
        self.wall = wall
        self.idle = True  # the Scheduler announces edges only; it starts idle
        self._idle_event = anyio.Event()
        self._idle_event.set()
        self._jobs: deque[_Job] = deque()
        self._jobs_bytes = 0
        self._jobs_wake = anyio.Event()
        self._in_flight: _Job | None = None
        self._direct = False  # a ``store_now`` is writing on its caller's task
        self._stopped = False
        self._restores: deque[Restore] = deque()
        self._restores_wake = anyio.Event()
        self._timer: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._warned_enospc = False
        self.counters = {"pending_spills": 0, "dropped_spills": 0}

    def link(self) -> ColdLink:
        return ColdLink(self.store, self.ref)

    # ---- lifecycle -----------------------------------------------------------
    async def started(self) -> None:
        scan = await self.io(self.store.scan_files)
        over = self.store.load_index(scan)
        if over:
            await self.io(self.store.delete_files, [v.path for v in over])
        log.info(
            "[cold_tier] scan dir=%s entries=%d bytes=%d reaped_tmp=%d deleted=%d",
            self.store.dir,
            len(self.store),
            self.store.bytes,
            scan.reaped_tmp,
            scan.corrupt_deleted + scan.mismatch_deleted,
        )

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._writer)
            tg.start_soon(self._restorer)
            await super().main()
            tg.cancel_scope.cancel()

    async def stopping(self, reason: BaseException | None) -> None:
        """Fail the Store asks still queued (their writes will not happen)."""
        self._stopped = True
        dead = Failure(EngineDead("cold tier stopped"))
        for job in self._jobs:
            if job.env is not None:
                job.env.answer(dead)
        self._jobs.clear()

    # ---- messages --------------------------------------------------------------
    async def receive(self, msg: Inbox) -> Any:
        match msg:
            case Restore():
                self._restores.append(msg)
                self._restores_wake.set()
            case Spill():
                self._enqueue(_Job(msg.tokens, msg.ns, msg.cache, self._nbytes(msg.cache)))
            case Store():
                self._enqueue(_Job(msg.tokens, msg.ns, msg.cache, self._nbytes(msg.cache), msg.wait_turn, self.current))
                return DEFER
            case EngineIdle():
                self._set_idle(True)
                self._ask_demote()
            case EngineBusy():
                self._set_idle(False)
                self._cancel_timer()
            case Demoted():
                self.store.counters["demotions"] += msg.n
                if msg.next_due is not None and self.idle:
                    self._arm_timer(msg.next_due)
            case DemoteDue():
                self._timer = None
                if self.idle:
                    self._ask_demote()
            case _:
                assert_never(msg)
        return None

    # ---- idle gate and demotion timer -------------------------------------------
    def _set_idle(self, idle: bool) -> None:
        self.idle = idle
        if idle:
            self._idle_event.set()
        elif self._idle_event.is_set():
            self._idle_event = anyio.Event()

    async def wait_idle(self) -> None:
        """The default per-tensor gate: return once the engine is idle."""
        await anyio.lowlevel.checkpoint()  # let an EngineBusy already sent reach us first
        while not self.idle:
            await self._idle_event.wait()

    def _ask_demote(self) -> None:
        if self.demote_idle_s is None or self.scheduler is None:
            return
        try:
            self.scheduler.tell_nowait(Demote(idle_s=self.demote_idle_s))
        except EngineDead:
            pass  # shutting down
        except Exception as exc:
            log.warning("[cold_tier] demotion request lost: %r", exc)

    def _arm_timer(self, due: float) -> None:
        self._cancel_timer()
        if self._tg is None:
            return
        scope = anyio.CancelScope()
        self._timer = scope

        async def fire() -> None:
            with scope:
                await self.clock.sleep(max(0.0, due - self.clock.now()))
                try:
                    self.ref.tell_nowait(DemoteDue(at=self.clock.now()))
                except Exception:
                    pass

        self._tg.start_soon(fire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- writes --------------------------------------------------------------------
    def _nbytes(self, cache: Any) -> int:
        try:
            return int(self.backend.cache_nbytes(cache))
        except Exception:
            return 0

    def _enqueue(self, job: _Job) -> None:
        self._jobs.append(job)
        self._jobs_bytes += job.nbytes
        # Spills pin GPU memory until written; over the cap the oldest queued
        # spill goes (a future miss, never a wrong token). Store asks are kept.
        while self._jobs_bytes > self.spill_queue_bytes:
            victim = next((j for j in self._jobs if j.env is None and j is not job and j is not self._in_flight), None)
            if victim is None:
                break
            self._jobs.remove(victim)
            self._jobs_bytes -= victim.nbytes
            self.counters["dropped_spills"] += 1
        self.counters["pending_spills"] = len(self._jobs)
        self._jobs_wake.set()

    async def store_now(self, tokens: list[int], ns: str, cache: Any, wait_turn: Any = None) -> bool:
        """What a ``Store`` ask answers, for a caller that would only await the
        answer (the durability coordinator's single writer). When the tier's
        own writer has nothing queued or in flight, the same ``store_entry``
        runs on the caller's task: the ask's reply stream, two inbox hops and
        the writer's wake-up were a quarter of the event-loop turns the SSD
        tier adds per request. Otherwise it queues behind them as a ``Store``.
        One write at a time either way: the writer waits while this runs."""
        if self._stopped:
            raise EngineDead("cold tier stopped")
        if self._jobs or self._in_flight is not None or self._direct:
            return bool(await self.ref.ask(Store(tokens=tokens, ns=ns, cache=cache, wait_turn=wait_turn)))
        self._direct = True
        try:
            return await self.store_entry(tokens, ns, cache, wait_turn=wait_turn)
        finally:
            self._direct = False
            if self._jobs:
                self._jobs_wake.set()

    async def _writer(self) -> None:
        while True:
            while not self._jobs or self._direct:
                self._jobs_wake = anyio.Event()
                await self._jobs_wake.wait()
            job = self._in_flight = self._jobs[0]
            try:
                ok = await self.store_entry(job.tokens, job.ns, job.cache, wait_turn=job.wait_turn)
            except BaseException:  # stopped mid-write: the asker must not wait forever
                if job.env is not None:
                    job.env.answer(Failure(EngineDead("cold tier stopped before the write was durable")))
                raise
            finally:
                self._jobs.popleft()
                self._jobs_bytes -= job.nbytes
                self._in_flight = None
                job.cache = None
                self.counters["pending_spills"] = len(self._jobs)
            if job.env is not None:
                job.env.answer(ok)

    async def store_entry(self, tokens: list[int], ns: str, cache: Any, *, wait_turn: Any = None) -> bool:
        """Write one entry; True once it is durable (renamed, folder fsynced)."""
        store = self.store
        gate = self.wait_idle if wait_turn is None else wait_turn
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
                        writer, sources, wait_turn=gate, device_run=self.device.run, io_run=self.io
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

    # ---- restores ------------------------------------------------------------------
    async def _restorer(self) -> None:
        while True:
            while not self._restores:
                self._restores_wake = anyio.Event()
                await self._restores_wake.wait()
            req = self._restores.popleft()
            cache, cached = await self.restore(req.tokens, req.ns, min_len=req.min_len)
            if self.scheduler is not None:
                try:
                    await self.scheduler.tell(Restored(rid=req.rid, cache=cache, cached=cached))
                except Exception as exc:
                    log.warning("[cold_tier] cannot answer restore of row %d: %r", req.rid, exc)

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
            for i, lh in enumerate(header.layers):
                bufs = await self.io(reader.read_layer, i)
                layers.append(await self.device.run(kvfile.decode_layer, lh, bufs))
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

    # ---- stats -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {**self.store.stats(), **self.counters, "idle": self.idle}
