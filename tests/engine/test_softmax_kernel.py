"""The C softmax (engine.mlx.softmax_kernel) and the attention around it
(engine.mlx.kernel_attention), compared bit for bit with MLX's own softmax and
``mx.fast.scaled_dot_product_attention``, and a model forward with mlx-lm's."""

from __future__ import annotations

import itertools
import pathlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx import kernel_attention as ka
from engine.mlx import softmax_kernel as sk
from engine.mlx import split_attention as sa

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel is for MLX's CPU backend only")


@pytest.fixture(scope="module")
def lib():
    got = sk.load()
    # a machine that runs this suite has a C compiler (pip builds with it); a
    # kernel that stopped building is a regression, not a skip
    assert got is not None, sk.unavailable
    return got


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def _kernel(lib, x: np.ndarray, **kw) -> np.ndarray:
    out = np.ascontiguousarray(x, dtype=np.float32).copy()
    sk.softmax_rows(lib, out, **kw)
    return out


@pytest.mark.parametrize(("rows", "cols", "scale", "threads"), [(37, 4300, 10.0, 1), (64, 1000, 100.0, 2), (9, 6001, 3.0, 2), (5, 33, 1e3, 1), (3, 1, 1.0, 1), (7, 7, 0.0, 3)])  # fmt: skip
def test_softmax_is_mlx_softmax_bit_for_bit(lib, rows, cols, scale, threads):
    rng = np.random.default_rng(rows * cols)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    x[rng.random((rows, cols)) < 0.2] = np.finfo(np.float32).min  # masked by where(), as attention masks
    x[0, 0] = -np.inf
    want = mx.softmax(mx.array(x), axis=-1, precise=True)
    assert np.array_equal(_bits(_kernel(lib, x, threads=threads)), _bits(want))
    assert np.array_equal(_bits(_kernel(lib, x, threads=1)), _bits(_kernel(lib, x, threads=4)))


