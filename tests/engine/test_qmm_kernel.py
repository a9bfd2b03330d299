"""The C quantized matmul (engine.mlx.qmm_kernel) compared bit for bit with
``mx.quantized_matmul``, the layers around it (engine.mlx.qmm_linear) with
mlx-lm's own forward, and the backend with it on against mlx-lm's generation."""

from __future__ import annotations

import pathlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen2
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx import qmm_kernel as qk
from engine.mlx import qmm_linear as ql

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel is for MLX's CPU backend only")


@pytest.fixture(scope="module")
def lib():
    got = qk.load()
    # a machine that runs this suite has a C compiler (pip builds with it); a
    # kernel that stopped building is a regression, not a skip
    assert got is not None, qk.unavailable
    return got


@pytest.fixture(autouse=True)
def exact_hook():
    """The hook's settings as each test finds them: the int8 dot path off
    (an engine loaded earlier in this process may have turned it on; the
    tests of the exact kernel compare bits), put back after."""
    saved = dict(ql._state)
    ql._state["dot"] = False
    ql._state["dot_rows"] = 0  # the dot path at every size, as on the host it was built on
    yield
    ql._state.update(saved)


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def _case(seed: int, M: int, N: int, K: int, bits: int, gs: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    w = mx.array((rng.standard_normal((N, K)) * scale).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    want = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    return x, wq, s, b, want


def _kernel(lib, x, wq, s, b, bits, gs, threads=2) -> np.ndarray:
    return qk.qmm_t(
        lib, np.asarray(x), np.asarray(wq), np.asarray(s), np.asarray(b), bits=bits, group_size=gs, threads=threads
    )


# N not a multiple of 8 (the scalar tail), K words not a multiple of 8 (the
# gathered tail), groups that split a word block (4-bit, 32), one thread and more
@pytest.mark.parametrize(
    ("M", "N", "K", "bits", "gs", "threads"),
    [
        (1, 1536, 1536, 4, 64, 2),
        (1, 256, 1536, 8, 64, 2),
        (8, 520, 896, 4, 128, 2),
        (8, 264, 896, 8, 32, 3),
        (3, 70, 256, 4, 32, 2),
        (16, 136, 640, 8, 128, 1),
        (5, 40, 96, 2, 32, 2),
        (7, 24, 8960, 4, 128, 2),
        (4, 17, 64, 8, 32, 1),
        (2, 9, 320, 4, 64, 4),
        (33, 80, 192, 4, 64, 2),  # a prefill-sized call: the same loop, in chunks of rows
    ],
)
def test_kernel_is_mlx_quantized_matmul_bit_for_bit(lib, M, N, K, bits, gs, threads):
    x, wq, s, b, want = _case(M * N + K, M, N, K, bits, gs)
    got = _kernel(lib, x, wq, s, b, bits, gs, threads)
    assert np.array_equal(_bits(got), _bits(want))
    assert np.array_equal(_bits(got), _bits(_kernel(lib, x, wq, s, b, bits, gs, threads=1)))


@pytest.mark.parametrize("bits", [4, 8])
def test_every_row_count_from_1_to_16(lib, bits):
    for M in range(1, 17):
        x, wq, s, b, want = _case(M, M, 136, 512, bits, 64, scale=3.0)
        assert np.array_equal(_bits(_kernel(lib, x, wq, s, b, bits, 64)), _bits(want)), M


def test_random_shapes(lib):
    rng = np.random.default_rng(7)
    for _ in range(12):
        bits = int(rng.choice([2, 4, 8]))
        gs = int(rng.choice([32, 64, 128]))
        M, N, K = int(rng.integers(1, 17)), int(rng.integers(1, 300)), gs * int(rng.integers(1, 12))
        x, wq, s, b, want = _case(int(rng.integers(1 << 30)), M, N, K, bits, gs, scale=float(rng.uniform(0.01, 50)))
        got = _kernel(lib, x, wq, s, b, bits, gs, threads=int(rng.integers(1, 4)))
        assert np.array_equal(_bits(got), _bits(want)), (M, N, K, bits, gs)


# The AVX-512 tiles (16 rows a vector, x's rows four at a time) where the
# CPU has it: N = 16 blocks + an 8-row block + a scalar tail, M = 1..9 (4 + 4
# + 1, 4 + 3, ...), K words not a multiple of 8 (the gathered tail), groups
# of 1, 2 and 8 words, every bit width.
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("N", "K", "gs"), [(59, 512, 32), (48, 96, 32), (40, 1152, 128), (16, 64, 64)])
def test_sixteen_row_tiles_every_m(lib, bits, N, K, gs):
    for M in range(1, 10):
        x, wq, s, b, want = _case(M * 1000 + N + bits, M, N, K, bits, gs, scale=2.0)
        assert np.array_equal(_bits(_kernel(lib, x, wq, s, b, bits, gs)), _bits(want)), M


def test_kernel_without_avx512_is_mlx_bit_for_bit(tmp_path):
    """The 256-bit path (8 rows a vector) a CPU without AVX-512 takes, built
    here with AVX-512 switched off; on such a CPU the main build is this one."""
    import shutil
    import subprocess

    from engine.mlx import cc_build

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    target = tmp_path / "qmm_avx2.so"
    subprocess.run([cc, *cc_build.FLAGS, "-mno-avx512f", "-o", str(target), str(qk.SOURCE), *cc_build.LIBS], check=True)
    avx2 = qk._open(target)
    assert not qk.dot_available(avx2)  # no VNNI: the dot path declines, the exact kernel runs
    x, wq, s, b, _ = _case(1, 1, 64, 128, 8, 64)
    assert qk.qmm_t_dot(avx2, *(np.asarray(a) for a in (x, wq, s, b)), bits=8, group_size=64) is None
    for M, N, K, bits, gs in [(1, 264, 512, 8, 64), (2, 136, 640, 4, 32), (5, 40, 96, 2, 32), (9, 72, 256, 8, 128)]:
        x, wq, s, b, want = _case(M + N + K, M, N, K, bits, gs)
        assert np.array_equal(_bits(_kernel(avx2, x, wq, s, b, bits, gs)), _bits(want)), (M, N, K, bits)


def test_calls_from_several_threads_and_after_fork(lib):
    """The kept worker threads: callers on several Python threads take turns
    (each gets its own product), and a forked child (no workers there) makes
    its own and gets the same bits."""
    import concurrent.futures
    import multiprocessing

    cases = [_case(i, 1 + i % 3, 200 + 16 * i, 256, 8, 64) for i in range(6)]
    args = [tuple(np.asarray(a) for a in c[:4]) for c in cases]
    wants = [_bits(c[4]) for c in cases]

    def one(i: int) -> bool:
        got = [qk.qmm_t(lib, *args[i], bits=8, group_size=64, threads=2) for _ in range(20)]
        return all(np.array_equal(_bits(g), wants[i]) for g in got)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(one, range(len(cases))))
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_in_child, (args[0],)) == wants[0].tobytes()


