"""The float32 kernel as an MLX primitive (engine.mlx.mlx_ops ``fmm``,
csrc/qmm_t.c ``fmm_t``) against a float64 product, the layers around it
(engine.mlx.fmm_linear), and the backend with it on against mlx-lm's own
generation on the same weights."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.mlx import fmm_linear as fl
from engine.mlx import mlx_ops

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel is for MLX's CPU backend only")


@pytest.fixture(scope="module")
def ops():
    got = mlx_ops.load()
    # a machine that runs this suite has a C++ compiler and nanobind (a
    # dependency): an extension that stopped building is a regression, not a skip
    assert got is not None, mlx_ops.unavailable
    if not got.fmm_available():
        pytest.skip("this CPU has no AVX-512: the float32 kernel is not built (MLX's matmul serves)")
    return got


def _close(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Within float32 rounding of a K-term sum: |error| <= 1e-5 * sum |x w|."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    bound = 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 9, 12, 17])
@pytest.mark.parametrize(("N", "K"), [(1, 16), (7, 40), (37, 576), (100, 1000), (65, 1536)])
def test_fmm_is_the_product_within_rounding(ops, M, N, K):
    rng = np.random.default_rng(M * 1000 + N * K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    _close(np.asarray(ops.fmm(mx.array(x), mx.array(w), 2)), x, w)


def test_a_row_does_not_depend_on_the_others_or_the_threads(ops):
    """Each output is one chain of sums in k order, whatever the tile (rows of x
    held together) or the split across threads: the same bits."""
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((9, 300)).astype(np.float32))
    w = mx.array(rng.standard_normal((70, 300)).astype(np.float32))
    whole = np.asarray(ops.fmm(x, w, 2))
    for m in range(9):
        alone = np.asarray(ops.fmm(x[m : m + 1], w, 1))
        assert np.array_equal(alone[0].view(np.uint32), whole[m].view(np.uint32)), m


def test_chunks_taken_from_both_ends_cover_every_row_once(ops):
    """Many chunks of 32 weight rows (the caller from the front, workers from
    the back, a last chunk longer than the rest): every row once, the same
    bits on 1, 2, 3 and 5 threads, and the product within rounding."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal((32 * 37 + 11, 64)).astype(np.float32)
    one = np.asarray(ops.fmm(mx.array(x), mx.array(w), 1))
    _close(one, x, w)
    for threads in (2, 3, 5):
        got = np.asarray(ops.fmm(mx.array(x), mx.array(w), threads))
        assert np.array_equal(got.view(np.uint32), one.view(np.uint32)), threads


def test_fmm_is_a_lazy_node_of_the_graph_and_takes_views(ops):
    """Built without evaluating anything, composed with MLX's ops, on inputs
    that are views (a transpose, a slice, a broadcast) and batched shapes."""
    rng = np.random.default_rng(3)
    xa = rng.standard_normal((2, 3, 48)).astype(np.float32)
    wa = rng.standard_normal((48, 20)).astype(np.float32)  # stored (in, out): w is its transpose
    x, w_t = mx.array(xa), mx.array(wa)
    y = ops.fmm(x * 2.0, w_t.T, 2) + 1.0  # nothing evaluated yet
    assert y.shape == (2, 3, 20)
    got = np.asarray(y).reshape(6, 20)
    ref = (2.0 * xa.reshape(6, 48)).astype(np.float64) @ wa.astype(np.float64) + 1.0
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-4)
    row = mx.broadcast_to(mx.array(xa[0, 0]), (4, 48))
    _close(np.asarray(ops.fmm(row, w_t.T[:11], 1)), np.broadcast_to(xa[0, 0], (4, 48)), wa.T[:11])


def test_fmm_refuses_what_it_does_not_take(ops):
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError):
        ops.fmm(x, mx.zeros((3, 9)), 1)  # K differs
    with pytest.raises(ValueError):
        ops.fmm(x.astype(mx.float16), mx.zeros((3, 8)), 1)


