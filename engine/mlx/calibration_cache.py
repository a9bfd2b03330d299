"""The CPU calibration (``engine.mlx.cpu_layout.calibrate``) kept on disk.

Timing a real model's decode steps in two layouts on several thread counts
takes ~10 s, which made Ember's start 11-14 s against 1-2.4 s for
``mlx_lm.server`` on SmolLM2-135M (issue 24). The answer depends only on the
model, its dtype, the MLX build and the CPU, so it is measured once and read
back at later starts, from ``<cache>/cpu/<key>.json`` beside the converted GGUF
models (``EMBER_CACHE_DIR``, else ``$XDG_CACHE_HOME/ember``, else
``~/.cache/ember``).

A missing, unreadable or malformed file is a re-measure, never a failed start;
a file that cannot be written is only logged. ``EMBER_CPU_RECALIBRATE=1``
measures again and overwrites.

The machine's load decides the answer, not only the model: on the 2-core test
machine one OpenBLAS thread won every decode shape at load ~15 and lost the
8-row shape by 1.25x at load ~1 (docs/bench/gguf-smollm2.md). So the file
records the 1-minute load average just before the measurement, and a choice made on
a busy machine (load above the core count) is measured once more at the first
start that finds the machine quiet (load at most half the cores); a choice made
quiet is kept whatever the load at later starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.cache_dir import cache_root
from engine.mlx.cpu_layout import CALIBRATION_ROWS, LAYOUT_ROWS, CpuChoice

log = logging.getLogger(__name__)

CACHE_VERSION = 4  # bump when calibrate measures or chooses differently (4: LAYOUT_MARGIN)
RECALIBRATE = "EMBER_CPU_RECALIBRATE"
# A calibration that took less than this is not written: re-measuring costs the
# start less than the file is worth (the toy and the tests' small models take
# ~0.1 s; SmolLM2-135M 20-60 s on the shared 2-core machine).
CACHE_MIN_S = 2.0


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not every platform has it
        return None


def measured_busy(measured_load: float | None, cores: int) -> bool:
    """A calibration timed while other work shared the cores."""
    return measured_load is not None and measured_load > cores


def quiet_now(load: float | None, cores: int) -> bool:
    return load is not None and load <= cores / 2


def cache_dir(environ: Mapping[str, str] = os.environ) -> pathlib.Path:
    return pathlib.Path(cache_root(environ)) / "cpu"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(*, model: str, dtype: str, blas: Any, allow_pretranspose: bool) -> str:
    """Model identity (e.g. its weights digest) + dtype + MLX version + CPU model,
    core count and OpenBLAS thread count + what calibrate may choose."""
    import mlx.core as mx

    blob = json.dumps(
        {
            "v": CACHE_VERSION,
            "model": model,
            "dtype": dtype,
            "mlx": getattr(mx, "__version__", "?"),  # not in mlx.core's stubs
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "blas_threads": blas.default if blas.active else 0,
            "pretranspose": allow_pretranspose,
            "rows": [CALIBRATION_ROWS, LAYOUT_ROWS],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_choice(key: str, directory: pathlib.Path | None = None) -> CpuChoice | None:
    """The cached choice for ``key``, or None (missing, unreadable, malformed)."""
    return _load(key, directory)[0]


def _load(key: str, directory: pathlib.Path | None) -> tuple[CpuChoice | None, float | None]:
    """The cached choice and the load average it was measured at (None: unknown)."""
    path = (directory or cache_dir()) / f"{key}.json"
    try:
        d = json.loads(path.read_text())
        load = d.get("measured_load") if isinstance(d, dict) else None
        return CpuChoice.from_dict(d), float(load) if isinstance(load, int | float) else None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # json.JSONDecodeError is a ValueError
        log.warning("[mlx] CPU calibration cache %s unusable (%s); measuring again", path, exc)
        return None, None


def store_choice(
    key: str, choice: CpuChoice, directory: pathlib.Path | None = None, *, measured_load: float | None = None
) -> bool:
    """Write atomically (a temporary file renamed into place); False if it could not."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({**choice.as_dict(), "measured_load": measured_load}, fh, indent=1)
        os.replace(tmp, directory / f"{key}.json")
        return True
    except OSError as exc:
        log.warning("[mlx] CPU calibration not cached in %s (%s)", directory, exc)
        return False


def cached_calibration(
    key: str,
    measure: Callable[[], CpuChoice],
    apply: Callable[[CpuChoice], None],
    *,
    directory: pathlib.Path | None = None,
    environ: Mapping[str, str] = os.environ,
    loadavg: Callable[[], float | None] | None = None,
    cores: int | None = None,
) -> CpuChoice:
    """The cached choice for ``key`` applied with ``apply``, or else ``measure()``
    (which leaves the model in its choice) stored for next time. A skipped
    calibration (a model too slow to time) is stored too: otherwise a restart
    at a quieter moment measures for a minute (Gemma-3-270M's respawn in the
    4k restart run: ready in 49 s). One quicker than ``CACHE_MIN_S`` is not.
    A choice measured on a busy machine is measured again when this start
    finds it quiet (module docstring)."""
    cores = cores or os.cpu_count() or 1
    loadavg = loadavg or _loadavg
    if not environ.get(RECALIBRATE):
        choice, measured_load = _load(key, directory)
        if choice is not None:
            if not (measured_busy(measured_load, cores) and quiet_now(loadavg(), cores)):
                apply(choice)
                return choice
            log.info(
                "[mlx] CPU calibration was measured at load %.1f on %d cores; the machine is quiet now: measuring again",
                measured_load,
                cores,
            )
    # The load just before measuring: the measurement's own threads would count
    # in an average taken after it and mark every calibration busy.
    before = loadavg()
    t = time.perf_counter()
    choice = measure()
    if choice.skipped or time.perf_counter() - t >= CACHE_MIN_S:
        store_choice(key, choice, directory, measured_load=before)
    return choice
