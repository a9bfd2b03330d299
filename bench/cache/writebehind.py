"""Decode speed while a large write-behind is pending, against the SSD tier off.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python -m bench.cache.writebehind
    python -m bench.cache.writebehind --model PATH --rounds 7 --prefix-tokens 3000 --decode-tokens 256

Each round, for each arm (in a rotated order, so no arm always runs first):
prefill a long unique prompt (its KV becomes a large RAM entry and a dirty
write-behind key), then at once decode a short prompt for ``--decode-tokens``
tokens and, while it runs, ask for a flush, so a snapshot of the large entry
is forced onto the spill queue and its tensor writes are due. The decode's
tokens per second (first to last token) is the measurement.

Arms:
  off       no SSD tier at all (the baseline)
  on        SSD tier on: the writes wait for the engine to go idle
  ungated   SSD tier on with the idle gate disabled: the writes run during
            the decode (what the gate buys)

The report prints per-round numbers, the medians and the ratios to ``off``
measured in the same run; the write-behind contract is ``on/off >= 0.98``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ember import Engine, EngineConfig, Ports, SamplingParams

ARMS = ("off", "on", "ungated")


async def _puts(engine: Engine, n: int) -> None:
    """Wait for the RAM put of a finished row: it lands at the step that
    closes the row, just after the caller got its last token."""
    while engine.prefix_cache.stats()["puts"] < n:
        await asyncio.sleep(0.001)


async def one_round(
    arm: str, model: str, ssd: Path, rng: random.Random, prefix_tokens: int, decode_tokens: int
) -> dict[str, Any]:
    cfg = EngineConfig(backend="mlx", model=model, ssd_cache_dir=str(ssd) if arm != "off" else None, max_batch=4)
    async with Engine.open(cfg, ports=Ports(gated_writes=arm != "ungated")) as engine:
        vocab = engine.info.vocab_size
        # warm up the decode path (compiles, allocator) outside the measurement
        await engine.acomplete(
            [rng.randrange(3, vocab) for _ in range(8)], SamplingParams(max_tokens=8, ignore_eos=True)
        )
        await _puts(engine, 1)
        await engine.aflush()  # the warm-up entry is written now: the pending write below is the large one
        before = engine.prefix_cache.stats()["bytes"]
        big = [rng.randrange(3, vocab) for _ in range(prefix_tokens)]
        await engine.acomplete(big, SamplingParams(max_tokens=1))  # a large RAM entry, now a dirty key
        await _puts(engine, 2)
        entry_bytes = engine.prefix_cache.stats()["bytes"] - before

        flush_task = None
        times: list[float] = []
        cpu: list[float] = []  # process CPU (all threads): steadier than wall time on a shared machine
        pending_during = 0
        async for d in engine.agenerate(
            [rng.randrange(3, vocab) for _ in range(16)], SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        ):
            if d.token_ids:
                times.append(time.perf_counter())
                cpu.append(time.process_time())
            if flush_task is None:  # every arm asks (a no-op without the tier): the same loop everywhere
                flush_task = asyncio.ensure_future(engine.aflush())  # forces the snapshot mid-decode
            if arm != "off" and len(times) == decode_tokens // 2:
                pending_during = engine.stats()["ssd_cache"]["pending_spill_bytes"]
        assert flush_task is not None  # every arm started one
        report = await flush_task if arm != "off" else None
        if flush_task is not None and report is None:
            await flush_task
    tok_s = (len(times) - 1) / (times[-1] - times[0])
    return {
        "arm": arm,
        "decode_tok_s": round(tok_s, 2),
        "cpu_ms_per_token": round((cpu[-1] - cpu[0]) * 1000 / (len(cpu) - 1), 4),
        "entry_bytes": entry_bytes,
        "pending_spill_bytes_mid_decode": pending_during,
        "flush_durable": None if report is None else report.durable,
        "flush_ms": None if report is None else report.elapsed_ms,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="ember-bench-wb-"))
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            order = ARMS[r % 3 :] + ARMS[: r % 3]
            for arm in order:
                ssd = work / f"{arm}-{r}"
                row = await one_round(arm, args.model, ssd, rng, args.prefix_tokens, args.decode_tokens)
                row["round"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(ssd, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {arm: statistics.median(x["decode_tok_s"] for x in rows if x["arm"] == arm) for arm in ARMS}
    cpu = {arm: statistics.median(x["cpu_ms_per_token"] for x in rows if x["arm"] == arm) for arm in ARMS}
    by_round = {(x["round"], x["arm"]): x["decode_tok_s"] for x in rows}
    paired = {arm: [by_round[(r, arm)] / by_round[(r, "off")] for r in range(args.rounds)] for arm in ("on", "ungated")}
    return {
        "medians_tok_s": med,
        "medians_cpu_ms_per_token": cpu,
        "paired_median": {arm: round(statistics.median(v), 4) for arm, v in paired.items()},
        "paired": {arm: [round(x, 3) for x in v] for arm, v in paired.items()},
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache.writebehind", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="bundled model name or an mlx-lm model directory")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix-tokens", type=int, default=3000, help="length of the prompt whose KV is written behind")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    load0 = os.getloadavg()[0]
    res = asyncio.run(run(args))
    med, pm = res["medians_tok_s"], res["paired_median"]
    print(
        f"[bench_writebehind] median decode tok/s: off={med['off']:.1f} on={med['on']:.1f} ungated={med['ungated']:.1f}"
    )
    cpu = res["medians_cpu_ms_per_token"]
    print(
        f"[bench_writebehind] median CPU ms/token: off={cpu['off']:.3f} on={cpu['on']:.3f} ungated={cpu['ungated']:.3f}"
    )
    print(
        f"[bench_writebehind] paired per-round ratios on/off={res['paired']['on']} ungated/off={res['paired']['ungated']}"
    )
    print(
        f"[bench_writebehind] median paired on/off={pm['on']:.3f} (contract >= 0.98)  ungated/off={pm['ungated']:.3f}"
    )
    print(f"[bench_writebehind] load average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