def _in_child(arg) -> bytes:
    lib = qk.load()
    assert lib is not None
    got = qk.qmm_t(lib, *arg, bits=8, group_size=64, threads=2)
    return got.view(np.uint32).tobytes()


def test_rejects_what_it_does_not_handle(lib):
    x, wq, s, b, _ = _case(0, 2, 16, 128, 4, 64)
    xs, ws, ss, bs = (np.asarray(a) for a in (x, wq, s, b))
    with pytest.raises(ValueError, match="bits"):
        qk.qmm_t(lib, xs, ws, ss, bs, bits=3, group_size=64)
    with pytest.raises(ValueError, match="shapes"):
        qk.qmm_t(lib, xs, ws, ss, bs, bits=8, group_size=64)
    with pytest.raises(ValueError, match="float32 x"):
        qk.qmm_t(lib, xs.astype(np.float16), ws, ss, bs, bits=4, group_size=64)
    with pytest.raises(ValueError, match="C-contiguous"):
        qk.qmm_t(lib, np.asfortranarray(np.ones((2, 128), np.float32)), ws, ss, bs, bits=4, group_size=64)


def _qwen2(tie: bool, bits: int, gs: int) -> qwen2.Model:
    mx.random.seed(3)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=640,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=512,
        rope_theta=1e6,
        tie_word_embeddings=tie,
    )
    model = qwen2.Model(args)
    nn.quantize(model, group_size=gs, bits=bits)
    mx.eval(model.parameters())
    return model


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and every step's logits: one prefill, then one token a forward."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens, rows = [], []
    for _ in range(n):
        rows.append(np.array(logits[0, -1]))
        tokens.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens, rows


