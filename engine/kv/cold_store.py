"""ColdStore: the SSD tier's index and the file operations behind it ("files are the database").

Layout ``<dir>/<config_fingerprint>/<ns_hash>/<id>.kv``, one ``engine.kv.kvfile``
file per entry; the token prefix lives in each file's header, and the index
is rebuilt at startup by reading headers only. Index methods never do I/O
(they run on the event loop, next to the Scheduler's synchronous lookups);
I/O methods (``scan_files``, ``delete_files``, ``touch``) never touch the
index, so they can run on a worker thread. ``actors.cold_tier.ColdTier`` is
the actor around it; ``engine.kv.cold_io`` moves one entry between a cache
and its file.

The byte cap counts every file under our fingerprint folder and is enforced
at write time by evicting the least recently used entries first (``reserve``;
``evict_bytes`` frees room when the disk fills below the cap). With an
``engine.kv.budget.SsdBudget`` the cap is one across every model's store, and
the entries evicted may be another model's.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from engine.kv import kvfile
from engine.kv.budget import OfflineFile, SsdBudget
from engine.kv.disk import Disk, FileStat, NotRegularFile
from engine.kv.kvfile import KvHeader, KvMeta, KvReader
from engine.kv.prompt_cache import PrefixIndex, as_tokens, token_bytes, usable_prefix

log = logging.getLogger("ember.cold_tier")


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


# What an eviction hands back to have its file deleted: an entry, or (shared
# budget) a file another run left in a folder no loaded model indexes.
Victim = ColdEntry | OfflineFile


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
        budget: SsdBudget | None = None,
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
        self.budget = budget  # one cap across models' stores (None: this store's own max_bytes)
        if budget is not None:
            self.counters["evicted_by_others"] = 0  # entries another model's write (or scan) pushed out
            budget.attach(self)

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
    def load_index(self, scan: ScanResult) -> list[Victim]:
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
        if self.budget is not None:  # the shared cap: over it, the oldest files of any model go
            self.budget.attach(self)
            over = self.budget.bytes - self.budget.max_bytes
            return self.budget.victims(over, asker=self) if over > 0 else []
        victims: list[Victim] = []
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
        if self.budget is not None:  # one recency order across the models sharing the cap
            self._seq = self.budget.next_seq()
            return self._seq
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

    def find(self, tokens: Sequence[int] | np.ndarray, ns: str) -> tuple[ColdEntry | None, int]:
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

    def longest(self, tokens: Sequence[int] | np.ndarray, ns: str) -> int:
        return self.find(tokens, ns)[1]

    def closest(self, tokens: Sequence[int] | np.ndarray, ns: str) -> tuple[np.ndarray | None, int]:
        """``PromptCache.closest`` over the files indexed (a pure lookup)."""
        e, n = self._index.closest(ns, as_tokens(tokens))
        return (None, 0) if e is None else (e.tokens, n)

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

    def reserve(self, path: str, nbytes: int) -> list[Victim] | None:
        """Make room for a file of ``nbytes`` at ``path``: the least recently
        used entries to evict (already out of the index), or None when it
        cannot fit even in an empty tier (the write is refused)."""
        replaced = self._paths.get(path)
        if self.budget is not None:
            return self._reserve_shared(self.budget, path, nbytes, replaced.nbytes if replaced else 0)
        base = self.bytes - (replaced.nbytes if replaced else 0)  # a rename replaces the same-key file
        if nbytes > self.max_bytes - self.other_bytes - self.reserved:
            self.counters["refused"] += 1
            return None
        victims: list[Victim] = []
        for e in self._paths.values():  # least recently used first; removed after the walk
            if base + nbytes <= self.max_bytes:
                break
            if e.path == path:
                continue
            victims.append(e)
            base -= e.nbytes
        for v in victims:
            self._remove_path(v.path)
        self.counters["evictions"] += len(victims)
        self.reserved += nbytes
        return victims

    def _reserve_shared(self, budget: SsdBudget, path: str, nbytes: int, replaced: int) -> list[Victim] | None:
        """``reserve`` under the shared cap: the same rule, over every store's files."""
        if nbytes > budget.max_bytes - budget.pinned_bytes():
            self.counters["refused"] += 1
            return None
        over = budget.bytes - replaced + nbytes - budget.max_bytes
        victims = budget.victims(over, asker=self, keep=path) if over > 0 else []
        self.reserved += nbytes
        return victims

    def evict_bytes(self, nbytes: int, *, keep: str = "") -> list[Victim]:
        """The least recently used entries holding at least ``nbytes`` (all of
        them if fewer), out of the index; their files are to be deleted. For a
        disk that filled below the cap (ENOSPC). Under a shared budget, any
        model's."""
        if self.budget is not None:
            shared = self.budget.victims(nbytes, asker=self, keep=keep)
            self.counters["enospc_evictions"] += len(shared)
            return shared
        victims: list[Victim] = []
        freed = 0
        for e in self._paths.values():  # least recently used first
            if freed >= nbytes:
                break
            if e.path != keep:
                victims.append(e)
                freed += e.nbytes
        for v in victims:
            self._remove_path(v.path)
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
            "max_bytes": self.max_bytes if self.budget is None else self.budget.max_bytes,
            "restore_ms_last": self.restore_ms_last,
            **self.counters,
            **({"shared": self.budget.stats()} if self.budget is not None else {}),
        }
