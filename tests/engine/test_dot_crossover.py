"""engine.mlx.dot_crossover: where 8-bit prefill calls leave the integer dot
path for dequantize + GEMM, measured per CPU and kept; and the hook's routing."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.mlx import dot_crossover as dc
from engine.mlx import qmm_kernel as qk
from engine.mlx import qmm_linear as ql

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel is for MLX's CPU backend only")


@pytest.fixture(autouse=True)
def hook_state():
    saved = dict(ql._state)
    yield
    ql._state.update(saved)


def _times(dot: dict[int, float], gemm: dict[int, float]) -> dict[tuple[str, int], float]:
    return {**{("dot", m): t for m, t in dot.items()}, **{("gemm", m): t for m, t in gemm.items()}}


def test_the_crossover_is_where_gemm_wins_from_there_on():
    dot = {128: 1.0, 256: 2.0, 384: 3.0, 512: 4.0}
    assert dc.crossover(_times(dot, {128: 0.7, 256: 2.1, 384: 2.5, 512: 3.0})) == 384  # 256: dot wins
    assert dc.crossover(_times(dot, {128: 0.7, 256: 1.5, 384: 2.5, 512: 3.0})) == 128
    assert dc.crossover(_times(dot, {128: 2.0, 256: 4.0, 384: 3.5, 512: 3.9})) == 0  # within the margin at 512
    assert dc.crossover(_times(dot, {128: 0.5, 256: 1.0, 384: 3.3, 512: 3.0})) == 512  # not at 384: only 512


def test_measure_alternates_and_keeps_minima():
    seen = []

    def timer(path, m):
        seen.append((path, m))
        return {"dot": 2.0, "gemm": 1.0}[path] * m + len(seen) % 3

    got = dc.measure(timer, rows=(128, 512), reps=3)
    assert seen[:4] == [("dot", 128), ("gemm", 128), ("dot", 512), ("gemm", 512)] and len(seen) == 12
    assert got[("gemm", 128)] == 128.0 and got[("dot", 512)] == 1024.0


class _Model(nn.Module):
    def __init__(self, N, K, bits=8):
        super().__init__()
        self.proj = nn.QuantizedLinear(K, N, bias=False, group_size=64, bits=bits)


def test_the_largest_8_bit_matrix_within_bounds_stands_for_the_model():
    m = _Model(1024, 1024)
    assert dc.largest_8bit(m) == (1024, 1024, 64)
    assert dc.largest_8bit(_Model(64, 256)) is None  # a toy: nothing worth measuring
    assert dc.largest_8bit(_Model(1024, 1024, bits=4)) is None


def test_measured_once_then_read_back_and_a_bad_file_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(dc.SWITCH, raising=False)
    monkeypatch.setattr(ql, "_state", {**ql._state, "lib": object(), "dot": True, "prefill_rows": 64, "threads": 2})
    calls = []

    def fake_timer(lib, N, K, gs, threads):
        calls.append((N, K, gs, threads))
        return lambda path, m: {"dot": 1.0, "gemm": 0.8 if m >= 384 else 1.2}[path]

    monkeypatch.setattr(dc, "shape_timer", fake_timer)
    model = _Model(1024, 1024)
    assert dc.apply(model) == 384 and ql.dot_rows() == 384 and calls == [(1024, 1024, 64, 2)]
    files = list((tmp_path / "cpu").glob("dot-rows-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["rows"] == 384
    ql.set_dot_rows(0)
    assert dc.apply(model) == 384 and len(calls) == 1  # read back, not measured
    files[0].write_text("{not json")
    assert dc.apply(model) == 384 and len(calls) == 2  # a malformed file is a re-measure, never a failed start


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv(dc.SWITCH, "256")
    assert dc.apply(_Model(1024, 1024)) == 256 and ql.dot_rows() == 256
    monkeypatch.setenv(dc.SWITCH, "lots")
    assert dc.apply(_Model(1024, 1024)) == 0


def test_calls_from_the_crossover_take_dequantize_and_gemm():
    lib = qk.load()
    assert lib is not None, qk.unavailable
    if not qk.dot_available(lib):
        pytest.skip("this CPU has no AVX-512 VNNI: the dot path is not built (the exact kernel serves)")
    layer = nn.QuantizedLinear(256, 200, bias=False, group_size=64, bits=8)
    mx.eval(layer.parameters())
    assert ql.install(layer, lib, dot=True, prefill=True) == 1
    try:
        ql.set_dot_rows(128)
        for rows, path in ((100, "dot"), (128, "dequant_gemm"), (300, "dequant_gemm")):
            x = mx.random.normal((1, rows, 256))
            before = dict(ql.calls)
            got = np.asarray(layer(x))
            assert ql.calls[path] - before[path] == 1, (rows, path)
            want = np.asarray(nn.QuantizedLinear.__call__(layer, x))
            assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
        ql.set_dot_rows(0)
        before = dict(ql.calls)
        layer(mx.random.normal((1, 300, 256)))
        assert ql.calls["dot"] - before["dot"] == 1  # 0: the dot path at every size
        timer = dc.shape_timer(lib, 1024, 1024, 64, 1)  # what apply measures with: both paths really run
        assert timer("dot", 128) > 0 and timer("gemm", 512) > 0
    finally:
        ql.uninstall(layer)
