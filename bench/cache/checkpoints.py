"""Repeat-the-same-long-prompt on models whose cache cannot be trimmed.

    python -m bench.cache.checkpoints [--tokens 2048] [--repeats 3] [--markdown]

For a sliding-window model (gemma3_text, window shorter than the prompt) and
a hybrid SSM model (lfm2), random weights (``sims.tiny_archs`` with wider
layers, so a prefill costs something), one engine each with the RAM prompt
cache on serves:

1. an N-token prompt cold (TTFT of a full prefill: the baseline),
2. the same prompt again ("repeat": served from the checkpoint at the
   prompt's end),
3. the next turn (prompt + reply + a new user line: served from the finished
   row's own entry, the longest prefix).

and, side by side in the same run, the same three requests with the
checkpoints off (``SchedulerCore.checkpointing = False``: what the engine did
before, only the finished row's entry is stored). TTFT is submit → first
token; each leg's median over ``--repeats`` (each repeat a fresh engine).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from ember.api import Engine
from engine.config import EngineConfig
from engine.types import SamplingParams
from sims.tiny_archs import build

WIDER = {
    "gemma3_text": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 256,
        "sliding_window_pattern": 3,
    },
    "lfm2": {
        "hidden_size": 256,
        "block_dim": 256,
        "block_ff_dim": 512,
        "num_hidden_layers": 6,
        "full_attn_idxs": [2, 5],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


async def _ttft(engine: Engine, prompt: list[int], sp: SamplingParams) -> tuple[float, int, list[int]]:
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    cached = 0
    async for d in engine.agenerate(prompt, sp):
        if first is None and d.token_ids:
            first = time.perf_counter() - t0
        tokens += d.token_ids
        if d.usage is not None:
            cached = d.usage.cached_tokens
    return first or 0.0, cached, tokens


async def one_run(path: pathlib.Path, n: int, checkpoints: bool, seed: int) -> dict[str, tuple[float, int]]:
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = np.random.default_rng(seed).integers(3, 2000, size=n).tolist()
    out: dict[str, tuple[float, int]] = {}
    warm = np.random.default_rng(seed + 99).integers(3, 2000, size=64).tolist()
    async with Engine.open(EngineConfig(model=str(path), max_batch=4)) as engine:
        engine.core.checkpointing = checkpoints and engine.core.checkpointing
        await _ttft(engine, warm, sp)  # first forwards of a fresh process compile kernels
        t, c, reply = await _ttft(engine, prompt, sp)
        out["cold"] = (t, c)
        t, c, _ = await _ttft(engine, prompt, sp)
        out["repeat"] = (t, c)
        turn = prompt + reply + np.random.default_rng(seed + 1).integers(3, 2000, size=32).tolist()
        t, c, _ = await _ttft(engine, turn, sp)
        out["next turn"] = (t, c)
    async with Engine.open(EngineConfig(model=str(path), max_batch=4, prompt_cache_gib=0)) as engine:
        await _ttft(engine, warm, sp)
        out["next turn cold"] = (await _ttft(engine, turn, sp))[:2]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    rows: list[tuple[Any, ...]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, over in WIDER.items():
            path = build(arch, pathlib.Path(tmp) / arch, **over)
            for checkpoints in (True, False):
                runs = [asyncio.run(one_run(path, args.tokens, checkpoints, seed)) for seed in range(args.repeats)]
                for leg in runs[0]:
                    ttft = statistics.median(r[leg][0] for r in runs)
                    cached = statistics.median(r[leg][1] for r in runs)
                    cold = statistics.median(r["next turn cold" if leg.startswith("next") else "cold"][0] for r in runs)
                    rows.append((arch, "on" if checkpoints else "off", leg, int(cached), ttft * 1000, ttft / cold))
    if args.markdown:
        print("| model | checkpoints | request | cached_tokens | TTFT ms (median) | vs cold prefill |")
        print("| --- | --- | --- | ---: | ---: | ---: |")
        for arch, on, leg, cached, ms, ratio in rows:
            print(f"| {arch} | {on} | {leg} | {cached} | {ms:.1f} | {ratio:.3f} |")
    else:
        for arch, on, leg, cached, ms, ratio in rows:
            print(
                f"{arch:<12} checkpoints={on:<3} {leg:<15} cached={cached:<5} ttft={ms:8.1f} ms  x{ratio:.3f} of cold"
            )


if __name__ == "__main__":
    main()
