"""What verifying every restored tensor costs: restore TTFT with the per-tensor
checksum on (the default) and off, side by side on one SSD entry.

    python -m bench.cache.verify [--prompt-tokens 8192] [--repeats 5]

One engine writes an N-token prefix to an SSD folder (``Engine.aflush``);
then, per repeat, two fresh engines on that folder ("restarts"), verify on and
off in alternating order, serve the same prompt: TTFT is submit → first
token, with the prefix restored from SSD. Also times the checksum alone
(xxh3-64 and the older blake2b-8) over the entry's tensor bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

import anyio
import xxhash

from bench.cache.ssd import _prompt, _ttft, _wait_for_puts
from ember.api import Engine
from engine.config import EngineConfig
from engine.kv import kvfile
from engine.kv.disk import RealDisk


def _cfg(args: argparse.Namespace, d: str, verify: bool) -> EngineConfig:
    return EngineConfig(
        backend="mlx", model=args.model, ssd_cache_dir=d, prefill_chunk=512, max_batch=4, ssd_cache_verify=verify
    )


def _hash_rates(d: str) -> dict[str, float]:
    (path,) = [os.path.join(p, f) for p, _, fs in os.walk(d) for f in fs if f.endswith(".kv")]
    reader = kvfile.KvReader(RealDisk(), path, verify=False)
    bufs = [b for i in range(len(reader.header.layers)) for b in reader.read_layer(i)]
    total = sum(len(b) for b in bufs)
    out = {"entry_mib": total / 2**20}
    for name, fn in (
        ("xxh3-64", xxhash.xxh3_64_hexdigest),
        ("blake2b-8", lambda b: hashlib.blake2b(b, digest_size=8).hexdigest()),
    ):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for b in bufs:
                fn(b)
            ts.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = statistics.median(ts) * 1000
    return out


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ember-bench-verify-") as d:
        async with Engine.open(_cfg(args, d, True)) as engine:
            prompt = _prompt(args.prompt_tokens, engine.info.vocab_size, seed=0)
            cold, _ = await _ttft(engine, prompt)
            await _wait_for_puts(engine)
            assert (await engine.aflush()).durable
        rates = _hash_rates(d)
        ttft: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats):
            for verify in (True, False) if r % 2 == 0 else (False, True):
                async with Engine.open(_cfg(args, d, verify)) as engine:
                    t, cached = await _ttft(engine, prompt)
                    assert cached == len(prompt) - 1, f"expected a restore, cached={cached}"
                    ttft[verify].append(t)
                print(f"  repeat {r} verify={'on ' if verify else 'off'}: {t * 1000:.1f} ms", file=sys.stderr)
    on, off = statistics.median(ttft[True]), statistics.median(ttft[False])
    ratios = statistics.median(a / b for a, b in zip(ttft[True], ttft[False]))
    per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(ttft[True], ttft[False]))
    print(f"`{args.model}`, {args.prompt_tokens}-token prompt, {args.repeats} repeats, on/off alternating")
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| SSD entry | {rates['entry_mib']:.1f} MiB |")
    print(f"| cold TTFT (full prefill) | {cold * 1000:.0f} ms |")
    print(f"| restore TTFT, verify on (median) | {on * 1000:.1f} ms |")
    print(f"| restore TTFT, verify off (median) | {off * 1000:.1f} ms |")
    print(f"| paired on/off ratio (median of repeats) | {ratios:.3f} (per repeat: {per_round}) |")
    print(f"| checksum alone, xxh3-64 | {rates['xxh3-64_ms']:.1f} ms |")
    print(f"| checksum alone, blake2b-8 (the previous hash) | {rates['blake2b-8_ms']:.1f} ms |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    anyio.run(main, ap.parse_args())
