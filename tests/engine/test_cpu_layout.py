"""engine.mlx.cpu_layout: Linear weights stored as W.T for OpenBLAS compute what
mlx-lm's layout computes. The oracle is mlx-lm's own load of the checkpoint."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from engine.mlx.cpu_layout import PretransposedLinear, calibrate, pretranspose_linears, restore_linears  # noqa: E402
from engine.models import resolve_model  # noqa: E402

pytestmark = pytest.mark.slow  # loads the bundled target twice


def test_a_biased_linear_computes_the_same():
    mx.random.seed(0)
    lin = nn.Linear(24, 40, bias=True)
    x = mx.random.normal((3, 24))
    swapped = PretransposedLinear(lin)
    assert swapped.weight_t.shape == (24, 40)
    assert mx.allclose(swapped(x), lin(x), atol=1e-5).item()


def test_quantized_linears_are_left_alone():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.QuantizedLinear(64, 64, group_size=32, bits=4))
    assert pretranspose_linears(model) == 1
    assert type(model.layers[0]) is PretransposedLinear
    assert type(model.layers[1]) is nn.QuantizedLinear


def test_the_bundled_target_matches_mlx_lm_at_every_width():
    path = str(resolve_model("tiny"))
    ref, _ = load(path)
    mine, _ = load(path)
    n = pretranspose_linears(mine)
    layers = len(ref.model.layers)
    assert n == 7 * layers  # q, k, v, o, gate, up, down in each layer
    assert not any(type(m) is nn.Linear for _, m in mine.named_modules())
    ids = list(range(3, 203))
    c_ref, c_mine = make_prompt_cache(ref), make_prompt_cache(mine)
    a = ref(mx.array(ids[:160])[None], cache=c_ref)
    b = mine(mx.array(ids[:160])[None], cache=c_mine)
    assert mx.abs(a - b).max().item() < 1e-4  # prefill (measured: identical)
    at = 160
    for width in (1, 2, 4, 5):  # decode and verify windows: another OpenBLAS kernel, ~1e-5
        x = mx.array(ids[at : at + width])[None]
        a, b = ref(x, cache=c_ref), mine(x, cache=c_mine)
        assert mx.abs(a - b).max().item() < 1e-3
        assert (mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).all().item()
        at += width
    for x, y in zip(c_ref, c_mine):
        assert mx.abs(x.keys[..., : x.offset, :] - y.keys[..., : y.offset, :]).max().item() < 1e-3


def test_restore_linears_undoes_pretranspose_exactly():
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=True), nn.Linear(48, 16, bias=False))
    x = mx.random.normal((2, 32))
    want = model(x)
    assert pretranspose_linears(model) == 2
    assert restore_linears(model) == 2
    assert [type(m) for m in model.layers] == [nn.Linear, nn.Linear]
    assert mx.array_equal(model(x), want).item()


class _Blas:
    """A stand-in for engine.mlx.blas.BlasThreads that records the counts asked for."""

    active, default = True, 2

    def __init__(self):
        self.asked: list[int] = []

    def use(self, n: int) -> None:
        self.asked.append(n)


def test_calibrate_leaves_the_model_in_the_layout_it_chose_and_computing_the_same():
    path = str(resolve_model("tiny"))
    ref, _ = load(path)
    mine, _ = load(path)
    blas = _Blas()
    choice = calibrate(mine, blas, reps=2)
    swapped = sum(type(m) is PretransposedLinear for _, m in mine.named_modules())
    assert (swapped > 0) == choice.pretranspose
    assert choice.small_threads in (0, 1) and {1, 0} <= set(blas.asked) and blas.asked[-1] == 0
    assert len(choice.ms) == 16  # 2 layouts x 2 thread counts x 4 widths
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    c1, c2 = make_prompt_cache(ref), make_prompt_cache(mine)
    assert mx.allclose(mine(x, cache=c2), ref(x, cache=c1), atol=1e-4).item()