@pytest.mark.parametrize(("tie", "bits", "gs"), [(False, 4, 64), (True, 8, 32), (False, 8, 128)])
def test_hooked_qwen2_is_mlx_lm_bit_for_bit(lib, tie, bits, gs):
    model = _qwen2(tie, bits, gs)
    prompt = [1, 5, 9, 33, 100, 7, 250, 3, 17]
    want, want_logits = _greedy(model, prompt, 12)
    matmuls = 2 * 7 + 1  # q k v o gate up down a layer, and the head (tied: the embedding's as_linear)
    layers = matmuls + (0 if tie else 1)  # an untied embedding changes class too (its lookup stays MLX's)
    assert ql.install(model, lib) == layers
    before = ql.calls["kernel"]
    try:
        got, got_logits = _greedy(model, prompt, 12)
    finally:
        assert ql.uninstall(model) == layers
    assert ql.calls["kernel"] - before == 13 * matmuls
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert np.array_equal(_bits(a), _bits(b))
    assert not any(type(m).__module__ == ql.__name__ for m in model.modules())  # uninstall put them back


def test_what_the_kernel_does_not_take_stays_mlx(lib):
    layer = nn.QuantizedLinear(128, 48, bias=True, group_size=64, bits=4)
    x = mx.random.normal((3, 128))
    want = layer(x)
    assert ql.install(layer, lib) == 1
    try:
        mlx_before = ql.calls["mlx"]
        assert np.array_equal(_bits(layer(x)), _bits(want))  # the bias is added after the kernel, as MLX does
        assert ql.calls["mlx"] == mlx_before
        half = x.astype(mx.float16)  # a dtype the kernel does not take
        assert np.array_equal(np.asarray(layer(half)), np.asarray(nn.QuantizedLinear.__call__(layer, half)))
        assert ql.calls["mlx"] == mlx_before + 1
    finally:
        ql.uninstall(layer)


