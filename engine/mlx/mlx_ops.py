"""``csrc/qmm_t.c``'s kernels as MLX primitives (``csrc/mlx_ops.cpp``), built at run time.

Called from Python (``engine.mlx.qmm_linear``'s first path) a kernel needs
its input evaluated first: ``mx.eval`` per layer, a round trip to MLX's CPU
stream thread, ~40-70 us a call and ~200 calls a decode step, with the graph
cut at every layer. As primitives the kernels are nodes of MLX's own graph:
no evaluation in the middle of building it, and the backend's run-ahead
(building the next step while this one computes) works for hooked models.

The extension is C++ against the installed MLX's headers and ``libmlx``, with
the nanobind MLX's Python module was built with (its ABI and its domain,
``mlx``: only then does an ``mx.array`` cross into it). It is compiled once
into the user's cache (``engine.mlx.cc_build``'s directory), keyed by the
sources, the flags, the CPU, MLX's and nanobind's versions; a smoke test at
load compares both ops with numpy and ``mx.quantized_matmul``. Where anything
is missing (a C++ compiler, nanobind, MLX's headers) or fails, ``load()``
returns None with the reason in ``unavailable``, and the callers keep their
Python path. ``EMBER_MLX_OPS=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from types import ModuleType

import mlx.core as mx
import numpy as np

from engine.mlx import cc_build
from engine.mlx.calibration_cache import cache_dir

log = logging.getLogger("ember.mlx")

SWITCH = "EMBER_MLX_OPS"
CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCES = (CSRC / "mlx_ops.cpp", CSRC / "qmm_t.c")
MODULE = "_ember_mlx_ops"  # NB_MODULE's name in mlx_ops.cpp
NB_DOMAIN = "mlx"  # MLX's Python module keeps its nanobind types in this domain
CXX_FLAGS = ["-O2", "-std=c++20", f"-DNB_DOMAIN={NB_DOMAIN}", "-fPIC", "-shared", "-fvisibility=hidden"]
BUILD_TIMEOUT_S = 600  # nanobind's sources and MLX's headers: ~10-60 s on 2 cores

_lock = threading.Lock()
_mod: ModuleType | None = None
_tried = False
unavailable: str | None = None  # why load() returned None, once it has


def _toolchain() -> dict[str, str]:
    """Versions and paths the build depends on; OSError where one is missing."""
    if importlib.util.find_spec("nanobind") is None:  # a core dependency on Linux only
        raise OSError("nanobind is not installed")
    import nanobind

    mlx_dir = pathlib.Path(mx.__file__).parent
    if not (mlx_dir / "include" / "mlx" / "mlx.h").exists():
        raise OSError(f"MLX's C++ headers are not in {mlx_dir / 'include'}")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise OSError("no C++ compiler (c++, g++ or $CXX) on PATH")
    return {
        "cxx": cxx,
        "mlx_dir": str(mlx_dir),
        "mlx": getattr(mx, "__version__", "?"),
        "nanobind": nanobind.__version__,
        "nb_include": nanobind.include_dir(),
        "nb_source": nanobind.source_dir(),
        "python": sysconfig.get_paths()["include"],
        "abi": sys.implementation.cache_tag or "",
    }


def library_path(tools: dict[str, str], directory: pathlib.Path | None = None) -> pathlib.Path:
    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join(CXX_FLAGS + cc_build.FLAGS).encode())
    digest.update(cc_build.cpu_key().encode())
    for k in ("mlx", "nanobind", "abi", "mlx_dir"):
        digest.update(tools[k].encode())
    return (directory or cache_dir()) / "kernels" / f"mlx_ops-{digest.hexdigest()[:16]}.so"


def build(tools: dict[str, str], target: pathlib.Path) -> None:
    """Compile the extension into ``target`` (atomically)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj = pathlib.Path(tmp) / "qmm_t.o"
        # the C kernels with their own flags (no contraction: MLX's bits)
        c_flags = [f for f in cc_build.FLAGS if f != "-shared"]
        _run([cc, *c_flags, "-c", "-o", str(obj), str(SOURCES[1])])
        src = pathlib.Path(tools["nb_source"])
        robin = src.parent / "ext" / "robin_map" / "include"
        lib = pathlib.Path(tools["mlx_dir"]) / "lib"
        out = pathlib.Path(tmp) / "ops.so"
        _run(
            [
                tools["cxx"],
                *CXX_FLAGS,
                f"-I{tools['mlx_dir']}/include",
                f"-I{tools['nb_include']}",
                f"-I{robin}",
                f"-I{tools['python']}",
                str(SOURCES[0]),
                str(src / "nb_combined.cpp"),
                str(obj),
                f"-L{lib}",
                "-lmlx",
                f"-Wl,-rpath,{lib}",
                "-lpthread",
                "-o",
                str(out),
            ]  # fmt: skip
        )
        os.replace(out, target)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise OSError(f"{cmd[0]} failed: {done.stderr.strip()[-800:]}")


def _import(path: pathlib.Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        raise OSError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def smoke_test(mod: ModuleType) -> None:
    """Both ops on small arrays, against numpy and ``mx.quantized_matmul``;
    ValueError where an answer is wrong, TypeError where MLX's arrays do not
    cross (another nanobind ABI or domain)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    if mod.fmm_available():
        w = rng.standard_normal((37, 64)).astype(np.float32)
        y = np.asarray(mod.fmm(mx.array(x), mx.array(w), 2))
        if not np.allclose(y, x @ w.T, rtol=1e-4, atol=1e-4):
            raise ValueError("fmm's smoke test gave a wrong product")
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((40, 64)).astype(np.float32)), group_size=32, bits=4)
    got = mod.qmm(mx.array(x), wq, s, b, 4, 32, False, 2)
    want = mx.quantized_matmul(mx.array(x), wq, s, b, transpose=True, group_size=32, bits=4)
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        raise ValueError("qmm's smoke test differs from mx.quantized_matmul")


def load(directory: pathlib.Path | None = None) -> ModuleType | None:
    """The extension, built on first use; None (and ``unavailable`` says why) where it can't be."""
    global _mod, _tried, unavailable
    with _lock:
        if _tried and directory is None:
            return _mod
        mod, reason = None, None
        if os.environ.get(SWITCH, "1") == "0":
            reason = f"{SWITCH}=0"
        else:
            try:
                tools = _toolchain()
                target = library_path(tools, directory)
                if not target.exists():
                    build(tools, target)
                mod = _import(target)
                smoke_test(mod)
            except (OSError, ImportError, subprocess.SubprocessError, TypeError, ValueError, RuntimeError) as exc:
                mod, reason = None, f"{type(exc).__name__}: {exc}"
        if directory is None:
            _mod, _tried, unavailable = mod, True, reason
        if reason:
            log.warning(
                "MLX primitives of the CPU kernels unavailable (%s): the kernels are called from Python", reason
            )
        return mod
