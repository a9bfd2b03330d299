"""The Disk port: every file the cold tier touches goes through one of these.

``RealDisk`` is the operating system (positional reads and writes on file
descriptors, ``fsync`` — ``F_FULLFSYNC`` on macOS, where plain ``fsync`` does
not reach the platter — and a directory fsync after renames).

Its simulated twin, the in-memory, crash-simulating, fault-injecting
``FaultyDisk`` of the tests and simulations, lives with the other fakes in
``engine.fake.disk``.

All methods are synchronous; callers run them off the event loop (a worker
thread in production, inline under virtual time).
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import sys
from dataclasses import dataclass
from typing import Protocol

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class FileStat:
    """What ``stat`` says of a name, not of what a link points to: a symlink,
    FIFO or device is neither ``is_dir`` nor ``is_file``."""

    size: int
    mtime: float
    is_dir: bool = False
    is_file: bool = True


class NotRegularFile(OSError):
    """``open`` reached something other than a regular file (a FIFO, a device,
    a directory): the cache folder is untrusted input, and only regular files
    are ever read, written or deleted."""


class Disk(Protocol):
    def open(self, path: str, *, write: bool = False) -> int:
        """A handle for positional I/O; ``write`` creates or truncates."""
        ...

    def close(self, fh: int) -> None: ...

    def write(self, fh: int, offset: int, data: Buffer) -> None: ...

    def read(self, fh: int, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at end of file)."""
        ...

    def fstat(self, fh: int) -> FileStat:
        """The open file's own size and time (no race with a rename or a swap)."""
        ...

    def fsync(self, fh: int) -> None: ...

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` with ``src``."""
        ...

    def fsync_dir(self, path: str) -> None: ...

    def listdir(self, path: str) -> list[str]: ...

    def unlink(self, path: str) -> None: ...

    def stat(self, path: str) -> FileStat:
        """Of the name itself: a symlink is reported as what it is, never followed."""
        ...

    def makedirs(self, path: str) -> None: ...

    def touch(self, path: str) -> None:
        """Set the file's mtime to now (use recency that survives a restart)."""
        ...


# ---------------------------------------------------------------------------


class RealDisk:
    """The operating system's file system."""

    def open(self, path: str, *, write: bool = False) -> int:
        # O_NOFOLLOW: a symlink planted in the folder is never followed (ELOOP);
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a
        # writer forever; the fstat then refuses anything but a regular file.
        flags = (os.O_RDWR | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
        flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, flags, 0o644)
        try:
            if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFile(errno.EINVAL, "not a regular file", path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self, fh: int) -> None:
        os.close(fh)

    def write(self, fh: int, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fh, view, offset)
            view, offset = view[n:], offset + n

    def read(self, fh: int, offset: int, n: int) -> bytes:
        parts: list[bytes] = []
        while n > 0:
            chunk = os.pread(fh, n, offset)
            if not chunk:
                break
            parts.append(chunk)
            n -= len(chunk)
            offset += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fstat(self, fh: int) -> FileStat:
        st = os.fstat(fh)
        return FileStat(size=st.st_size, mtime=st.st_mtime, is_dir=False, is_file=stat_mod.S_ISREG(st.st_mode))

    def fsync(self, fh: int) -> None:
        _full_fsync(fh)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            _full_fsync(fd)
        finally:
            os.close(fd)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def stat(self, path: str) -> FileStat:
        st = os.lstat(path)
        return FileStat(
            size=st.st_size,
            mtime=st.st_mtime,
            is_dir=stat_mod.S_ISDIR(st.st_mode),
            is_file=stat_mod.S_ISREG(st.st_mode),
        )

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def touch(self, path: str) -> None:
        os.utime(path, None)


def _full_fsync(fd: int) -> None:
    if sys.platform == "darwin":
        import fcntl

        if hasattr(fcntl, "F_FULLFSYNC"):
            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:
                pass  # not supported by this file system: plain fsync below
    os.fsync(fd)