def test_switched_off_leaves_mlx_lm(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_QMM_KERNEL", "0")
    assert qk.load(tmp_path) is None
    monkeypatch.setattr(qk, "load", lambda directory=None: None)
    model = _qwen2(False, 4, 64)
    assert ql.install(model) == 0
    assert all(type(m).__module__.startswith("mlx.") for m in model.modules() if "Quantized" in type(m).__name__)


def test_no_compiler_means_mlx(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        qk.build(tmp_path / "k.so")
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(qk, "library_path", lambda directory=None: pathlib.Path(tmp_path / "kernels" / "x.so"))
    assert qk.load(tmp_path) is None  # logged, and the model keeps MLX's quantized_matmul


def test_builds_into_the_cache_once(tmp_path):
    assert qk.load(tmp_path) is not None
    built = list((tmp_path / "kernels").glob("qmm_t-*.so"))
    assert len(built) == 1 and built[0] == qk.library_path(tmp_path)
    mtime = built[0].stat().st_mtime_ns
    assert qk.load(tmp_path) is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_config_and_flag():
    from engine.config import EngineConfig
    from transport.cli import build_parser, engine_config

    assert EngineConfig().qmm_kernel is True
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--no-qmm-kernel"])
    assert engine_config(args, parser).qmm_kernel is False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("on", "graph"), [(True, True), (True, False), (False, True)], ids=["kernel", "from-python", "switched-off"]
)
def test_backend_on_a_quantized_model_decodes_as_mlx_lm(tmp_path_factory, lib, monkeypatch, on, graph):
    """The bundled tiny model converted to MLX 4-bit: the backend's greedy
    decode (prefill chunks, run-ahead) equals mlx-lm's generate_step on its
    own load of the same directory, kernel on (as MLX primitives, or called
    from Python) or off. Called from Python the kernel evaluates each layer's
    input, so the backend does not run ahead (a step built ahead would be
    computed inside the step that builds it: engine.mlx.backend.MLXBackend.load);
    as primitives (engine.mlx.mlx_ops) and without the kernel, it does."""
    from engine.mlx import mlx_ops

    if graph and on:
        # a machine that runs this suite builds the extension (a C++ compiler, nanobind
        # from the dependencies): one that stopped building is a regression, not a skip
        assert mlx_ops.load() is not None, mlx_ops.unavailable
    if not graph:
        monkeypatch.setenv(ql.GRAPH_SWITCH, "0")
    from mlx_lm import convert, load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from engine.config import EngineConfig
    from engine.mlx.backend import load_mlx_backend
    from engine.models import resolve_model
    from engine.ports import DecodeRow, OpenRow, PrefillChunk, StepPlan
    from engine.types import SamplingParams

    path = tmp_path_factory.mktemp("q4") / "tiny-4bit"
    convert(str(resolve_model("tiny")), mlx_path=str(path), quantize=True, q_bits=4, q_group_size=64, dtype="float32")
    backend, device = load_mlx_backend(EngineConfig(backend="mlx", model=str(path), qmm_kernel=on))
    try:
        assert backend.counters["qmm_kernel_layers"] == (6 * 7 + 1 if on else 0)
        prompt = backend.tokenizer.encode("def add(a, b):\n    return a + b\n\nclass Point:\n")
        oracle = device.call(lambda: load(str(path))[0])
        assert not any(type(m).__module__ == ql.__name__ for m in oracle.modules())
        ref = device.call(
            lambda: [t for t, _ in generate_step(mx.array(prompt), oracle, max_tokens=16, sampler=make_sampler(0.0))]
        )
        backend.max_ahead = 2
        step = lambda **kw: device.call(backend.step, StepPlan(**kw))  # noqa: E731
        step(open=[OpenRow(1, SamplingParams(max_tokens=10_000, ignore_eos=True))])
        body = prompt[:-1]
        for i in range(0, len(body), 8):
            assert not step(prefill=[PrefillChunk(1, body[i : i + 8])]).errors
        out, tok = [], prompt[-1]
        for _ in range(16):
            tok = step(decode=[DecodeRow(1, tok)]).tokens[1]
            out.append(tok)
            device.call(backend.run_ahead, lambda: True)
        step(close=[1])
        assert out == ref
        runs_ahead = not on or graph
        assert backend.counters["qmm_in_graph"] == int(on and graph)
        assert backend.pipeline is runs_ahead
        assert (backend.counters["pipelined"] > 0) is runs_ahead
    finally:
        device.close()


# ---- the prefill path: dequantize (bit for bit mx.dequantize) + float32 GEMM ----


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("N", "K", "gs"), [(200, 768, 64), (136, 512, 32), (9, 1024, 128), (70, 256, 64)])
def test_dequantize_is_mlx_dequantize_bit_for_bit(lib, bits, N, K, gs):
    rng = np.random.default_rng(N * K + bits)
    for scale in (0.02, 3.0, 100.0):  # values whose product and sum round differently at each scale
        w = mx.array((rng.standard_normal((N, K)) * scale).astype(np.float32))
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        want = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
        for threads in (1, 3):
            got = qk.dequantize(lib, np.asarray(wq), np.asarray(s), np.asarray(b), bits=bits, group_size=gs, threads=threads)  # fmt: skip
            assert np.array_equal(_bits(got), _bits(want)), (scale, threads)


def test_dequantize_into_a_buffer_and_refusals(lib):
    w = mx.random.normal((16, 128))
    wq, s, b = (np.asarray(a) for a in mx.quantize(w, group_size=64, bits=4))
    out = np.full((16, 128), np.nan, np.float32)
    assert qk.dequantize(lib, wq, s, b, bits=4, group_size=64, out=out) is out
    assert np.array_equal(out, np.asarray(mx.dequantize(*mx.quantize(w, group_size=64, bits=4), group_size=64, bits=4)))
    with pytest.raises(ValueError, match="bits"):
        qk.dequantize(lib, wq, s, b, bits=3, group_size=64)
    with pytest.raises(ValueError, match="shapes"):
        qk.dequantize(lib, wq, s, b, bits=8, group_size=64)
    with pytest.raises(ValueError, match="out"):
        qk.dequantize(lib, wq, s, b, bits=4, group_size=64, out=np.empty((16, 64), np.float32))


