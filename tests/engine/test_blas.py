"""engine.mlx.blas: re-exec under OpenBLAS, once, unless opted out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.mlx import blas

SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("run", os.getpid(), sys.argv[1:], flush=True)
    from engine.mlx.blas import maybe_reexec_with_openblas
    maybe_reexec_with_openblas({argv})
    print("preload", os.environ.get("LD_PRELOAD", ""), flush=True)
    """
)


def _run(tmp_path, env_extra: dict[str, str], argv: str = "None") -> list[str]:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT.format(argv=argv))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.OPT_OUT)}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, str(script), "a", "b c"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.splitlines()


needs_openblas = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.openblas_path() is None,
    reason="no system OpenBLAS here (apt-get install libopenblas0-pthread), nothing to re-exec with",
)


@pytest.mark.slow  # subprocesses
@needs_openblas
@pytest.mark.parametrize("argv", ["None", "sys.argv"])
def test_reexecs_once_with_openblas_preloaded(tmp_path, argv):
    lines = _run(tmp_path, {"LD_PRELOAD": ""}, argv)
    runs = [ln for ln in lines if ln.startswith("run")]
    assert len(runs) == 2, lines  # the same command ran again ...
    assert runs[0] == runs[1]  # ... in the same process (exec keeps the pid) with the same args
    assert "['a', 'b c']" in runs[0]
    assert lines[-1] == f"preload {blas.openblas_path()}"


@pytest.mark.slow  # subprocesses
@needs_openblas
def test_opt_out_and_existing_preload_do_not_reexec(tmp_path):
    lines = _run(tmp_path, {blas.OPT_OUT: "1"})
    assert [ln.split()[0] for ln in lines] == ["run", "preload"]
    assert lines[-1].strip() == "preload"
    lines = _run(tmp_path, {"LD_PRELOAD": blas.openblas_path()})
    assert [ln.split()[0] for ln in lines] == ["run", "preload"]


def test_reexec_env_rules(monkeypatch):
    lib = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    monkeypatch.setattr(blas, "openblas_path", lambda: lib)
    assert blas.reexec_env({}, "darwin") is None
    assert blas.reexec_env({blas.OPT_OUT: "1"}, "linux") is None
    assert blas.reexec_env({"LD_PRELOAD": f"/x/libjemalloc.so:{lib}"}, "linux") is None
    env = blas.reexec_env({"LD_PRELOAD": "/x/libjemalloc.so", "HOME": "/h"}, "linux")
    assert env == {"LD_PRELOAD": f"{lib} /x/libjemalloc.so", "HOME": "/h"}
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    assert blas.reexec_env({}, "linux") is None


def test_blas_threads_inert_when_the_user_pinned_the_count():
    assert not blas.BlasThreads({"OPENBLAS_NUM_THREADS": "3"}).active
    assert not blas.BlasThreads({"OMP_NUM_THREADS": "2"}).active


@pytest.mark.skipif(blas.BlasThreads({}).default < 2, reason="needs OpenBLAS loaded with more than one thread")
def test_blas_threads_switches_the_loaded_library_and_back():
    import ctypes

    get = ctypes.CDLL(None).openblas_get_num_threads
    t = blas.BlasThreads({})
    default = t.default
    try:
        t.use(1)
        assert get() == 1 and t.current == 1
        t.use(0)
        assert get() == default and t.current == default
    finally:
        t.use(0)


@pytest.mark.skipif(blas.blas_threads().default < 2, reason="needs OpenBLAS loaded with more than one thread")
def test_mlx_backend_decodes_one_row_on_its_calibrated_count_and_prefills_on_all(tmp_path, monkeypatch):
    import pathlib

    from engine.config import EngineConfig
    from engine.mlx import calibration_cache as cpu_calibration_cache
    from engine.mlx.backend import MLXBackend
    from engine.mlx.cpu_layout import CpuChoice
    from engine.models import resolve_model
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
    from engine.types import SamplingParams

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_calibration_cache, "CACHE_MIN_S", 0.0)  # tiny calibrates in ~0.1 s
    be = MLXBackend.load(pathlib.Path(resolve_model("tiny")), EngineConfig())
    assert be.cpu_choice["source"] == "measured"
    # a restart reads the calibration back instead of measuring (engine.mlx.calibration_cache)
    again = MLXBackend.load(pathlib.Path(resolve_model("tiny")), EngineConfig())
    assert again.cpu_choice["source"] == "cache" and len(list((tmp_path / "cpu").glob("*.json"))) == 1
    assert again.cpu_choice["pretranspose"] == be.cpu_choice["pretranspose"]
    assert again.counters["pretransposed_linears"] == be.counters["pretransposed_linears"]
    threads = blas.blas_threads()
    ids = be.tokenizer.encode("import os\nimport sys\n")
    sp = SamplingParams(max_tokens=8)
    try:
        be.step(StepPlan(open=[OpenRow(1, sp)], prefill=[PrefillChunk(1, ids[:-1])], decode=[DecodeRow(1, ids[-1])]))
        assert threads.current == threads.default  # a prefill step is a real GEMM
        res = be.step(StepPlan(decode=[DecodeRow(1, 5)]))
        # the count per decode width is measured per model at load (cpu_layout.calibrate)
        assert be.cpu_choice["small_forward_threads"] == be.cpu_threads.threads_for(1) in (0, 1)
        assert threads.current == (be.cpu_threads.threads_for(1) or threads.default) and res.tokens
        be.cpu_threads = CpuChoice(False, {1: 1}, {})
        be.step(StepPlan(decode=[DecodeRow(1, res.tokens[1])]))
        assert threads.current == 1
    finally:
        threads.use(0)
