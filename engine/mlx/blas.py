"""Re-exec under OpenBLAS on Linux: MLX's CPU backend with the reference BLAS
is ~30x slower at matmul (docs/bench/engine.md has the measured difference on
the bundled model).

The library has to be in ``LD_PRELOAD`` before the process starts (MLX binds
its BLAS symbols at load), so the only way from inside Python is to exec the
same command again with the variable set. ``EMBER_NO_OPENBLAS=1`` opts out.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from typing import Any

OPT_OUT = "EMBER_NO_OPENBLAS"


def openblas_path() -> str | None:
    """The system OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``), if installed."""
    arch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for path in (
        f"/usr/lib/{arch}/libopenblas.so.0",
        f"/usr/lib/{arch}/openblas-pthread/libopenblas.so.0",
        "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    ):
        if os.path.exists(path):
            return path
    return None


def reexec_env(environ: Mapping[str, str], platform: str = sys.platform) -> dict[str, str] | None:
    """The environment to re-exec with, or None when no re-exec is due."""
    if not platform.startswith("linux") or environ.get(OPT_OUT):
        return None
    lib = openblas_path()
    if lib is None:
        return None
    preload = environ.get("LD_PRELOAD", "")
    loaded = preload.replace(":", " ").split()
    if lib in loaded or any(os.path.basename(p) == "libopenblas.so.0" for p in loaded):
        return None
    return {**environ, "LD_PRELOAD": f"{lib} {preload}".strip()}


def maybe_reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Exec this process again with OpenBLAS preloaded, or return if not due.

    ``argv`` is the command as in ``sys.argv`` (script first); the default is
    the exact original command line (``sys.orig_argv``), which keeps
    ``python -m module`` and interpreter flags intact.
    """
    env = reexec_env(os.environ)
    if env is None:
        return
    args = list(sys.orig_argv[1:]) if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)


class BlasThreads:
    """Set the thread count of the OpenBLAS this process has loaded.

    A batch-1 decode step is 40-odd tiny GEMVs; OpenBLAS splitting each across
    the cores costs more than it gains, and on a 2-core machine it takes the
    core the event loop and MLX's dispatch need (docs/bench/engine.md measures
    it). Prefill and wide batches are real GEMMs and keep every thread. Inert
    when no OpenBLAS is loaded, or when the user pinned the count with
    ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``.
    """

    def __init__(self, environ: Mapping[str, str] = os.environ):
        self._set: Callable[[int], Any] | None = None
        self.default = 0
        self.current = 0
        if environ.get("OPENBLAS_NUM_THREADS") or environ.get("OMP_NUM_THREADS"):
            return
        try:
            import ctypes

            lib = ctypes.CDLL(None)  # LD_PRELOAD put OpenBLAS in the global namespace
            self._set = lib.openblas_set_num_threads
            self.default = self.current = int(lib.openblas_get_num_threads())
        except (OSError, AttributeError):
            self._set = None

    @property
    def active(self) -> bool:
        return self._set is not None and self.default > 1

    def use(self, n: int) -> None:
        """``n`` threads from now on (0 = the default); a no-op when unchanged."""
        n = n or self.default
        if self._set is not None and self.active and n != self.current:
            self._set(n)
            self.current = n


@functools.cache
def blas_threads() -> BlasThreads:
    """The process's one ``BlasThreads`` (the count is process-wide state)."""
    return BlasThreads()