@pytest.fixture
def prefill_on(lib):
    """The hook with the prefill path on (and put back as it was after)."""
    saved = dict(ql._state)
    ql.use(lib, prefill=True)
    yield ql.PREFILL_ROWS
    ql._state.update(saved)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_choose_the_path(lib, prefill_on, bits):
    """Below PREFILL_ROWS rows the exact kernel (MLX's bits); from it on,
    dequantize + GEMM (close to MLX's, counted apart); rows count across
    leading axes (a (1, L, K) prefill chunk is L rows)."""
    layer = nn.QuantizedLinear(256, 200, bias=True, group_size=64, bits=bits)
    mx.eval(layer.parameters())
    assert ql.install(layer, lib) == 1
    try:
        for rows in (1, prefill_on - 1, prefill_on, 2 * prefill_on + 3):
            x = mx.random.normal((1, rows, 256))
            want = nn.QuantizedLinear.__call__(layer, x)
            before = dict(ql.calls)
            got = layer(x)
            assert got.shape == want.shape == (1, rows, 200)
            big = rows >= prefill_on
            assert ql.calls["dequant_gemm"] - before["dequant_gemm"] == int(big)
            assert ql.calls["kernel"] - before["kernel"] == int(not big)
            if big:  # BLAS's order of sums: not MLX's bits, within float32 rounding of a 256-term dot
                assert np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
            else:
                assert np.array_equal(_bits(got), _bits(want))
    finally:
        ql.uninstall(layer)


def test_a_head_larger_than_the_scratch_goes_in_slabs(lib, prefill_on, monkeypatch):
    """A matrix over SCRATCH_FLOATS (a 151936-row head) in slabs of rows: each
    slab's product is evaluated before the buffer is written again."""
    monkeypatch.setattr(ql, "SCRATCH_FLOATS", 100 * 128)  # slabs of 100 rows of 128
    monkeypatch.setitem(ql._state, "scratch", None)
    emb = nn.QuantizedEmbedding(450, 128, group_size=64, bits=4)
    mx.eval(emb.parameters())
    x = mx.random.normal((1, prefill_on + 5, 128))
    want = nn.QuantizedEmbedding.as_linear(emb, x)
    assert ql.install(emb, lib) == 1
    try:
        before = ql.calls["dequant_gemm"]
        got = emb.as_linear(x)
        assert ql.calls["dequant_gemm"] == before + 1
    finally:
        ql.uninstall(emb)
    assert ql._state["scratch"][1].size == 100 * 128
    assert np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_prefill_switched_off(lib, prefill_on, monkeypatch):
    layer = nn.QuantizedLinear(128, 64, group_size=64, bits=4)
    x = mx.random.normal((prefill_on + 1, 128))
    want = nn.QuantizedLinear.__call__(layer, x)
    for off in ("install", "env"):
        if off == "env":
            monkeypatch.setenv("EMBER_QMM_PREFILL", "0")
        ql.install(layer, lib, prefill=off != "install")  # the environment wins over prefill=True
        assert ql.prefill_rows() == 0
        before = dict(ql.calls)
        try:
            assert np.array_equal(_bits(layer(x)), _bits(want))
        finally:
            ql.uninstall(layer)
        assert ql.calls["kernel"] == before["kernel"] + 1 and ql.calls["dequant_gemm"] == before["dequant_gemm"]


