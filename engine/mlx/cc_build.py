"""C kernels for MLX's CPU backend, built at run time by the system's C compiler.

Shared by ``engine.mlx.softmax_kernel`` and ``engine.mlx.qmm_kernel``: a
kernel's source in ``csrc/`` is compiled once into the user's cache
(``~/.cache/ember/cpu/kernels``, a name keyed by the source, the flags and the
CPU, since ``-march=native`` depends on it), atomically (two processes may
build at once), and a later start only loads it. A module keeps its own
library and ``unavailable`` reason; this one only builds and opens.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from engine.mlx.calibration_cache import cache_dir

log = logging.getLogger("ember.mlx")

# -ffp-contract=off: a contracted a*b+c rounds once where MLX rounds twice;
# no -ffast-math: it would reorder sums. -fno-trapping-math lets the
# vectorizer turn selects into blends (the values are the same).
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
LIBS = ["-lpthread", "-lm"]


def cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    text = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return text or platform.processor() or platform.machine()


def library_path(source: pathlib.Path, directory: pathlib.Path | None = None) -> pathlib.Path:
    """Where the built ``source`` for these flags and this CPU lives."""
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    digest.update(" ".join(FLAGS + LIBS).encode())
    digest.update(cpu_key().encode())
    return (directory or cache_dir()) / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build(source: pathlib.Path, target: pathlib.Path, compiler: str | None = None) -> None:
    """Compile ``source`` into ``target`` (atomically: two processes may build at once)."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), *LIBS], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def open_or_build(
    switch: str,
    path: Callable[[], pathlib.Path],
    make: Callable[[pathlib.Path], None],
    bind: Callable[[pathlib.Path], ctypes.CDLL],
) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``path()``, built by ``make`` first where missing and
    opened by ``bind``; or None and why (the environment ``switch`` set to 0,
    no compiler, a failed build or load)."""
    if os.environ.get(switch, "1") == "0":
        return None, f"{switch}=0"
    try:
        target = path()
        if not target.exists():
            make(target)
        return bind(target), None
    except (OSError, subprocess.SubprocessError) as exc:
        return None, str(exc) or type(exc).__name__
