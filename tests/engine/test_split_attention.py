"""Attention split across CPU streams (engine.mlx.split_attention): every
split is compared bit for bit with the whole ``mx.fast`` call, and on a model
with mlx-lm's own forward outside ``parts``."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx_lm.models import base, llama
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx import split_attention as sa

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the split is for MLX's CPU backend only")


def _qkv(B, H, KV, L, S, D=64):
    mx.random.seed(B * 1000 + L * 10 + S)
    return mx.random.normal((B, H, L, D)), mx.random.normal((B, KV, S, D)), mx.random.normal((B, KV, S, D))


def _whole(q, k, v, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask, sinks=sinks)


def _split(q, k, v, mask, n=2, sinks=None):
    return sa.split_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask, sinks=sinks, n=n)


@pytest.mark.parametrize(
    ("B", "H", "KV", "L", "extra"), list(itertools.product([1, 2], [(4, 2)], [2], [128, 201], [0, 300]))
)
def test_window_split_is_bit_for_bit_the_whole_call(B, H, KV, L, extra):
    H, KV = H
    S = L + extra
    q, k, v = _qkv(B, H, KV, L, S)
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    padded = mx.broadcast_to(causal, (B, 1, L, S)) & (mx.arange(S) >= 3)  # left padding, as batch caches mask
    axis = "batch" if B > 1 else "heads"
    for mask in ["causal", None, causal, padded]:
        before = sa.calls[axis]
        got = _split(q, k, v, mask)
        assert sa.calls[axis] == before + 1
        assert mx.array_equal(got, _whole(q, k, v, mask)).item(), (B, L, S, mask if isinstance(mask, str) else "array")
    if B > 1:  # sinks split along the batch (a heads split leaves them to the whole call)
        sinks = mx.random.normal((H,))
        assert mx.array_equal(_split(q, k, v, "causal", sinks=sinks), _whole(q, k, v, "causal", sinks=sinks)).item()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_more_parts_than_two_are_exact(n):
    q, k, v = _qkv(1, 8, 4, 200, 500)
    before = sa.calls["heads"]
    assert mx.array_equal(_split(q, k, v, "causal", n=n), _whole(q, k, v, "causal")).item()
    assert sa.calls["heads"] == before + 1
    assert len(sa._bounds(4, min(n, 4))) == n


@pytest.mark.parametrize(("B", "L"), [(3, 1), (4, 5), (2, 17)])
def test_decode_split_over_batch_is_exact(B, L):
    S = sa.DECODE_MIN_KEYS + 37
    q, k, v = _qkv(B, 6, 3, L, S)
    mask = mx.random.uniform(shape=(B, 1, L, S)) > 0.1
    for m in [None, mask, "causal"] if L > 1 else [None, mask]:
        before = sa.calls["batch"]
        got = _split(q, k, v, m)
        assert sa.calls["batch"] == before + 1
        assert mx.array_equal(got, _whole(q, k, v, m)).item()


@pytest.mark.parametrize("L", [1, 4])
def test_decode_at_batch_1_is_not_split(L):
    # a heads split of a decode token lost to the whole call (0.87x at 4k keys): not run there (#45)
    q, k, v = _qkv(1, 6, 3, L, 2 * sa.DECODE_MIN_KEYS)
    before = dict(sa.calls)
    assert _split(q, k, v, None) is None
    assert sa.calls == before


def test_small_calls_are_not_split():
    q, k, v = _qkv(2, 4, 2, 2 * sa.MIN_ROWS - 1, 400)
    assert _split(q, k, v, "causal") is None  # a short window over few keys: not worth a split
    q, k, v = _qkv(2, 4, 2, 1, sa.DECODE_MIN_KEYS - 1)
    assert _split(q, k, v, None) is None  # decode over few keys: the split costs more than it saves
    q, k, v = _qkv(1, 4, 1, 1, sa.DECODE_MIN_KEYS + 1)
    assert _split(q, k, v, None) is None  # one KV head at batch 1: nothing to split along


def test_a_model_forward_is_identical_split_and_mlx_lm_outside_parts():
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
    )  # fmt: skip
    model = llama.Model(args)
    mx.eval(model.parameters())
    assert sa.install(model) == 1
    assert llama.scaled_dot_product_attention is sa.split_sdpa
    tokens = mx.random.randint(0, 512, (1, 400))

    def forward(n):
        cache = make_prompt_cache(model)
        with sa.parts(n):
            model(tokens[:, :150], cache=cache)  # a context, then 250 new tokens over it
            return model(tokens[:, 150:], cache=cache)

    before = dict(sa.calls)
    whole = forward(1)
    assert sa.calls == before  # outside parts(n > 1) it is mlx-lm's own function
    split = forward(2)
    assert sa.calls["heads"] == before["heads"] + 2 * args.num_hidden_layers
    assert mx.array_equal(split, whole).item()
    assert sa.install(model) == 1  # idempotent
    assert sa._original is base.scaled_dot_product_attention


def test_quantized_kv_takes_mlx_lm_path():
    class Quantized:
        bits, group_size = 8, 64

    q, k, v = _qkv(1, 4, 2, 200, 200)
    kq, vq = mx.quantize(k, 64, 8), mx.quantize(v, 64, 8)
    before = dict(sa.calls)
    with sa.parts(2):  # mlx-lm's quantized path scales its queries in place: each call gets a copy
        got = sa.split_sdpa(mx.array(q), kq, vq, Quantized(), scale=0.125, mask="causal")
    assert sa.calls == before
    want = base.quantized_scaled_dot_product_attention(
        mx.array(q), kq, vq, scale=0.125, mask="causal", group_size=64, bits=8
    )
    assert mx.array_equal(got, want).item()


def test_config_and_flag():
    from engine.config import EngineConfig
    from engine.errors import InvalidRequest
    from transport.cli import build_parser, engine_config

    with pytest.raises(InvalidRequest, match="attention_streams"):
        EngineConfig(attention_streams=0).validate()
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--attention-streams", "1"])
    assert engine_config(args, parser).attention_streams == 1
    assert 1 <= sa.default_parts() <= sa.MAX_DEFAULT_PARTS