def test_edge_values_follow_mlx(lib):
    # NaN rows, +inf, overflow past 88, a row all masked: whatever MLX gives, the kernel gives
    x = np.array(
        [
            [1.0, np.nan, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            [np.inf, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            [100.0, -100.0, 0.0, 87.9, -87.9, 88.1, -88.1, 1e-30, -0.0],
            [np.finfo(np.float32).min] * 9,
            [-np.inf] * 9,
        ],
        dtype=np.float32,
    )
    want = np.asarray(mx.softmax(mx.array(x), axis=-1, precise=True))
    got = _kernel(lib, x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(_bits(np.nan_to_num(got)), _bits(np.nan_to_num(want)))


@pytest.mark.parametrize(("L", "S"), [(1, 50), (5, 5), (64, 300), (130, 130)])
def test_causal_mask_in_the_kernel_is_mlx_where(lib, L, S):
    x = np.random.default_rng(L).standard_normal((3, L, S)).astype(np.float32) * 4
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    want = mx.softmax(mx.where(causal, mx.array(x), mx.array(np.finfo(np.float32).min)), axis=-1, precise=True)
    assert np.array_equal(_bits(_kernel(lib, x, causal_len=L, offset=S - L, threads=2)), _bits(want))


def test_rejects_what_it_cannot_write(lib):
    with pytest.raises(ValueError):
        sk.softmax_rows(lib, np.zeros((4, 4), dtype=np.float64))
    with pytest.raises(ValueError):
        sk.softmax_rows(lib, np.zeros((4, 8), dtype=np.float32)[:, ::2])


def _qkv(B, H, KV, L, S, D=64):
    mx.random.seed(B * 1000 + L * 10 + S)
    return mx.random.normal((B, H, L, D)), mx.random.normal((B, KV, S, D)), mx.random.normal((B, KV, S, D))


@pytest.mark.parametrize(("B", "HKV", "L", "S"), list(itertools.product([1, 3], [(9, 3), (4, 4)], [1, 7, 150], [150, 2100])))  # fmt: skip
def test_attention_is_the_fused_call_bit_for_bit(lib, B, HKV, L, S):
    H, KV = HKV
    if L > S:
        return
    q, k, v = _qkv(B, H, KV, L, S)
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    padded = mx.broadcast_to(causal, (B, 1, L, S)) & (mx.arange(S) >= 3)  # left padding, as batch caches mask
    additive = mx.where(padded, 0.0, -1e9).astype(mx.float32)
    for mask in ["causal", None, causal, padded, additive]:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=64**-0.5, mask=mask)
        before = ka.calls["kernel"]
        got = ka.attention(lib, q, k, v, scale=64**-0.5, mask=mask, threads=2)
        if not ka.applies(B, H, L, S):
            assert got is None  # too small to pay for the sync
            continue
        assert ka.calls["kernel"] == before + 1
        assert np.array_equal(_bits(got), _bits(want)), (B, H, KV, L, S, mask if isinstance(mask, str) else "array")


def test_decode_sized_calls_take_the_kernel_only_where_it_pays(lib):
    # a decode step's graph is built while the last one computes; the kernel's
    # eval inside it costs that overlap, so small decode calls stay lazy (#45)
    H, S = 9, 2048
    assert H * 1 * S >= ka.MIN_SCORES  # a prefill window's threshold would take it
    q, k, v = _qkv(1, H, 3, 1, S)
    before = ka.calls["kernel"]
    assert ka.attention(lib, q, k, v, scale=0.125, mask=None) is None
    assert ka.calls["kernel"] == before
    assert ka.applies(1, H, 128, S)  # the same keys under a prefill window: the kernel
    S = -(-ka.DECODE_MIN_SCORES // H)  # a decode call big enough for it
    q, k, v = _qkv(1, H, 3, 1, S)
    got = ka.attention(lib, q, k, v, scale=0.125, mask=None)
    assert got is not None and ka.calls["kernel"] == before + 1
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    assert np.array_equal(_bits(got), _bits(want))


def test_attention_declines_what_it_does_not_do(lib):
    q, k, v = _qkv(1, 4, 2, 64, 512)
    assert (
        ka.attention(lib, q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), scale=0.1, mask=None)
        is None
    )
    assert ka.attention(lib, q, k, v, scale=0.1, mask="sliding") is None


def test_a_model_forward_with_the_kernel_is_mlx_lm_bit_for_bit(lib):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    sa.install(model)
    tokens = mx.random.randint(0, 512, (1, 420))

    def forward(n, kernel):
        cache = make_prompt_cache(model)
        with sa.parts(n, kernel):
            model(tokens[:, :150], cache=cache)  # a context, then a window over it, then decode
            window = model(tokens[:, 150:400], cache=cache)
            steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(400, 420)]
            return mx.concatenate([window, *steps], axis=1)

    before = ka.calls["kernel"]
    whole = forward(1, None)  # mlx-lm's own function
    assert ka.calls["kernel"] == before
    got = forward(2, lib)
    assert ka.calls["kernel"] >= before + 2 * args.num_hidden_layers
    assert np.array_equal(_bits(got), _bits(whole))


def test_no_compiler_means_mlx_softmax(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        sk.build(tmp_path / "k.so")
    assert not (tmp_path / "k.so").exists()
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(sk, "library_path", lambda directory=None: pathlib.Path(tmp_path / "kernels" / "x.so"))
    assert sk.load(tmp_path) is None  # logged, and attention stays MLX's
    monkeypatch.setenv("EMBER_SOFTMAX_KERNEL", "0")
    assert sk.load(tmp_path) is None


def test_builds_into_the_cache_once(tmp_path):
    got = sk.load(tmp_path)
    assert got is not None
    built = list((tmp_path / "kernels").glob("softmax_rows-*.so"))
    assert len(built) == 1 and built[0] == sk.library_path(tmp_path)
    mtime = built[0].stat().st_mtime_ns
    assert sk.load(tmp_path) is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_config_and_flag():
    from engine.config import EngineConfig
    from transport.cli import build_parser, engine_config

    assert EngineConfig().softmax_kernel is True
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--no-softmax-kernel"])
    assert engine_config(args, parser).softmax_kernel is False
