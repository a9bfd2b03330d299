"""Integrity by default (issue #23 item 7): damaged tensor bytes in an SSD
entry are never served. With the default settings (per-tensor xxh3 checked
on restore) the restart is a miss, the file is deleted, and the answer equals
the cold run's (the oracle: the same engine before anything was cached)."""

from __future__ import annotations

import os

import pytest

from ember.api import Engine
from engine.config import EngineConfig
from engine.kv import kvfile
from engine.kv.disk import RealDisk
from engine.types import SamplingParams


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the MLX thread needs a real loop
async def test_flipped_tensor_bytes_are_a_miss_and_the_file_goes_under_default_settings(tmp_path):
    from engine.models import resolve_model

    resolve_model("tiny")
    cfg = EngineConfig(backend="mlx", model="tiny", ssd_cache_dir=str(tmp_path / "ssd"), prefill_chunk=64)
    assert cfg.ssd_cache_verify, "verification is the default"
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    async with Engine.open(cfg) as engine:
        prompt = engine.encode("def restore(cache, tokens):\n    " * 20)[:300]
        cold = await engine.acomplete(prompt, sp)
        await engine.acomplete(engine.encode("x = 1"), SamplingParams(max_tokens=2))  # closes the row above into RAM
        assert (await engine.aflush()).durable
    paths = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ssd") for f in fs if f.endswith(".kv")]
    path = max(paths, key=lambda p: len(kvfile.read_header(RealDisk(), p)[0].tokens))
    header, start = kvfile.read_header(RealDisk(), path)
    # damage every layer's keys: half of each tensor's bytes, as a bad sector would
    with open(path, "r+b") as f:
        for layer in header.layers:
            slot = layer.tensors[0]
            f.seek(start + slot.off)
            f.write(b"\x7f" * (slot.bytes // 2))
    async with Engine.open(cfg) as engine:
        warm = await engine.acomplete(prompt, sp)
        s = engine.stats()["ssd_cache"]
        assert warm.token_ids == cold.token_ids
        assert s["corrupt_deleted"] == 1 and s["restores"] == 0 and not os.path.exists(path)
