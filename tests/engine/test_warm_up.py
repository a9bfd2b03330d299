"""The warm-up at load (engine.mlx.warm_up): the first use of the step's
attention path (the kernel's first call, the split's streams) happens there,
not in the first request, and it leaves nothing a request would see (#45)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from engine.mlx import kernel_attention, softmax_kernel
from engine.mlx import split_attention as sa
from engine.mlx.warm_up import WARM_TOKENS, warm_up

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the kernel and the split are CPU-only")


def test_warm_up_runs_the_kernel_and_makes_the_streams_and_changes_no_output():
    lib = softmax_kernel.load()
    assert lib is not None  # a machine that runs the suite builds the kernel (test_softmax_kernel.py)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
    )  # fmt: skip
    assert args.num_attention_heads * WARM_TOKENS * WARM_TOKENS >= kernel_attention.MIN_SCORES
    model = llama.Model(args)
    mx.eval(model.parameters())
    sa.install(model)
    tokens = mx.random.randint(0, 512, (1, 20))

    def forward():
        cache = make_prompt_cache(model)
        return model(tokens, cache=cache)

    before_out = forward()
    mx.eval(before_out)
    sa._local.streams = []  # this thread has made no split stream yet
    calls = kernel_attention.calls["kernel"]
    seconds = warm_up(model, 2, lib)
    assert seconds > 0
    assert kernel_attention.calls["kernel"] == calls + args.num_hidden_layers  # one kernel call a layer
    assert len(sa._local.streams) == 2  # the split's streams, made on this thread
    assert mx.array_equal(forward(), before_out).item()