def _tiny_linear_model():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 96)
            self.b = nn.Linear(96, 32, bias=False)
            self.emb = nn.Embedding(50, 32)

        def __call__(self, x):
            return self.emb.as_linear(self.b(nn.relu(self.a(x))))

    m = Two()
    mx.eval(m.parameters())
    return m


def test_install_routes_few_rows_to_the_kernel_and_many_to_mlx(ops):
    model = _tiny_linear_model()
    x_few = mx.array(np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32))
    x_many = mx.array(np.random.default_rng(2).standard_normal((fl.MAX_ROWS + 1, 64)).astype(np.float32))
    want_few, want_many = np.asarray(model(x_few)), np.asarray(model(x_many))
    assert fl.install(model) == 3
    try:
        before = dict(fl.calls)
        got_few = np.asarray(model(x_few))
        assert fl.calls["kernel"] - before["kernel"] == 3 and fl.calls["mlx"] == before["mlx"]
        assert np.allclose(got_few, want_few, rtol=1e-5, atol=1e-5)
        got_many = np.asarray(model(x_many))
        assert fl.calls["mlx"] - before["mlx"] == 3  # MLX's GEMM: the same bits as before the hook
        assert np.array_equal(got_many, want_many)
    finally:
        assert fl.uninstall(model) == 3
    assert type(model.a) is nn.Linear and type(model.emb) is nn.Embedding


def test_the_switch_keeps_mlx_matmul(ops, monkeypatch):
    from engine.config import EngineConfig
    from transport.cli import build_parser, engine_config

    monkeypatch.setenv(fl.SWITCH, "0")
    assert fl.install(_tiny_linear_model()) == 0
    assert EngineConfig().fmm_kernel is True
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--no-fmm-kernel"])
    assert engine_config(args, parser).fmm_kernel is False


@pytest.mark.slow
@pytest.mark.parametrize("on", [True, False], ids=["kernel", "switched-off"])
def test_backend_on_a_float32_model_decodes_as_mlx_lm(tmp_path_factory, ops, on):
    """The bundled tiny model in float32: the backend's greedy decode (prefill
    chunks, run-ahead) equals mlx-lm's generate_step on its own load of the
    same directory, with the kernel on or off; with it on the backend still runs
    ahead (the kernel is a node of the graph, nothing is evaluated while it is built)."""
    from mlx_lm import convert, load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from engine.config import EngineConfig
    from engine.mlx.backend import load_mlx_backend
    from engine.models import resolve_model
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
    from engine.types import SamplingParams

    path = tmp_path_factory.mktemp("f32") / "tiny-f32"
    convert(str(resolve_model("tiny")), mlx_path=str(path), dtype="float32")
    backend, device = load_mlx_backend(EngineConfig(backend="mlx", model=str(path), fmm_kernel=on))
    try:
        assert (backend.counters["fmm_kernel_layers"] > 0) is on
        prompt = backend.tokenizer.encode("def add(a, b):\n    return a + b\n\nclass Point:\n")
        oracle = device.call(lambda: load(str(path))[0])
        assert not any(type(m).__module__ == fl.__name__ for m in oracle.modules())
        ref = device.call(
            lambda: [t for t, _ in generate_step(mx.array(prompt), oracle, max_tokens=24, sampler=make_sampler(0.0))]
        )
        backend.max_ahead = 2
        step = lambda **kw: device.call(backend.step, StepPlan(**kw))  # noqa: E731
        step(open=[OpenRow(1, SamplingParams(max_tokens=10_000, ignore_eos=True))])
        body = prompt[:-1]
        for i in range(0, len(body), 8):
            assert not step(prefill=[PrefillChunk(1, body[i : i + 8])]).errors
        before = fl.calls["kernel"]
        out, tok = [], prompt[-1]
        for _ in range(24):
            tok = step(decode=[DecodeRow(1, tok)]).tokens[1]
            out.append(tok)
            device.call(backend.run_ahead, lambda: True)
        step(close=[1])
        assert out == ref
        assert (fl.calls["kernel"] > before) is on
        assert backend.pipeline and backend.counters["pipelined"] > 0
    finally:
        device.close()