@pytest.mark.parametrize(("tie", "bits", "gs"), [(False, 4, 64), (True, 8, 32)])
def test_hooked_qwen2_prefill_close_to_mlx_lm(lib, prefill_on, tie, bits, gs):
    """A prefill of PREFILL_ROWS+ tokens through dequantize + GEMM: logits
    within 1e-4 (relative to the largest) of mlx-lm's, the same greedy tokens
    on this model, and decode after it on the exact kernel."""
    model = _qwen2(tie, bits, gs)
    prompt = [(37 * i + 11) % 512 for i in range(prefill_on + 9)]
    want, want_logits = _greedy(model, prompt, 6)
    ref = np.asarray(model(mx.array([prompt])))
    ql.install(model, lib)
    try:
        before = dict(ql.calls)
        got_all = np.asarray(model(mx.array([prompt])))
        assert ql.calls["dequant_gemm"] - before["dequant_gemm"] == 2 * 7 + 1
        assert ql.calls["kernel"] == before["kernel"]
        got, got_logits = _greedy(model, prompt, 6)
    finally:
        ql.uninstall(model)
    scale = np.abs(ref).max()
    assert np.abs(got_all - ref).max() <= 1e-4 * scale
    assert got == want
    for a, b in zip(got_logits, want_logits):
        assert np.abs(a - b).max() <= 1e-4 * scale


def test_prefill_config_and_flag():
    from engine.config import EngineConfig
    from transport.cli import build_parser, engine_config

    assert EngineConfig().qmm_prefill is True
    parser = build_parser()
    assert (
        engine_config(parser.parse_args(["serve", "--model", "tiny", "--no-qmm-prefill"]), parser).qmm_prefill is False
    )
    assert engine_config(parser.parse_args(["serve", "--model", "tiny"]), parser).qmm_prefill is True


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_quantized_prefill_logits_close_to_mlx(tmp_path, lib, prefill_on, bits):
    """The bundled tiny model converted to MLX 8/4-bit, loaded twice: hooked
    (a prompt of PREFILL_ROWS+ tokens takes dequantize + GEMM) and mlx-lm's
    own. Prefill logits within 1e-4 of the largest logit (float32 rounding of
    BLAS's order of sums; measured ~1e-5 on the 1.5B), argmax equal at every
    position."""
    from mlx_lm import convert, load

    from engine.models import resolve_model

    path = tmp_path / f"tiny-{bits}bit"
    convert(
        str(resolve_model("tiny")), mlx_path=str(path), quantize=True, q_bits=bits, q_group_size=64, dtype="float32"
    )
    hooked, tok = load(str(path))[:2]
    oracle = load(str(path))[0]
    assert ql.install(hooked, lib) > 0
    prompt = tok.encode("def add(a, b):\n    return a + b\n\n" * 12)
    assert len(prompt) >= prefill_on
    before = ql.calls["dequant_gemm"]
    got = np.asarray(hooked(mx.array([prompt])))
    assert ql.calls["dequant_gemm"] > before
    want = np.asarray(oracle(mx.array([prompt])))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


# ---- the integer dot path: x rounded to int16 a group, VNNI sums (not MLX's bits) ----


def _dot_reference(x, wq, s, b, gs) -> np.ndarray:
    """What qmm_t_dot computes, in numpy (float64 sums): x rounded to int16 a
    group as the C does (float32 x * (32767 / max|x|), nearest even), the
    integer sums exact, then s * xs * sum(q x16) + b * sum(x) a group."""
    x, s, b = (np.asarray(a, np.float32) for a in (x, s, b))
    q = np.asarray(wq).view(np.uint8).reshape(wq.shape[0], -1).astype(np.int64)  # 4 weights a word, low byte first
    M, K = x.shape
    G = K // gs
    xg = x.reshape(M, G, gs)
    amax = np.abs(xg).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    x16 = np.rint((xg * inv).astype(np.float32)).astype(np.int64)  # (M, G, gs)
    xs = (amax[..., 0] / np.float32(32767)).astype(np.float64)  # (M, G)
    sx = xg.astype(np.float64).sum(axis=-1)
    dots = np.einsum("mgk,ngk->mng", x16, q.reshape(-1, G, gs))  # exact
    s64, b64 = s.astype(np.float64), b.astype(np.float64)
    return np.einsum("ng,mng,mg->mn", s64, dots.astype(np.float64), xs) + np.einsum("ng,mg->mn", b64, sx)


