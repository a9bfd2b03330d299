"""``FaultyDisk``: the ``engine.kv.disk.Disk`` port as an in-memory file system
for tests and simulations, built like FoundationDB's ``AsyncFileNonDurable``
and turmoil-fs: writes land in a volatile image and become durable only at
``fsync``; a name becomes durable only at ``fsync_dir`` of its folder.
``crash()`` throws away what was not made durable, dropping or tearing each
unsynced write by a seeded coin, so a test can prove that a file the writer
reported durable survives any crash. It also injects seeded ENOSPC, EIO and
bit flips on read. Same seed, same faults. Moved out of ``engine/kv/disk.py``
as it was (issue 31): the cold tier's port is the operating system's; this is
the fake beside the fake GPU.

All methods are synchronous; callers run them inline under virtual time.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import random
from dataclasses import dataclass, field
from typing import Any

from engine.kv.disk import Buffer, FileStat


@dataclass(slots=True)
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    # what a crash keeps; after an fsync it is ``data`` itself, shared until
    # the next write copies ``data`` (copy on write: a file written once and
    # fsynced, the cold tier's every file, is never copied)
    durable: bytes | bytearray = b""
    pending: list[tuple[int, bytes]] = field(default_factory=list)  # unsynced writes, in order
    mtime: float = 0.0


@dataclass(slots=True)
class _Handle:
    ino: int
    writable: bool


@functools.lru_cache(maxsize=4096)  # the same few thousand names, again and again
def _norm(path: str) -> str:
    p = posixpath.normpath("/" + str(path).replace(os.sep, "/"))
    return "/" + p.lstrip("/")  # normpath keeps a leading "//"


class FaultyDisk:
    """An in-memory, crash-simulating, fault-injecting ``Disk``.

    Faults (all drawn from one ``random.Random(seed)``):
    ``enospc_prob`` per write, a hard ``capacity_bytes`` (ENOSPC past it),
    ``eio_prob`` per read, ``bitflip_prob`` per read (one flipped bit in the
    returned bytes, the stored bytes stay intact), and ``crash()``, where each
    unsynced write is dropped, kept, or torn (a prefix kept) with equal odds.
    Folders are created durably; files and names follow fsync rules.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        enospc_prob: float = 0.0,
        capacity_bytes: int | None = None,
        eio_prob: float = 0.0,
        bitflip_prob: float = 0.0,
    ):
        self.rng = random.Random(seed)
        self.enospc_prob = enospc_prob
        self.capacity_bytes = capacity_bytes
        self.eio_prob = eio_prob
        self.bitflip_prob = bitflip_prob
        self._inodes: dict[int, _Inode] = {}
        self._names: dict[str, int] = {}
        self._durable_names: dict[str, int] = {}
        # the same names by folder: a folder fsync or listdir touches its own
        # names, not every name on the disk
        self._kids: dict[str, set[str]] = {}
        self._durable_kids: dict[str, set[str]] = {}
        self._dirty: dict[str, set[str]] = {}  # by folder: names changed since its last fsync_dir
        self._orphans = 0  # inodes that lost a name since the last sweep (``_sweep``)
        self._dirs: set[str] = {"/"}
        self._handles: dict[int, _Handle] = {}
        self._next = 1
        self._tick = 0.0
        self.counters = {
            "writes": 0,
            "reads": 0,
            "fsyncs": 0,
            "dir_fsyncs": 0,
            "enospc": 0,
            "eio": 0,
            "bitflips": 0,
            "crashes": 0,
        }

    # ---- helpers -----------------------------------------------------------
    @staticmethod
    def _norm(path: str) -> str:
        return _norm(path)

    def _now(self) -> float:
        self._tick += 1.0
        return self._tick

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def _inode_at(self, path: str) -> _Inode:
        p = self._norm(path)
        if p not in self._names:
            raise FileNotFoundError(errno.ENOENT, "no such file", p)
        return self._inodes[self._names[p]]

    def _name(self, path: str, ino: int) -> None:
        self._dirty.setdefault(posixpath.dirname(path), set()).add(path)
        if path not in self._names:
            self._kids.setdefault(posixpath.dirname(path), set()).add(path)
        else:
            self._orphans += 1
        self._names[path] = ino

    def _unname(self, path: str) -> int:
        ino = self._names.pop(path)
        self._kids[posixpath.dirname(path)].discard(path)
        self._dirty.setdefault(posixpath.dirname(path), set()).add(path)
        self._orphans += 1
        return ino

    def _sweep(self) -> None:
        """Forget inodes no name (volatile or durable) and no handle reaches:
        nothing can bring them back, and a long run without crashes would
        otherwise keep every file it ever wrote. Amortized: a full pass only
        once as many names were dropped as there are live ones."""
        if self._orphans <= max(64, len(self._names)):
            return
        self._orphans = 0
        live = set(self._names.values()) | set(self._durable_names.values()) | {h.ino for h in self._handles.values()}
        self._inodes = {i: n for i, n in self._inodes.items() if i in live}

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise OSError(errno.EBADF, "bad file handle")
        return h

    def _used_bytes(self) -> int:
        live = set(self._names.values()) | {h.ino for h in self._handles.values()}
        return sum(len(self._inodes[i].data) for i in live)

    # ---- the port ----------------------------------------------------------
    def open(self, path: str, *, write: bool = False) -> int:
        p = self._norm(path)
        if write:
            if posixpath.dirname(p) not in self._dirs:
                raise FileNotFoundError(errno.ENOENT, "no such folder", posixpath.dirname(p))
            ino = self._names.get(p)
            if ino is None:
                ino = self._new_id()
                self._inodes[ino] = _Inode(mtime=self._now())
                self._name(p, ino)
            else:  # O_TRUNC: an unsynced metadata change like any write
                node = self._inodes[ino]
                node.data = bytearray()
                node.pending.append((-1, b""))  # marks the truncation as unsynced
                node.mtime = self._now()
        else:
            ino = self._names.get(p)
            if ino is None:
                raise FileNotFoundError(errno.ENOENT, "no such file", p)
        fh = self._new_id()
        self._handles[fh] = _Handle(ino, write)
        return fh

    def close(self, fh: int) -> None:
        self._handles.pop(fh, None)

    def write(self, fh: int, offset: int, data: Buffer) -> None:
        h = self._handle(fh)
        if not h.writable:
            raise OSError(errno.EBADF, "handle not open for writing")
        buf = bytes(memoryview(data).cast("B"))
        node = self._inodes[h.ino]
        grow = max(0, offset + len(buf) - len(node.data))
        if self.enospc_prob and self.rng.random() < self.enospc_prob:
            self.counters["enospc"] += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if self.capacity_bytes is not None and self._used_bytes() + grow > self.capacity_bytes:
            self.counters["enospc"] += 1
            raise OSError(errno.ENOSPC, "No space left on device (capacity)")
        if node.durable is node.data:  # shared since the last fsync: copy on write
            node.data = bytearray(node.data)
        _apply(node.data, offset, buf)
        node.pending.append((offset, buf))
        node.mtime = self._now()
        self.counters["writes"] += 1

    def read(self, fh: int, offset: int, n: int) -> bytes:
        h = self._handle(fh)
        if self.eio_prob and self.rng.random() < self.eio_prob:
            self.counters["eio"] += 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        out = bytearray(self._inodes[h.ino].data[offset : offset + n])
        if out and self.bitflip_prob and self.rng.random() < self.bitflip_prob:
            bit = self.rng.randrange(len(out) * 8)
            out[bit // 8] ^= 1 << (bit % 8)
            self.counters["bitflips"] += 1
        self.counters["reads"] += 1
        return bytes(out)

    def fstat(self, fh: int) -> FileStat:
        node = self._inodes[self._handle(fh).ino]
        return FileStat(size=len(node.data), mtime=node.mtime)

    def fsync(self, fh: int) -> None:
        node = self._inodes[self._handle(fh).ino]
        node.durable = node.data  # shared until the next write (``write`` copies)
        node.pending.clear()
        self.counters["fsyncs"] += 1

    def rename(self, src: str, dst: str) -> None:
        s, d = self._norm(src), self._norm(dst)
        if s not in self._names:
            raise FileNotFoundError(errno.ENOENT, "no such file", s)
        if posixpath.dirname(d) not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "no such folder", posixpath.dirname(d))
        self._name(d, self._unname(s))

    def fsync_dir(self, path: str) -> None:
        p = self._norm(path)
        # only the names changed since this folder's last fsync (or the last
        # crash, when the volatile names became the durable ones) can differ
        durable_kids = self._durable_kids.setdefault(p, set())
        for name in self._dirty.pop(p, ()):
            ino = self._names.get(name)
            if ino is None:
                self._durable_names.pop(name, None)
                durable_kids.discard(name)
            else:
                self._durable_names[name] = ino
                durable_kids.add(name)
        self.counters["dir_fsyncs"] += 1
        self._sweep()

    def listdir(self, path: str) -> list[str]:
        p = self._norm(path)
        if p not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "no such folder", p)
        names = {posixpath.basename(n) for n in self._kids.get(p, ())}
        names |= {posixpath.basename(d) for d in self._dirs if d != p and posixpath.dirname(d) == p}
        return sorted(names)

    def unlink(self, path: str) -> None:
        p = self._norm(path)
        if p not in self._names:
            raise FileNotFoundError(errno.ENOENT, "no such file", p)
        self._unname(p)
        self._sweep()

    def stat(self, path: str) -> FileStat:
        p = self._norm(path)
        if p in self._dirs:
            return FileStat(size=0, mtime=0.0, is_dir=True, is_file=False)
        node = self._inode_at(p)
        return FileStat(size=len(node.data), mtime=node.mtime)

    def makedirs(self, path: str) -> None:
        p = self._norm(path)
        while p not in self._dirs:
            self._dirs.add(p)
            p = posixpath.dirname(p)

    def touch(self, path: str) -> None:
        self._inode_at(path).mtime = self._now()

    # ---- faults and inspection --------------------------------------------
    def crash(self) -> None:
        """Power loss: unsynced writes are dropped, kept or torn; unsynced
        names vanish (and unsynced unlinks come back); open handles die."""
        self.counters["crashes"] += 1
        for node in self._inodes.values():
            data = bytearray(node.durable)
            for offset, buf in node.pending:
                fate = self.rng.randrange(3)
                if offset < 0:  # a truncation
                    if fate:
                        data = bytearray()
                    continue
                if fate == 0:
                    continue
                if fate == 2 and buf:
                    buf = buf[: self.rng.randrange(len(buf))]
                _apply(data, offset, buf)
            node.data, node.durable, node.pending = data, bytes(data), []
        self._names = dict(self._durable_names)
        self._kids = {d: set(names) for d, names in self._durable_kids.items()}
        self._dirty.clear()
        self._orphans = 0
        self._handles.clear()
        live = set(self._names.values())
        self._inodes = {i: n for i, n in self._inodes.items() if i in live}

    def corrupt(self, path: str, offset: int, xor: int = 0xFF) -> None:
        """Flip bits at rest (durably), as bit rot would."""
        node = self._inode_at(path)
        node.data = bytearray(node.data)  # never through a ``durable`` it shares
        node.data[offset] ^= xor
        node.durable = bytes(node.data)

    def truncate(self, path: str, size: int) -> None:
        node = self._inode_at(path)
        node.data = bytearray(node.data)
        del node.data[size:]
        node.durable = bytes(node.data)

    def exists(self, path: str) -> bool:
        p = self._norm(path)
        return p in self._names or p in self._dirs

    def files(self) -> list[str]:
        return sorted(self._names)


_ZEROS = memoryview(bytes(1 << 16))  # a hole up to 64 KiB is filled from here, not a new zero string


def _zeros(n: int) -> Any:
    return _ZEROS[:n] if n <= len(_ZEROS) else bytes(n)


def _apply(data: bytearray, offset: int, buf: bytes) -> None:
    n = len(data)
    if offset >= n:  # appending (a file written front to back): one copy, not zero-fill then copy
        if offset > n:
            data += _zeros(offset - n)
        data += buf
        return
    end = offset + len(buf)
    if end > n:
        data += _zeros(end - n)
    data[offset:end] = buf
