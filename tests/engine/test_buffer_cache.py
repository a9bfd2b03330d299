"""MLX's CPU buffer cache limit (engine.mlx.buffer_cache): what is asked for,
that a higher limit already set is kept, and that the backend raises it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.mlx import buffer_cache as bc

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the limit is set on MLX's CPU backend only")


def test_wanted_is_an_eighth_of_ram_capped_and_the_env_overrides():
    assert bc.wanted({}, ram=8 << 30) == 1 << 30
    assert bc.wanted({}, ram=64 << 30) == bc.DEFAULT_CAP
    assert bc.wanted({"EMBER_MLX_CACHE_MIB": "300"}, ram=64 << 30) == 300 << 20
    assert bc.wanted({"EMBER_MLX_CACHE_MIB": "0"}, ram=64 << 30) is None  # MLX's own
    assert bc.wanted({"EMBER_MLX_CACHE_MIB": "lots"}, ram=8 << 30) == 1 << 30  # unreadable: the default


def test_raise_keeps_a_higher_limit_and_restores(monkeypatch):
    before = mx.set_cache_limit(32 << 20)
    try:
        monkeypatch.setenv("EMBER_MLX_CACHE_MIB", "64")
        assert bc.raise_limit() == 64 << 20
        assert mx.set_cache_limit(64 << 20) == 64 << 20  # in force
        mx.set_cache_limit(512 << 20)
        assert bc.raise_limit() == 512 << 20  # never lowered
        assert mx.set_cache_limit(512 << 20) == 512 << 20
        monkeypatch.setenv("EMBER_MLX_CACHE_MIB", "0")
        assert bc.raise_limit() == 0
    finally:
        mx.set_cache_limit(before)