@pytest.fixture
def dot(lib):
    if not qk.dot_available(lib):
        pytest.skip("this CPU has no AVX-512 VNNI: the dot path is not built (the exact kernel serves)")
    return lib


# 16-row blocks with a tail (N = 40, 59), M from 1 to past a block of x's
# rows (DOT_M_BLOCK = 32), groups of 32, 64 and 128, one thread and two
@pytest.mark.parametrize(("N", "K", "gs"), [(40, 256, 32), (59, 512, 64), (1536, 1536, 64), (48, 1152, 128)])
def test_dot_is_its_own_arithmetic_and_close_to_exact(dot, N, K, gs):
    for M in (1, 2, 3, 5, 33, 70):
        x, wq, s, b, exact = _case(M * 100 + N, M, N, K, 8, gs, scale=2.0)
        args = [np.asarray(a) for a in (x, wq, s, b)]
        got = qk.qmm_t_dot(dot, *args, bits=8, group_size=gs, threads=2)
        assert got is not None and got.shape == (M, N)
        ref = _dot_reference(*args, gs)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), M  # float32 rounding of the same sums
        exact = np.asarray(exact)
        assert np.linalg.norm(got - exact) <= 1e-4 * np.linalg.norm(exact), M  # x's int16 rounding: ~1e-5
        assert np.array_equal(_bits(got), _bits(qk.qmm_t_dot(dot, *args, bits=8, group_size=gs, threads=1)))


def test_dot_rows_do_not_depend_on_the_batch(dot):
    """A row of x gets the same bits alone or among others (a verify step's
    rows equal the decode steps' one by one: speculation stays exact)."""
    x, wq, s, b, _ = _case(5, 37, 264, 512, 8, 64)
    args = [np.asarray(a) for a in (x, wq, s, b)]
    whole = qk.qmm_t_dot(dot, *args, bits=8, group_size=64, threads=2)
    for m in (0, 1, 6, 31, 32, 36):
        one = qk.qmm_t_dot(dot, args[0][m : m + 1].copy(), *args[1:], bits=8, group_size=64, threads=2)
        assert np.array_equal(_bits(one[0]), _bits(whole[m])), m


def test_chunks_taken_from_both_ends_cover_every_row_once(lib):
    """The caller takes chunks of 64 rows from the front, the workers from the
    back, each prefetching into the chunk it takes next: with many chunks, a
    last one longer than the rest and more threads than two, every row is
    computed once and equals the one-thread result (the exact kernel: equals
    MLX; the dot path: its own bits)."""
    N = 64 * 41 + 23
    for M in (1, 5):
        x, wq, s, b, want = _case(N + M, M, N, 256, 8, 64, scale=2.0)
        args = [np.asarray(a) for a in (x, wq, s, b)]
        for threads in (2, 3, 5):
            assert np.array_equal(_bits(_kernel(lib, x, wq, s, b, 8, 64, threads)), _bits(want)), (M, threads)
            if qk.dot_available(lib):
                one = qk.qmm_t_dot(lib, *args, bits=8, group_size=64, threads=1)
                got = qk.qmm_t_dot(lib, *args, bits=8, group_size=64, threads=threads)
                assert np.array_equal(_bits(got), _bits(one)), (M, threads)


def test_dot_declines_what_it_does_not_take(dot):
    x, wq, s, b, _ = _case(0, 2, 64, 256, 4, 64)
    assert qk.qmm_t_dot(dot, *(np.asarray(a) for a in (x, wq, s, b)), bits=4, group_size=64) is None  # 4-bit
    _, wq, s, b, _ = _case(0, 1, 64, 256, 8, 64)
    x = np.zeros((1, 256), np.float32)  # x all zero: zero scale, no division by it
    got = qk.qmm_t_dot(dot, x, np.asarray(wq), np.asarray(s), np.asarray(b), bits=8, group_size=64)
    assert got is not None and not np.any(got)


def test_the_hook_takes_the_dot_path_for_8_bit_decode(dot, monkeypatch):
    layer8 = nn.QuantizedLinear(256, 200, bias=True, group_size=64, bits=8)
    layer4 = nn.QuantizedLinear(256, 200, bias=True, group_size=64, bits=4)
    mx.eval(layer8.parameters(), layer4.parameters())
    x = mx.random.normal((1, 3, 256))
    for layer in (layer8, layer4):
        assert ql.install(layer, dot, dot=True) == 1
    assert ql.dot()
    try:
        before = dict(ql.calls)
        got8, got4 = layer8(x), layer4(x)
        assert ql.calls["dot"] - before["dot"] == 1 and ql.calls["kernel"] - before["kernel"] == 1
        want8 = np.asarray(nn.QuantizedLinear.__call__(layer8, x))
        assert np.linalg.norm(np.asarray(got8) - want8) <= 1e-4 * np.linalg.norm(want8)
        assert np.array_equal(_bits(got4), _bits(nn.QuantizedLinear.__call__(layer4, x)))  # 4-bit: exact
        ql.use(dot, prefill=True)
        big = mx.random.normal((1, ql.PREFILL_ROWS + 3, 256))  # a prefill chunk: the dot path beats dequant + GEMM
        before = dict(ql.calls)
        got_big = np.asarray(layer8(big))
        assert ql.calls["dot"] - before["dot"] == 1 and ql.calls["dequant_gemm"] == before["dequant_gemm"]
        want_big = np.asarray(nn.QuantizedLinear.__call__(layer8, big))
        assert np.linalg.norm(got_big - want_big) <= 1e-4 * np.linalg.norm(want_big)
        monkeypatch.setenv("EMBER_QMM_DOT", "0")
        ql.use(dot, dot=True)  # the environment wins
        assert not ql.dot()
        before = dict(ql.calls)
        assert np.array_equal(_bits(layer8(x)), _bits(want8))
        assert ql.calls["dot"] == before["dot"] and ql.calls["kernel"] == before["kernel"] + 1
    finally:
        ql.uninstall(layer8)
        ql.uninstall(layer4)


def test_hooked_qwen2_on_the_dot_path_stays_close_to_mlx_lm(dot):
    """A whole 8-bit model's decode on the dot path: every step's logits
    within 1e-3 of mlx-lm's (x's int16 rounding, through every layer), the
    same greedy tokens on this model."""
    model = _qwen2(False, 8, 64)
    prompt = [1, 5, 9, 33, 100, 7, 250, 3, 17]
    want, want_logits = _greedy(model, prompt, 8)
    ql.install(model, dot, dot=True)
    try:
        before = ql.calls["dot"]
        got, got_logits = _greedy(model, prompt, 8)
        assert ql.calls["dot"] - before == (1 + 8) * (2 * 7 + 1)  # the 9-row prompt and 8 steps, every matmul
    finally:
        ql.uninstall(model)
    for a, b in zip(got_logits, want_logits):
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)
    assert got == want


def test_dot_config_and_flag():
    from engine.config import EngineConfig
    from transport.cli import build_parser, engine_config

    assert EngineConfig().qmm_dot is True
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve", "--model", "tiny", "--no-qmm-dot"]), parser).qmm_dot is False
    assert engine_config(parser.parse_args(["serve", "--model", "tiny"]), parser).qmm_dot is True


def test_a_layer_whose_weights_change_is_checked_again(lib):
    """The checked weight kept on the layer follows its arrays: weights
    swapped in (load_weights, update) give the new product, not the cached one."""
    layer = nn.QuantizedLinear(256, 64, group_size=64, bits=4)
    other = nn.QuantizedLinear(256, 64, group_size=64, bits=4)
    mx.eval(layer.parameters(), other.parameters())
    x = mx.random.normal((2, 256))
    assert ql.install(layer, lib) == 1
    try:
        assert np.array_equal(_bits(layer(x)), _bits(nn.QuantizedLinear.__call__(layer, x)))
        layer.update(other.parameters())
        assert np.array_equal(_bits(layer(x)), _bits(nn.QuantizedLinear.__call__(other, x)))
        assert "_ember_qmm" not in dict(layer.items())  # kept beside the parameters, not among them
    finally:
        ql.uninstall(layer)
    assert "_ember_qmm" not in layer.__dict__
